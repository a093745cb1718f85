"""``python -m nvray.bench``'s subcommands: arguments they cannot run are refused before
anything starts, with a message naming the problem; ``startup`` starts a real engine in a new
process and reports it; ``embed`` embeds real batches and reports them; ``serve --api
chat,messages,responses`` loads a real app through the three APIs; ``speculative`` and
``step-gap`` run every drafter they name with the plain engine's tokens (the benchmarks'
figures themselves are not tested: tests never time things)."""

import json
import subprocess
import sys

import pytest
import torch


def _bench(*args: str, cmd: str = "throughput") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvray.bench", cmd, *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(("args", "message"), [
    (("--runtimes", "inprocess", "--tensor-parallel-size", "2"), "needs the ray runtime"),
    (("--tensor-parallel-size", "1,0"), "each must be >= 1"),
    (("--tensor-parallel-size", "two"), "give sizes"),
    (("--runtimes", "inprocess", "--pipeline-parallel-size", "2"), "pipeline-parallel size above 1 needs the ray runtime"),
    (("--runtimes", "inprocess,cuda"), "choose from inprocess, ray"),
    (("--shape", "9b"), "invalid choice: '9b'"),
    (("--all-reduce", "auto,nvls"), "--all-reduce 'auto,nvls': give auto, nccl"),
])
def test_throughput_refuses_what_it_cannot_run(args: tuple[str, ...], message: str) -> None:
    result = _bench(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_throughput_runs_the_tiny_model_with_its_own_defaults() -> None:
    """``--model tiny`` with the default --max-model-len (4096, past the tiny model's 2048)
    and the workload's ids (up to 10000, past its vocabulary): said and fitted, then run."""
    result = _bench("--model", "tiny", "--runtimes", "inprocess", "--num-seqs", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "running with 2048" in result.stderr
    runs = json.loads(result.stdout[result.stdout.index("\n{\n") + 1:])["runs"]  # the summary
    assert runs and all(run["output_tokens"] > 0 for run in runs), runs


def test_allreduce_needs_two_gpus() -> None:
    result = _bench(cmd="allreduce")
    assert result.returncode != 0
    assert "allreduce: needs two or more GPUs" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("--runtimes", "inprocess,cuda"), "unknown runtime(s) cuda: choose from inprocess, ray"),
    (("--rounds", "0"), "0: must be >= 1"),
    (("--runtimes", ""), "nothing to start: give --runtimes or --serve"),
    (("--cluster", "remote"), "invalid choice: 'remote'"),
])
def test_startup_refuses_what_it_cannot_run(args: tuple[str, ...], message: str) -> None:
    result = _bench("--model", "tiny", *args, cmd="startup")
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_startup_reports_an_engine_started_in_a_new_process() -> None:
    result = _bench("--model", "tiny", "--runtimes", "inprocess", "--rounds", "1",
                    "--max-model-len", "256", cmd="startup")
    assert result.returncode == 0, result.stderr[-2000:]
    runs = [json.loads(line) for line in result.stdout.splitlines()
            if line.startswith('{"startup_run"')]
    assert [(r["startup_run"], r["cluster"]) for r in runs] == [("inprocess", "own")]
    run = runs[0]
    phases = run["startup"]["phases_s"]
    assert {"imports", "model_and_weights", "kv_cache", "engine"} <= phases.keys()
    assert 0 < sum(phases.values()) <= run["wall_s"]  # the engine's phases lie inside the wall
    summary = json.loads(result.stdout[result.stdout.index("\n{\n") + 1:])
    assert summary == {"startup_medians": {"inprocess": {"wall_s_median": run["wall_s"],
                                                         "runs": 1}},
                       "runs": [run]}  # the JSON of --out keeps each run's phases


@pytest.mark.parametrize(("args", "message"), [
    (("--runtimes", "ray", "--cluster", "head"), "ray stop --force stops every Ray process here"),
    (("--runtimes", "", "--serve"), "serve run would join it, and its Ctrl-C shuts Serve down"),
])
def test_startup_will_not_stop_or_join_a_running_ray(ray_cluster, args, message) -> None:
    """The session's cluster runs in this process: the bench refuses instead of stopping it."""
    import ray

    result = _bench("--model", "tiny", *args, cmd="startup")
    assert result.returncode != 0
    assert "Ray is running on this machine" in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr
    assert ray.get(ray.put("still here"), timeout=30) == "still here"


def test_embed_reports_rows_and_tokens_per_second() -> None:
    """Two token budgets, each a warm-up and two timed passes of fresh prompts: every run
    reports its rates, and no pass hits the prefix cache."""
    result = _bench("--model", "tiny", "--input-len", "32", "--batch", "8", "--repeats", "2",
                    "--max-num-batched-tokens", "64,128", cmd="embed")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("embed inprocess")]
    assert [line.split(":")[0] for line in lines] == [
        "embed inprocess, max_num_batched_tokens 64", "embed inprocess, max_num_batched_tokens 128"]
    assert all("prompt tokens/s" in line and "rows/s (median of 2)" in line for line in lines)
    summary = json.loads(result.stdout[result.stdout.index("\n{\n") + 1:])
    assert (summary["benchmark"], summary["input_len"], summary["batch"]) == ("embed", 32, 8)
    assert "L(L+1)/2" in summary["floor_formula"]
    assert summary["flops_per_prompt"] == _prefill_flops_by_hand(32)
    for run in summary["runs"]:
        assert run["prompt_tok_per_s"] > 0 and run["rows_per_s"] > 0
        assert len(run["pass_s_all"]) == 2 and run["prefix_cache_hit_tokens"] == 0
        assert run["prefill_steps_per_pass"] >= 8 * 32 / run["max_num_batched_tokens"]


def _prefill_flops_by_hand(length: int) -> int:
    """The tiny model's forward FLOPs for one prompt: 2 x the decoder layers' linear parameters
    per token, and QK^T + PV over the causal (query, key) pairs of every layer."""
    from nvray.models.tiny import tiny_model_path

    with open(f"{tiny_model_path()}/config.json") as f:
        cfg = json.load(f)
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    q, kv = heads * d, cfg["num_key_value_heads"] * d
    params = layers * (h * q + 2 * h * kv + q * h + 3 * h * cfg["intermediate_size"])
    return 2 * params * length + 2 * 2 * layers * heads * d * length * (length + 1) // 2


def test_embed_refuses_an_unknown_runtime() -> None:
    result = _bench("--model", "tiny", "--runtimes", "inprocess,cuda", cmd="embed")
    assert result.returncode != 0
    assert "--runtimes: unknown ['cuda']; choose from ['inprocess', 'ray']" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_refuses_an_unknown_api() -> None:
    result = _bench("--api", "chat,claude", "--url", "http://127.0.0.1:9", cmd="serve")
    assert result.returncode != 0
    assert "--api 'chat,claude': give one or more of completions, chat, messages, responses" \
        in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_runs_chat_messages_and_responses_side_by_side(serve_http) -> None:
    """The same load through the three APIs against one app: every request answered, each
    API's tokens counted from its own stream, ratios to chat's figures."""
    from ray import serve

    from deployments import build_app
    from nvray.bench.http_load import wait_healthy

    serve.run(build_app({"max_model_len": 128, "num_cpus_per_rank": 1}), name="bench-apis",
              route_prefix="/bench-apis")
    try:
        wait_healthy(f"{serve_http}/bench-apis")
        result = _bench("--url", f"{serve_http}/bench-apis", "--api", "chat,messages,responses",
                        "--concurrency", "2", "--num-requests", "2", "--stream", "on",
                        "--prompt-len", "8", "--output-len", "4", cmd="serve")
    finally:
        serve.delete("bench-apis")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout[result.stdout.index("\n{\n") + 1:])
    assert summary["api"] == "chat,messages,responses"
    assert [(r["api"], r["completed"], r["errors"]) for r in summary["levels"]] == [
        ("chat", 2, 0), ("messages", 2, 0), ("responses", 2, 0)]
    rows = summary["side_by_side"]
    assert [r["api"] for r in rows] == ["chat", "messages", "responses"]
    for row in rows:
        assert row["ttft_ms_p50"] > 0 and 0 < row["output_tokens"] <= 2 * 4
        assert row["ttft_vs_chat"] > 0 and row["tok_per_s_vs_chat"] > 0
    assert rows[0]["ttft_vs_chat"] == rows[0]["tok_per_s_vs_chat"] == 1.0
    # and a table for people on stderr: a row per level, its figures as in the JSON
    table = result.stderr[result.stderr.index("api  conc"):].splitlines()
    assert "TTFT p50" in table[0] and set(table[1]) <= {"-", " "}
    for line, level in zip(table[2:5], summary["levels"]):
        cells = line.split()
        assert cells[:4] == [level["api"], "2", "on", "2/2"], line
        assert float(cells[4]) == level["output_tok_per_s"]
        assert float(cells[5]) == round(level["ttft_ms"]["p50"], 1)


def test_serve_help_gives_each_options_default() -> None:
    result = subprocess.run([sys.executable, "-m", "nvray.bench", "serve", "--help"],
                            capture_output=True, text=True, timeout=60, check=True)
    text = " ".join(result.stdout.split())
    for option, default in (("--concurrency CONCURRENCY comma-separated levels", "1,8,64,256"),
                            ("--prompt-len PROMPT_LEN", "256"), ("--stream {both,on,off}", "both"),
                            ("--seed SEED", "0"), ("--port PORT port of the app this starts", "8000")):
        assert f"{option} (default: {default})" in text, option


def test_speculative_mtp_runs_the_targets_own_head_with_the_plain_engines_tokens(
        tmp_path, family_path) -> None:
    """``speculative --mtp`` on a Qwen3.5 checkpoint with an MTP head: random (never right on
    the echoed target), then echoed (always right, the hybrid's state applied a whole verified
    run at a time): every run gives the plain engine's tokens."""
    from mtp_oracle import write_mtp_checkpoint

    path = write_mtp_checkpoint(str(tmp_path / "mtp"), family_path("qwen3_5"), seed=3)
    out = tmp_path / "spec.json"
    result = _bench("--model", path, "--mtp", "--no-host-drafters", "--concurrency", "1,2",
                    "--input-len", "12", "--output-len", "21", "--repeats", "1", "--out",
                    str(out), cmd="speculative")
    assert result.returncode == 0, result.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert {run["drafter"] for run in runs} == {"mtp_random_fixed", "mtp_random_adaptive",
                                               "mtp_random_policy", "mtp_echo_fixed"}
    assert all(run["same_tokens_share"] == 1.0 for run in runs), runs
    echoed = [run for run in runs if run["drafter"] == "mtp_echo_fixed"]
    assert all(run["mean_acceptance_length"] == 5.0 for run in echoed), echoed


def test_speculative_runs_every_drafter_with_the_plain_engines_tokens(tmp_path) -> None:
    """``speculative --draft-model --eagle3``: the tiny model, echoed, drafting for an echoed
    target, and an EAGLE-3 head of its shape: every run gives the plain engine's tokens;
    echoed, each drafter is always right (21 tokens: the first, then four runs of k + 1 = 5)."""
    out = tmp_path / "spec.json"
    result = _bench("--model", "tiny", "--draft-model", "tiny", "--eagle3", "--concurrency", "1,3",
                    "--input-len", "12", "--output-len", "21", "--repeats", "1", "--out",
                    str(out), cmd="speculative")
    assert result.returncode == 0, result.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    names = {run["drafter"] for run in runs}
    assert names == {"draft_model_random_fixed", "draft_model_random_adaptive",
                     "draft_model_random_policy", "draft_model_echo_fixed", "eagle3_random_fixed",
                     "eagle3_random_adaptive", "eagle3_random_policy", "eagle3_echo_fixed",
                     "oracle", "never_right", "never_right_adaptive", "never_right_policy", "ngram"}
    assert len(runs) == 2 * len(names)
    assert all(run["same_tokens_share"] == 1.0 for run in runs), runs
    echoed = [run for run in runs if run["drafter"] in ("draft_model_echo_fixed",
                                                         "eagle3_echo_fixed")]
    assert all(run["mean_acceptance_length"] == 5.0 for run in echoed), echoed


def test_step_gap_times_a_drafting_step_beside_a_plain_one(tmp_path) -> None:
    """``step-gap`` on the tiny model (echoed): a plain pass and one drafting with the oracle at
    each concurrency, every host piece timed (proposing only where drafts are), fewer steps for
    the same tokens where drafts are accepted; a device span with CUDA only."""
    out = tmp_path / "gap.json"
    result = _bench("--model", "tiny", "--concurrency", "1,2", "--input-len", "12",
                    "--output-len", "21", "--out", str(out), cmd="step-gap")
    assert result.returncode == 0, result.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(run["mode"], run["concurrency"]) for run in runs] == [
        ("plain", 1), ("plain", 2), ("speculative", 1), ("speculative", 2)]
    pieces = ("step_us", "schedule_us", "step_input_us", "apply_answer_us", "rank_forward_us",
              "rank_sample_us", "wait_for_ids_us")
    for run in runs:
        assert run["tok_per_s"] > 0
        assert (run["device_span_ms"] is None) == (not torch.cuda.is_available())
        assert all(run[piece] > 0 for piece in pieces), run
        assert ("propose_us" in run) == (run["mode"] == "speculative")
    assert runs[2]["steps"] < runs[0]["steps"] and runs[3]["steps"] < runs[1]["steps"]
