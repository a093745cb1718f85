"""The Serve app over real HTTP on 127.0.0.1 with the real openai client: completions and chat,
streaming and not, usage, metrics, the bad-input matrix, disconnects, handles from Ray tasks."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import requests

from serve_helpers import MAX_MODEL_LEN, greedy, metric


def test_completion_matches_offline_and_counts_usage(client, offline):
    prompt = "The engine schedules"
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    expected = offline.generate(prompt, greedy(12), use_tqdm=False)[0]
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == 12 and resp.usage.total_tokens == resp.usage.prompt_tokens + 12


def test_batch_of_prompts_and_token_ids(client, offline):
    prompts = ["first prompt", "second, longer prompt here"]
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    expected = offline.generate(prompts, greedy(5), use_tqdm=False)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [e.text for e in expected]
    ids = offline.tokenizer.encode("token ids in", add_special_tokens=False)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == offline.generate(ids, greedy(5), use_tqdm=False)[0].text


def test_streaming_completion_with_usage(client, offline):
    prompt = "Streaming is"
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline.generate(prompt, greedy(16), use_tqdm=False)[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_streaming_and_not(client, offline):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello!"}]
    expected = offline.chat(messages, greedy(10), use_tqdm=False)[0]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_fills_the_context(client):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens + resp.usage.completion_tokens == MAX_MODEL_LEN
    assert resp.choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_over_http(client):
    kwargs = dict(model="tiny", prompt="seeded", max_tokens=12, temperature=1.0, top_p=0.9, seed=7,
                  extra_body={"ignore_eos": True})
    assert client.completions.create(**kwargs).choices[0].text == \
        client.completions.create(**kwargs).choices[0].text


def test_models_health_and_metrics(base_url, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert requests.get(f"{base_url}/health", timeout=30).status_code == 200
    before = metric(base_url, "nvray_generation_tokens_total")
    kinds = ("prefill", "decode")
    steps = {kind: metric(base_url, "nvray_steps_total", kind=kind) for kind in kinds}
    seconds = {kind: metric(base_url, "nvray_step_seconds_total", kind=kind) for kind in kinds}
    start = time.perf_counter()
    client.completions.create(model="tiny", prompt="count me", max_tokens=4, extra_body={"ignore_eos": True})
    wall = time.perf_counter() - start
    assert metric(base_url, "nvray_generation_tokens_total") == before + 4
    # the short prompt is one prefill step; tokens 2-4 each take a decode step
    assert metric(base_url, "nvray_steps_total", kind="prefill") == steps["prefill"] + 1
    assert metric(base_url, "nvray_steps_total", kind="decode") >= steps["decode"] + 3
    spent = {kind: metric(base_url, "nvray_step_seconds_total", kind=kind) - seconds[kind]
             for kind in kinds}
    assert 0 < spent["prefill"] and 0 < spent["decode"] and sum(spent.values()) < wall
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    for name in ("nvray_num_requests_running", "nvray_num_requests_waiting", "nvray_kv_cache_usage_ratio",
                 "nvray_prefix_cache_hit_rate", "nvray_prompt_tokens_total", "nvray_num_preemptions_total",
                 'nvray_time_to_first_token_seconds_bucket{model_name="tiny",le="+Inf"}',
                 "nvray_inter_token_latency_seconds_count"):
        assert name in text
    assert metric(base_url, "nvray_time_to_first_token_seconds_count") >= 1
    assert metric(base_url, "nvray_driver_resident_memory_bytes") > 50 << 20  # a live Python + torch
    assert metric(base_url, "nvray_startup_seconds", phase="model_and_weights") > 0  # start-up
    assert metric(base_url, "nvray_startup_seconds", phase="rank_actors") > 0
    assert metric(base_url, "nvray_startup_total_seconds") > metric(
        base_url, "nvray_startup_seconds", phase="model_and_weights")  # the whole start


def _families(base_url: str) -> dict[str, object]:
    """/metrics parsed by prometheus_client's own parser (a malformed line raises)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{base_url}/metrics", timeout=30).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def _sample(families: dict, name: str, **labels: str) -> float:
    family = families[name.removesuffix("_total").removesuffix("_sum").removesuffix("_count")]
    return sum(s.value for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_vllm_metric_names_count_each_request_and_the_dashboard_reads_only_served_ones(
        base_url, client):
    """What a vLLM dashboard reads: vLLM's names and labels, counting what the user saw."""
    before = _families(base_url)
    start = time.perf_counter()
    resp = client.completions.create(model="tiny", prompt="measure me", max_tokens=5,
                                     extra_body={"ignore_eos": True})
    wall = time.perf_counter() - start
    after = _families(base_url)

    def grew(name: str, **labels: str) -> float:
        return _sample(after, name, **labels) - _sample(before, name, **labels)

    assert grew("vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:generation_tokens_total") == 5
    assert grew("vllm:prompt_tokens_total") == resp.usage.prompt_tokens
    assert grew("vllm:request_prompt_tokens_sum") == resp.usage.prompt_tokens
    assert grew("vllm:request_generation_tokens_sum") == 5
    assert grew("vllm:request_params_max_tokens_sum") == 5
    assert grew("vllm:request_params_n_count") == 1
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert grew(f"vllm:{name}_count") == 1, name
    assert grew("vllm:inter_token_latency_seconds_count") == 4  # 5 tokens, one step each
    e2e = grew("vllm:e2e_request_latency_seconds_sum")
    phases = sum(grew(f"vllm:request_{phase}_time_seconds_sum")
                 for phase in ("queue", "prefill", "decode"))
    assert 0 < phases <= e2e < wall  # the phases lie within the request, inside the client's wait
    assert grew("vllm:iteration_tokens_total_count") >= 5  # its prefill and four decodes
    assert 0 <= _sample(after, "vllm:kv_cache_usage_perc", model_name="tiny") <= 1
    # the shipped dashboard's queries name only families this app serves
    dashboard = json.loads((Path(__file__).parents[2] / "docs/grafana/nvray.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {re.sub(r"_(bucket|sum|count|total)$", "", m)
             for e in exprs for m in re.findall(r"\b(?:vllm:|nvray_)[a-z0-9_]+", e)}
    served = {name for name, family in after.items() if family.samples}
    assert len(named) >= 15 and named <= served, named - served


def _replica_logs(app: str) -> str:
    import glob

    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    return "".join(open(path).read() for path in
                   glob.glob(f"{session}/logs/serve/replica_{app}_NvrayServer_*.log"))


@pytest.mark.parametrize("app, prefix", [("default", ""), ("long", "/long")])
def test_health_polls_answered_200_stay_out_of_the_replicas_access_log(
        base_url, long_base_url, app, prefix):
    """A load balancer polls /health every few seconds: an INFO line each buried the log
    (an app's route prefix is in its lines: /long/health)."""
    url = f"{base_url}{prefix}"
    other = f"GET {prefix}/v1/models/{{model_id:path}} 404"  # the route's pattern is logged
    before = _replica_logs(app).count(other)
    for _ in range(3):
        assert requests.get(f"{url}/health", timeout=30).status_code == 200
    assert requests.get(f"{url}/v1/models/no-such-model", timeout=30).status_code == 404
    deadline = time.monotonic() + 30
    while _replica_logs(app).count(other) == before and time.monotonic() < deadline:
        time.sleep(0.5)
    logs = _replica_logs(app)
    assert logs.count(other) == before + 1  # every other request still logs, after the polls
    assert f"GET {prefix}/health 200" not in logs


BAD_REQUESTS = [
    ("completions", {"prompt": "x " * 600, "max_tokens": 4}, 400, None),
    ("completions", {"prompt": "hello", "max_tokens": MAX_MODEL_LEN}, 400, None),
    ("completions", {"prompt": "hello", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hello", "top_p": 2}, 400, "top_p"),
    ("completions", {"prompt": "hello", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": ""}, 400, None),
    ("completions", {"prompt": [1, 2, 10**7]}, 400, None),
    ("completions", {"prompt": "hello", "n": -1}, 400, "n"),
    ("completions", {"prompt": "hello", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": "hello", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 9}, 400,
     "frequency_penalty"),
]


@pytest.mark.parametrize("path,payload,status,param", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error_and_the_app_stays_healthy(base_url, path, payload, status, param):
    resp = requests.post(f"{base_url}/v1/{path}", json={"model": "tiny", **payload}, timeout=30) \
        if "model" not in payload else requests.post(f"{base_url}/v1/{path}", json=payload, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"] and "/" not in error["message"]
    if param:
        assert error["param"] == param
    assert requests.get(f"{base_url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'"a string"', b""])
def test_malformed_bodies_are_400(base_url, body):
    resp = requests.post(f"{base_url}/v1/completions", data=body,
                         headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_disconnect_mid_stream_aborts_and_frees_blocks(base_url):
    with requests.post(f"{base_url}/v1/completions", stream=True, timeout=60,
                       json={"model": "tiny", "prompt": "a long one", "max_tokens": 400,
                             "stream": True, "ignore_eos": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith(b"data: {") for line in got)
        assert metric(base_url, "nvray_num_requests_running") == 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (metric(base_url, "nvray_num_requests_running") > 0
                                           or metric(base_url, "nvray_kv_cache_usage_ratio") > 0):
        time.sleep(0.2)
    assert metric(base_url, "nvray_num_requests_running") == 0
    assert metric(base_url, "nvray_kv_cache_usage_ratio") == 0.0


def test_sse_stream_ends_with_done(base_url):
    resp = requests.post(f"{base_url}/v1/chat/completions", timeout=60,
                         json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                               "max_tokens": 3, "stream": True})
    events = [line for line in resp.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[len("data: "):]) for e in events[:-1])


def test_handles_from_another_ray_task(base_url, ray_cluster, offline):
    ray = ray_cluster

    @ray.remote(num_cpus=0.1)
    def call_handles(prompt: str) -> tuple:
        from ray import serve as s

        handle = s.get_app_handle("default")
        out = handle.generate.remote(prompt, {"temperature": 0.0, "max_tokens": 6,
                                              "ignore_eos": True}).result()
        stream = handle.options(stream=True).generate_stream.remote(
            [{"role": "user", "content": prompt}], {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True})
        deltas = list(stream)
        return out.text, out.finish_reason, out.usage, "".join(d.delta_text for d in deltas), deltas[-1].text

    text, reason, usage, streamed, final = ray.get(call_handles.remote("handle me"), timeout=120)
    assert text == offline.generate("handle me", greedy(6), use_tqdm=False)[0].text
    assert reason == "length" and usage["completion_tokens"] == 6
    chat = offline.chat([{"role": "user", "content": "handle me"}], greedy(6), use_tqdm=False)[0]
    assert streamed == final == chat.text
