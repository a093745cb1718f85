"""The bad-input matrix: every malformed or invalid request gets a 4xx in OpenAI's error shape
with a short message (no traceback, no path, bounded size, naming the parameter where there is
one), and after each the engine is clean: healthy, nothing running or waiting, every KV block
free, and a greedy canary still returns the offline engine's text."""

from __future__ import annotations


import pytest
import requests

from deployments.ingress.body_limit import MAX_REQUEST_BODY_BYTES
from serve_helpers import MAX_MODEL_LEN, assert_counters_balance, greedy, metric

CANARY = "the canary sings"
MSG = [{"role": "user", "content": "hi"}]

# (path, JSON payload or raw bytes, content type, status, param)
CASES = [
    ("completions", {"prompt": "hello", "max_tokens": -1}, None, 400, "max_tokens"),
    ("completions", {"prompt": "hello", "temperature": "hot"}, None, 400, "temperature"),
    ("completions", {"prompt": "hello", "temperature": 2.5}, None, 400, "temperature"),
    ("chat/completions", {"messages": MSG, "temperature": 3}, None, 400, "temperature"),
    ("completions", {"prompt": "hello", "top_k": -5}, None, 400, "top_k"),
    ("completions", {"prompt": "hello", "min_p": 2}, None, 400, "min_p"),
    ("completions", {"prompt": "hello", "top_p": 0}, None, 400, "top_p"),
    ("completions", {"prompt": "hello", "stop": 5}, None, 400, "stop"),
    ("completions", {"prompt": "hello", "seed": "x"}, None, 400, "seed"),
    ("completions", {"prompt": "hello", "min_tokens": -2}, None, 400, "min_tokens"),
    ("completions", {"prompt": []}, None, 400, None),
    ("completions", {"prompt": [[]]}, None, 400, None),
    ("completions", {"prompt": [-1]}, None, 400, None),
    ("completions", {"prompt": [1.5, 2]}, None, 400, "prompt"),
    ("completions", {"prompt": [-1] * 10_000}, None, 400, None),
    ("completions", {"prompt": "hello", "n": 0}, None, 400, "n"),
    ("completions", {"prompt": "hello", "echo": 1.5}, None, 400, "echo"),
    ("completions", {"prompt": "hello", "logprobs": 99}, None, 400, "logprobs"),
    ("completions", {"prompt": "hello", "best_of": 3}, None, 400, "best_of"),
    ("completions", {"prompt": "hello", "suffix": "x"}, None, 400, "suffix"),
    ("completions", {"prompt": "hello", "logit_bias": {"5": "up"}}, None, 400, "logit_bias.5"),
    ("completions", {"prompt": "hello", "stream": True, "max_tokens": MAX_MODEL_LEN}, None, 400, None),
    ("chat/completions", {"messages": [{"role": "user"}]}, None, 400, None),
    ("chat/completions", {"messages": "hi"}, None, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}] * 10_000}, None, 400, None),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     None, 400, None),
    ("chat/completions", {"messages": MSG, "max_completion_tokens": 0}, None, 400, None),
    ("completions", b'{"prompt": "\xff\xfe hello"}', "application/json", 400, None),
    ("completions", b'{"prompt": "truncat', "application/json", 400, None),
    ("completions", b"prompt=hello", "application/x-www-form-urlencoded", 415, None),
    ("completions", b'{"prompt": "hello"}', None, 415, None),  # JSON, but not said to be
    ("completions", b"", None, 400, None),
    ("completions", b"x" * (MAX_REQUEST_BODY_BYTES + 1), "application/json", 413, None),
    ("completions", {"prompt": "hello", "model": "not-served"}, None, 404, "model"),
]


@pytest.fixture(scope="module")
def canary_text(offline) -> str:
    return offline.generate(CANARY, greedy(8), use_tqdm=False)[0].text


def assert_engine_clean(base_url: str, canary_text: str) -> None:
    assert requests.get(f"{base_url}/health", timeout=30).status_code == 200
    out = requests.post(f"{base_url}/v1/completions", timeout=60, json={
        "prompt": CANARY, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
    assert out["choices"][0]["text"] == canary_text
    assert metric(base_url, "nvray_num_requests_running") == 0
    assert metric(base_url, "nvray_num_requests_waiting") == 0
    assert metric(base_url, "nvray_kv_cache_usage_ratio") == 0.0
    assert_counters_balance(base_url)


@pytest.mark.parametrize("path,payload,content_type,status,param", CASES,
                         ids=[f"{i}-{c[0]}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_request_gets_a_short_openai_error_and_the_engine_stays_clean(
        base_url, canary_text, path, payload, content_type, status, param):
    url = f"{base_url}/v1/{path}"
    if isinstance(payload, bytes):  # a None content type: no Content-Type header
        resp = requests.post(url, data=payload, headers={"Content-Type": content_type}, timeout=60)
    else:
        resp = requests.post(url, json={"model": "tiny", **payload}, timeout=60)
    assert resp.status_code == status, resp.text[:500]
    assert len(resp.content) < 2000, "an error answer stays small whatever the input"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if status == 415:  # it names the content type it wants and the one that came
        assert "'Content-Type: application/json'" in error["message"]
        assert (content_type or "no Content-Type") in error["message"]
    else:
        assert "/" not in error["message"]
    if param:
        assert error["param"] == param
    assert_engine_clean(base_url, canary_text)


def test_a_prompt_that_just_fits_max_model_len_is_served(base_url, offline, canary_text):
    ids = offline.tokenizer.encode("fits " * 400, add_special_tokens=False)[:MAX_MODEL_LEN - 4]
    resp = requests.post(f"{base_url}/v1/completions", timeout=60, json={
        "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text[:500]
    assert resp.json()["usage"]["total_tokens"] == MAX_MODEL_LEN
    one_more = requests.post(f"{base_url}/v1/completions", timeout=60, json={
        "prompt": ids, "max_tokens": 5, "temperature": 0})
    assert one_more.status_code == 400 and "exceeds max_model_len" in one_more.json()["error"]["message"]
    assert_engine_clean(base_url, canary_text)


def served_routes(base_url: str) -> list[str]:
    """"METHOD /path" of every API route, from the app's OpenAPI schema (FastAPI's)."""
    paths = requests.get(f"{base_url}/openapi.json", timeout=30).json()["paths"]
    return [f"{method.upper()} {path}" for path, methods in paths.items() for method in methods]


@pytest.mark.parametrize("method,path,status", [
    ("POST", "/v1/moderations", 404), ("GET", "/v2/models", 404), ("GET", "/v1/completions", 405)])
def test_an_unknown_route_is_answered_with_the_routes_the_app_serves(
        base_url, long_base_url, method, path, status):
    """A 404 (405 for a route's wrong method) in OpenAI's shape that lists every route the app
    serves, as the client reaches them: under the app's route prefix too."""
    for base, prefix in ((base_url, ""), (long_base_url, "/long")):
        resp = requests.request(method, f"{base}{path}", json={}, timeout=60)
        assert resp.status_code == status, resp.text[:500]
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == ("unknown_url" if status == 404 else "method_not_allowed")
        assert f"({method} {prefix}{path})" in error["message"]
        routes = error["message"].split("this app serves ", 1)[1].split(", ")
        assert sorted(routes) == sorted(f"{r.split()[0]} {prefix}{r.split()[1]}"
                                        for r in served_routes(base_url))
        assert "POST /v1/chat/completions" in served_routes(base_url)
        assert len(resp.content) < 2000
    if status == 405:
        assert resp.headers["allow"] == "POST"


def test_openai_clients_see_an_unknown_route_as_not_found(client):
    import openai

    with pytest.raises(openai.NotFoundError, match="POST /v1/chat/completions"):
        client.moderations.create(model="tiny", input="hello")
