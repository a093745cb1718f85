"""Batch inference as a Ray job (``python -m nvray.batch``).

The jobs run on the session's two-node cluster (``ray start --head`` + ``ray start --address``,
own ports and temp dirs, so it never meets the session's ``ray_cluster``), with Ray's token
authentication on; the job is submitted with the real ``ray job submit`` CLI and its greedy
outputs are compared with the offline in-process LLM. The same input as Parquet, run directly
against that cluster with two engines sized so that one node holds only one, must give the
same rows, with an engine on each node. Malformed inputs fail before anything runs, naming the
row; engine failures inside a pool actor are retried on a new engine (checked with a fake
engine, no Ray).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nvray.batch.io import input_schema
from ray_nodes import RAY_CLI, REPO, SECOND_NODE_IP, TOKEN, Cluster, child_env

MAX_TOKENS, MAX_MODEL_LEN = 8, 96
JOB_TIMEOUT_S = 420
GOOD_ROWS = [
    {"id": "p0", "prompt": "Hello, nvray"},
    {"id": "p1", "prompt": "The quick brown fox jumps over the lazy dog."},
    {"id": "c0", "messages": [{"role": "user", "content": "Hi!"}]},
    {"id": "p2", "prompt": "Ray is a unified framework for scaling AI and Python applications."},
    {"id": "c1", "messages": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "What is a paged KV cache?"}]},
    {"id": "p3", "prompt": "def main(): print('hello, world')"},
]
BAD_ROWS = [  # valid input, but the engine rejects them: error rows, the job goes on
    {"id": "too-long", "prompt": "Hello world! " * 200},
    {"id": "empty", "prompt": ""},
]
ROWS = GOOD_ROWS[:3] + BAD_ROWS[:1] + GOOD_ROWS[3:] + BAD_ROWS[1:]
COMMON_ARGS = ["--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--temperature", "0",
               "--max-model-len", str(MAX_MODEL_LEN), "--batch-size", "3"]


# ------------------------------------------------------------------------------ helpers
def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_output(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_batch(args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvray.batch", *args], cwd=REPO,
                          env=child_env(**env), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ray_head(two_nodes) -> Cluster:
    """The session's two-node cluster (``ray start --head`` + ``ray start --address``)."""
    return two_nodes


def test_the_head_refuses_callers_without_its_token(ray_head):
    import requests

    assert requests.get(f"{ray_head.dashboard_url}/api/jobs/", timeout=30).status_code in (401, 403)
    wrong = requests.get(f"{ray_head.dashboard_url}/api/jobs/", timeout=30,
                         headers={"Authorization": "Bearer not-the-token"})
    assert wrong.status_code in (401, 403)
    right = requests.get(f"{ray_head.dashboard_url}/api/jobs/", timeout=30,
                         headers={"Authorization": f"Bearer {TOKEN}"})
    assert right.status_code == 200


# ----------------------------------------------------------------------------- the oracle
@pytest.fixture(scope="module")
def expected(tiny_path) -> dict[str, str]:
    """Greedy texts of the good rows from the offline in-process LLM."""
    from nvray import LLM, SamplingParams

    llm = LLM("tiny", runtime="inprocess", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        texts = {}
        for row in GOOD_ROWS:
            if "prompt" in row:
                out = llm.generate([row["prompt"]], params, use_tqdm=False)[0]
            else:
                out = llm.chat([row["messages"]], params, use_tqdm=False)[0]
            texts[row["id"]] = out.text
        return texts
    finally:
        llm.shutdown()


def check_rows(rows: list[dict[str, Any]], expected: dict[str, str]) -> None:
    assert [r["id"] for r in rows] == [r["id"] for r in ROWS]  # one per input row, in order
    by_id = {r["id"]: r for r in rows}
    for rid, text in expected.items():
        row = by_id[rid]
        assert row["error"] is None, row
        assert row["text"] == text
        assert row["finish_reason"] == "length"
        assert row["completion_tokens"] == MAX_TOKENS and row["prompt_tokens"] > 0
    assert "max_model_len" in by_id["too-long"]["error"]
    assert "empty" in by_id["empty"]["error"]
    for rid in ("too-long", "empty"):
        assert by_id[rid]["text"] is None and by_id[rid]["completion_tokens"] is None


# ------------------------------------------------------------------------- on a real head
def submit_batch_job(head: Cluster, *batch_args: str) -> subprocess.CompletedProcess:
    """``ray job submit ... -- python -m nvray.batch <batch_args>`` against ``head``."""
    runtime_env = {"excludes": [".git", ".venv", "**/__pycache__", "*.egg-info", "build", "dist"],
                   "env_vars": {"NVRAY_CACHE_DIR": os.environ["NVRAY_CACHE_DIR"]}}
    cmd = [RAY_CLI, "job", "submit", "--address", head.dashboard_url,
           "--working-dir", str(REPO), "--runtime-env-json", json.dumps(runtime_env), "--",
           "python", "-m", "nvray.batch", *batch_args]
    return subprocess.run(cmd, env=child_env(), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def submitted(ray_head, tmp_path_factory, tiny_path) -> Path:
    """The JSON Lines input run as a job with ``ray job submit``, one engine."""
    work = tmp_path_factory.mktemp("submitted")
    src, out = write_jsonl(work / "prompts.jsonl", ROWS), work / "out.jsonl"
    proc = submit_batch_job(ray_head, "--input", str(src), "--output", str(out),
                            "--concurrency", "1", *COMMON_ARGS)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout
    assert "8 rows, 2 errors" in proc.stdout and "output tokens/s" in proc.stdout
    return out


def test_submitted_job_matches_offline_greedy_and_reports_bad_rows(submitted, expected):
    check_rows(read_output(submitted), expected)


def head_cli(head: Cluster, group: str, command: str, *args: str, timeout: float = 60) -> str:
    return head.cli(group, command, *args, timeout=timeout)


def live_engine_actors(head: Cluster) -> list[str]:
    return [a["class_name"] for a in head.live_actors()
            if a["class_name"] in ("EngineDriver", "RankWorker")]


def test_a_job_stopped_mid_run_leaves_no_engine_and_no_output(ray_head, tmp_path):
    """``ray job stop`` while the engine generates: the job ends STOPPED, its engine's actors
    go within a minute, and no output file appears (output is written only on success)."""
    # far more work than the seconds before the stop (a faster engine once finished 64 rows)
    rows = [{"id": f"r{i}", "prompt": f"row {i} keeps the engine busy"} for i in range(512)]
    src, out = write_jsonl(tmp_path / "long.jsonl", rows), tmp_path / "out.jsonl"
    runtime_env = {"excludes": [".git", ".venv", "**/__pycache__", "*.egg-info", "build", "dist"],
                   "env_vars": {"NVRAY_CACHE_DIR": os.environ["NVRAY_CACHE_DIR"]}}
    submitted = head_cli(ray_head, "job", "submit", "--no-wait", "--working-dir", str(REPO),
                         "--runtime-env-json", json.dumps(runtime_env), "--", "python", "-m",
                         "nvray.batch", "--input", str(src), "--output", str(out),
                         "--max-tokens", "200", "--ignore-eos", "--max-model-len", "256",
                         "--batch-size", "4")
    job_id = re.search(r"(raysubmit_\w+)", submitted).group(1)  # type: ignore[union-attr]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while "RankWorker" not in live_engine_actors(ray_head):  # the engine is up and generating
        status = head_cli(ray_head, "job", "status", job_id)
        assert "RUNNING" in status or "PENDING" in status, \
            status + head_cli(ray_head, "job", "logs", job_id)[-3000:]
        assert time.monotonic() < deadline, "the job's engine never started"
        time.sleep(1)
    time.sleep(2)
    head_cli(ray_head, "job", "stop", job_id, timeout=120)
    assert "was stopped" in head_cli(ray_head, "job", "status", job_id)
    deadline = time.monotonic() + 60
    while live_engine_actors(ray_head):
        assert time.monotonic() < deadline, "the stopped job's engine outlived it"
        time.sleep(1)
    assert not out.exists() and not list(tmp_path.glob("out.jsonl*"))


def rank_actor_nodes(head: Cluster) -> dict[str, str]:
    """actor id -> node IP of every RankWorker the cluster has known, live or gone."""
    out = head.cli("list", "actors", "--filter", "class_name=RankWorker", "--format", "json",
                   "--limit", "1000", "--detail")
    ips = head.node_ips()
    actors = json.loads(out) if out.lstrip().startswith("[") else []
    return {a["actor_id"]: ips.get(a["node_id"], a["node_id"]) for a in actors}


def test_parquet_with_two_engines_gives_the_same_rows(ray_head, submitted, expected, tmp_path):
    """Two engines that cannot share a 2-CPU node (1.2 + 0.1 CPUs each): one per node."""
    src, out = tmp_path / "prompts.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS, schema=input_schema(pa.string())), src)
    before = rank_actor_nodes(ray_head)
    proc = run_batch(["--input", str(src), "--output", str(out), "--concurrency", "2",
                      "--num-cpus-per-rank", "1.2", *COMMON_ARGS], timeout=JOB_TIMEOUT_S,
                     RAY_ADDRESS=ray_head.gcs_address)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    ranks = {a: ip for a, ip in rank_actor_nodes(ray_head).items() if a not in before}
    assert sorted(ranks.values()) == ["127.0.0.1", SECOND_NODE_IP]  # an engine on each node
    rows = read_output(out)
    check_rows(rows, expected)
    assert rows == read_output(submitted)  # concurrency 2 == concurrency 1, row for row
    assert pq.read_schema(out).names == ["id", "text", "finish_reason", "prompt_tokens",
                                         "completion_tokens", "error"]


def test_engines_that_do_not_fit_the_cluster_fail_fast(ray_head, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", GOOD_ROWS[:1])
    proc = run_batch(["--input", str(src), "--output", str(tmp_path / "out.jsonl"),
                      "--concurrency", "5"], timeout=120, RAY_ADDRESS=ray_head.gcs_address)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("5 engine(s) with tensor_parallel_size=1 need {'CPU': 5.0} but the whole cluster "
            "has only {'CPU': 4.0}; lower --concurrency") in proc.stderr


_HOLD_CPUS = """
import sys
import ray
from ray.util.placement_group import placement_group
ray.init()
pg = placement_group([{"CPU": 1.6}, {"CPU": 1.6}], strategy="SPREAD")
ray.get(pg.ready(), timeout=60)
print("held", flush=True)
sys.stdin.read()  # held until the test closes stdin
"""


def test_engines_that_fit_the_cluster_but_not_what_is_free_fail_in_seconds(ray_head, tmp_path):
    """Other work (here a placement group, as a running app's) holds 3.2 of the 4 CPUs: the job
    says what it asks and what is free instead of waiting minutes for a placement."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_CPUS], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env=child_env(RAY_ADDRESS=ray_head.gcs_address))
    try:
        assert holder.stdout.readline().strip() == "held"
        src = write_jsonl(tmp_path / "in.jsonl", GOOD_ROWS[:1])
        start = time.monotonic()
        proc = run_batch(["--input", str(src), "--output", str(tmp_path / "out.jsonl")],
                         timeout=120, RAY_ADDRESS=ray_head.gcs_address)
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert ("1 engine(s) with tensor_parallel_size=1 need {'CPU': 1.0} but only "
                "{'CPU': 0.8} of the cluster's {'CPU': 4.0} are free now") in proc.stderr
        assert time.monotonic() - start < 60
        assert not (tmp_path / "out.jsonl").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


# ------------------------------------------------------------------- malformed input, fast
@pytest.mark.parametrize("lines, message", [
    ([{"id": 1, "prompt": "a"}, {"id": 2, "prompt": "b"}, '{"id": 3, "prompt": '],
     "line 3: invalid JSON"),
    ([{"id": "a", "prompt": "x"}, {"prompt": "no id"}], "line 2: row has no 'id'"),
    ([{"id": "a", "prompt": "x"}, "", {"id": "b"}], "line 3: row 'b' has neither 'prompt' nor"),
    ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}],
     "line 2: duplicate id 'a' (first at"),
    ([{"id": "a", "prompt": "x"}, {"id": 7, "prompt": "y"}], "line 2: id 7 is a int but"),
    ([{"id": "a", "prompt": 5}], "line 1: 'prompt' must be a string"),
    ([{"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}],
     "line 1: row 'a' has both"),
    ([{"id": "a", "messages": [{"role": "user"}]}], "line 1: messages[0] must be an object"),
    (["[1, 2]"], "line 1: expected a JSON object"),
    ([{"id": True, "prompt": "x"}], "line 1: 'id' must be a string or an integer"),
    ([{"id": "a", "prompt": "x", "response_format": {"type": "xml"}}],
     "line 1: response_format.type: Input should be"),
    ([{"id": "a", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"not": {"type": "string"}}}}}],
     "line 1: response_format.json_schema.schema: the JSON schema keyword 'not'"),
])
def test_malformed_jsonl_is_rejected_with_the_row_number(tmp_path, lines, message):
    from nvray.batch.io import validate_input

    path = write_jsonl(tmp_path / "in.jsonl", lines)
    with pytest.raises(ValueError) as err:
        validate_input(str(path))
    assert message in str(err.value) and str(path) in str(err.value)


def test_malformed_parquet_is_rejected_with_the_row_number(tmp_path):
    from nvray.batch.io import validate_input

    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", None, "c"], "prompt": ["x", "y", "z"]}), path)
    with pytest.raises(ValueError, match=r"in.parquet: row 2: row has no 'id'"):
        validate_input(str(path))
    pq.write_table(pa.table({"id": ["a"], "text": ["x"]}), path)
    with pytest.raises(ValueError, match="neither a 'prompt' nor a 'messages' column"):
        validate_input(str(path))
    path.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        validate_input(str(path))


def test_cli_fails_fast_on_malformed_input_before_starting_ray(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"prompt": "no id"}])
    start = time.monotonic()
    proc = run_batch(["--input", str(src), "--output", str(tmp_path / "out.jsonl")], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{src}: line 2: row has no 'id'" in proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr  # no cluster was joined or started
    assert not (tmp_path / "out.jsonl").exists()
    bad_json = write_jsonl(tmp_path / "bad.jsonl", [{"id": 1, "prompt": "x"}, "{oops"])
    proc = run_batch(["--input", str(bad_json), "--output", str(tmp_path / "o.parquet")],
                     timeout=120)
    assert proc.returncode == 2 and "bad.jsonl: line 2: invalid JSON" in proc.stderr
    proc = run_batch(["--input", str(bad_json), "--output", str(tmp_path / "o.jsonl"),
                      "--temperature", "-1"], timeout=120)
    assert proc.returncode == 2 and "temperature=-1.0 is invalid" in proc.stderr
    assert time.monotonic() - start < 100


def test_fp8_flags_reach_the_engine_options():
    from nvray.batch.__main__ import engine_kwargs_from_args, parse_args

    args = parse_args(["--input", "in.jsonl", "--output", "out.jsonl", "--quantization", "fp8",
                       "--kv-cache-dtype", "fp8"])
    kwargs = engine_kwargs_from_args(args)
    assert (kwargs["quantization"], kwargs["kv_cache_dtype"]) == ("fp8", "fp8")
    with pytest.raises(SystemExit):
        parse_args(["--input", "in.jsonl", "--output", "out.jsonl", "--kv-cache-dtype", "int8"])


def test_parallelism_flags_reach_the_engine_options():
    from nvray.batch.__main__ import engine_kwargs_from_args, parse_args

    base = ["--input", "in.jsonl", "--output", "out.jsonl"]
    kwargs = engine_kwargs_from_args(parse_args(base + [
        "--tensor-parallel-size", "2", "--enable-expert-parallel", "--all-reduce", "nccl",
        "--pipeline-parallel-size", "2"]))
    assert (kwargs["tensor_parallel_size"], kwargs["enable_expert_parallel"],
            kwargs["all_reduce"], kwargs["pipeline_parallel_size"]) == (2, True, "nccl", 2)
    defaults = engine_kwargs_from_args(parse_args(base))
    assert (defaults["enable_expert_parallel"], defaults["all_reduce"]) == (False, "auto")
    with pytest.raises(SystemExit):
        parse_args(base + ["--all-reduce", "mpi"])


def test_input_directory_and_output_path_checks(tmp_path):
    from nvray.batch.io import check_output_path, find_input_files, validate_input

    write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "prompt": "1"}])
    write_jsonl(tmp_path / "b.jsonl", [{"id": "y", "prompt": "2"}, {"id": "x", "prompt": "3"}])
    (tmp_path / "notes.txt").write_text("ignored")
    fmt, files = find_input_files(str(tmp_path))
    assert fmt == "jsonl" and [os.path.basename(f) for f in files] == ["a.jsonl", "b.jsonl"]
    with pytest.raises(ValueError,
                       match=r"b.jsonl: line 2: duplicate id 'x' \(first at .*a.jsonl: line 1\)"):
        validate_input(str(tmp_path))
    pq.write_table(pa.table({"id": ["z"], "prompt": ["p"]}), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match="mixes formats"):
        find_input_files(str(tmp_path))
    with pytest.raises(ValueError, match="unknown extension '.csv'"):
        check_output_path(str(tmp_path / "out.csv"), files)
    with pytest.raises(ValueError, match="does not exist"):
        check_output_path(str(tmp_path / "missing" / "out.jsonl"), files)
    with pytest.raises(ValueError, match="is also an input file"):
        check_output_path(files[0], files)


# -------------------------------------------------- the pool actor, with a fake engine (no Ray)
class FakeEngine:
    """An EngineClient stand-in: ``generate_many`` answers each prompt at once."""

    def __init__(self, dead: bool) -> None:
        self.dead, self.shut_down = dead, False

    def generate_many(self, prompts: list[Any], params: list[Any],
                      lora_request: list[Any] | None = None) -> list[Any]:
        from nvray.outputs import RequestOutput
        from nvray.runtime import EngineDeadError

        self.params, self.loras = params, lora_request

        def result(prompt: Any) -> Any:
            if self.dead:
                return EngineDeadError("rank 0 died")
            if prompt == "":
                return ValueError("prompt is empty")
            text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            return RequestOutput("r", [1, 2, 3], text=text.upper(), token_ids=[5, 6],
                                 finished=True, finish_reason="length")
        return [result(p) for p in prompts]

    def shutdown(self) -> None:
        self.shut_down = True


def fake_batch() -> pa.Table:
    rows = [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": ""},
            {"id": "c", "messages": [{"role": "user", "content": "yo"}]}]
    return pa.Table.from_pylist(rows, schema=input_schema(pa.string()))


@pytest.mark.parametrize("restarts", [1, 0])
def test_pool_actor_replaces_a_dead_engine_and_keeps_request_errors(restarts):
    from nvray.batch.udf import GenerateBatch

    engines: list[FakeEngine] = []

    def factory(config: Any) -> FakeEngine:
        engines.append(FakeEngine(dead=not engines))  # the first engine is dead
        return engines[-1]

    udf = GenerateBatch({"model": "tiny"}, {"max_tokens": 2}, max_engine_restarts=restarts,
                        engine_factory=factory)
    out = udf(fake_batch()).to_pylist()
    assert [r["id"] for r in out] == ["a", "b", "c"]
    if restarts:
        assert len(engines) == 2 and engines[0].shut_down
        assert [r["text"] for r in out] == ["HI", None, "YO"]
        assert out[0]["prompt_tokens"] == 3 and out[0]["completion_tokens"] == 2
        assert out[1]["error"] == "ValueError: prompt is empty"
    else:
        assert len(engines) == 1
        assert all(r["error"] == "EngineDeadError: rank 0 died" for r in out)


def test_two_batches_failing_together_on_a_dead_engine_share_one_replacement():
    """Ray Data may run two batches at once in a pool actor: both fail on the dead engine, the
    first to get there replaces it, and the second retries on that replacement (not a second
    restart, which ``max_engine_restarts=1`` would refuse, leaving its rows failed)."""
    import threading

    from nvray.batch.udf import GenerateBatch

    both_sent = threading.Barrier(2, timeout=30)

    class DeadTogether(FakeEngine):
        def generate_many(self, prompts, params, lora_request=None):  # noqa: ANN001, ANN201
            both_sent.wait()  # neither batch's failure is seen before both were sent
            return super().generate_many(prompts, params, lora_request)

    engines: list[FakeEngine] = []

    def factory(config: Any) -> FakeEngine:
        engines.append(DeadTogether(dead=True) if not engines else FakeEngine(dead=False))
        return engines[-1]

    udf = GenerateBatch({"model": "tiny"}, {"max_tokens": 2}, max_engine_restarts=1,
                        engine_factory=factory)
    outs: list[Any] = [None, None]

    def run(i: int) -> None:
        outs[i] = udf(fake_batch()).to_pylist()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(engines) == 2 and engines[0].shut_down and not engines[1].shut_down
    for out in outs:
        assert out is not None and [r["text"] for r in out] == ["HI", None, "YO"], out


def test_a_rows_response_format_replaces_the_jobs_structured_output():
    from nvray.batch.udf import GenerateBatch
    from nvray.sampling_params import SamplingParams

    engine = FakeEngine(dead=False)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    udf = GenerateBatch({"model": "tiny"}, {"max_tokens": 2, "structured_outputs": {"json": {}}},
                        engine_factory=lambda config: engine)
    rows = [{"id": "job", "prompt": "x"},
            {"id": "text", "prompt": "y", "response_format": '{"type": "text"}'},
            {"id": "own", "prompt": "z", "response_format": json.dumps(
                {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})},
            {"id": "bad", "prompt": "w", "response_format": '{"type": "json_schema"}'}]
    out = udf(pa.Table.from_pylist(rows, schema=input_schema(pa.string()))).to_pylist()
    params = [SamplingParams.coerce(p) for p in engine.params]  # the three rows sent
    assert [p.max_tokens for p in params] == [2, 2, 2]
    assert params[0].structured_outputs.json == {}
    assert params[1].structured_outputs is None
    assert params[2].structured_outputs.json == schema
    assert [r["error"] for r in out][:3] == [None, None, None]
    assert out[3]["error"] == ("ValueError: response_format: type 'json_schema' needs a "
                               "json_schema object")


# ---------------------------------------------------------------- reading and writing rows
def test_parquet_rows_are_normalized_to_the_input_schema():
    from nvray.batch.read import normalize_rows

    only_messages = pa.Table.from_pylist([
        {"id": 3, "messages": [{"role": "user", "content": "hi", "name": "x"}], "extra": 1},
        {"id": 4, "messages": None, "extra": 2}])
    out = normalize_rows(only_messages, pa.int64())
    assert out.schema == input_schema(pa.int64())
    assert out.to_pylist() == [
        {"id": 3, "prompt": None, "messages": [{"role": "user", "content": "hi"}],
         "response_format": None, "lora": None},
        {"id": 4, "prompt": None, "messages": None, "response_format": None, "lora": None}]
    only_prompts = pa.table({"id": pa.array([1], pa.int32()),
                             "prompt": pa.array(["p"], pa.large_string()),
                             "response_format": pa.array(['{"type": "text"}'], pa.large_string())})
    assert normalize_rows(only_prompts, pa.int64()).to_pylist() == [
        {"id": 1, "prompt": "p", "messages": None, "response_format": '{"type": "text"}',
         "lora": None}]
    as_struct = pa.Table.from_pylist([{"id": 1, "prompt": "p",
                                       "response_format": {"type": "json_object"}}])
    assert json.loads(normalize_rows(as_struct, pa.int64())["response_format"][0].as_py()) == {
        "type": "json_object"}


@pytest.mark.parametrize("name", ["out.jsonl", "out.parquet"])
def test_output_appears_only_when_the_job_succeeds(tmp_path, name):
    from nvray.batch.io import OutputWriter, output_schema

    path, fmt = tmp_path / name, name.split(".")[1]
    schema = output_schema(pa.string())
    row = {"id": "a", "text": "héllo", "finish_reason": "length", "prompt_tokens": 2,
           "completion_tokens": 1, "error": None}
    with pytest.raises(RuntimeError):
        with OutputWriter(str(path), fmt, schema) as out:
            out.write(pa.Table.from_pylist([row], schema=schema))
            raise RuntimeError("the job failed")
    assert list(tmp_path.iterdir()) == []
    with OutputWriter(str(path), fmt, schema) as out:
        out.write(pa.Table.from_pylist([row], schema=schema))
    assert read_output(path) == [row] and [p.name for p in tmp_path.iterdir()] == [name]


def test_a_job_with_a_json_schema_writes_rows_that_follow_it(ray_head, tmp_path):
    """``--json-schema FILE``: every output row's text validates against the schema, but a
    row's own ``response_format`` replaces it (another schema; ``text``: none)."""
    import jsonschema

    schema = {"type": "object", "required": ["n", "ok"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                             "ok": {"type": "boolean"}}}
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    own = {"type": "object", "required": ["pick"],
           "properties": {"pick": {"enum": ["red", "green"]}}}
    rows = [{"id": f"s{i}", "prompt": f"object number {i}"} for i in range(3)] + [
        {"id": "own", "prompt": "pick one", "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": own, "strict": True}}},
        {"id": "text", "prompt": "free text", "response_format": {"type": "text"}}]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    proc = submit_batch_job(ray_head, "--input", str(src), "--output", str(out),
                            "--json-schema", str(schema_file), "--temperature", "1", "--seed",
                            "3", "--max-tokens", "60", "--max-model-len", str(MAX_MODEL_LEN))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    written = {r["id"]: r for r in read_output(out)}
    assert list(written) == [r["id"] for r in rows]
    for rid, want in [("s0", schema), ("s1", schema), ("s2", schema), ("own", own)]:
        row = written[rid]
        assert row["error"] is None and row["finish_reason"] == "stop", row
        jsonschema.validate(json.loads(row["text"]), want)
    free = written["text"]  # the job's schema lifted: random weights write no JSON object
    assert free["error"] is None and free["completion_tokens"] > 0
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free["text"]), schema)


def test_a_json_schema_that_cannot_be_enforced_fails_before_ray(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": {"type": "string"}}))
    proc = run_batch(["--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                      "--json-schema", str(bad)], timeout=120)
    assert proc.returncode == 2 and "keyword 'not'" in proc.stderr, proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr


def test_a_gemma_job_with_hf_overrides_matches_hf(ray_head, tmp_path, family_path):
    """Another family through ``ray job submit``: Gemma 3 (windowed layers), its context
    stretched by ``--hf-overrides`` past the checkpoint's 1,024 positions (refused without),
    greedy texts equal to HF transformers' on the same weights."""
    from transformers import AutoTokenizer

    from oracle import hf_greedy

    path = family_path("gemma3")
    tok = AutoTokenizer.from_pretrained(path)
    rows = [{"id": "g0", "prompt": GOOD_ROWS[0]["prompt"]},
            {"id": "g1", "prompt": GOOD_ROWS[3]["prompt"]}]
    src, out = write_jsonl(tmp_path / "gemma.jsonl", rows), tmp_path / "gemma-out.jsonl"
    args = ["--input", str(src), "--output", str(out), "--model", path, "--max-tokens", "6",
            "--ignore-eos", "--temperature", "0", "--max-model-len", "1500"]
    refused = run_batch(args, timeout=120)
    assert refused.returncode != 0 and "max_model_len=1500 exceeds" in refused.stderr
    proc = submit_batch_job(ray_head, *args, "--hf-overrides",
                            '{"max_position_embeddings": 2048}')
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for row in read_output(out):
        prompt = next(r["prompt"] for r in rows if r["id"] == row["id"])
        ids = tok(prompt)["input_ids"]
        assert row["error"] is None, row
        assert row["text"] == tok.decode(hf_greedy(path, ids, 6), skip_special_tokens=True)


def test_an_embedding_job_writes_transformers_vectors(ray_head, tmp_path):
    """``--task embed`` through ``ray job submit``: each row's prompt becomes an ``embedding``
    column (``--dimensions`` values, normalised), equal to transformers' last-token state of
    the embedding checkpoint (``pooling_checkpoints.py``); a row too long is an error row."""
    import torch
    from transformers import AutoTokenizer

    from pooling_checkpoints import hf_last_state, write_embedder

    path = str(tmp_path / "embedder")
    model = write_embedder(path)
    tok = AutoTokenizer.from_pretrained(path)
    rows = [{"id": "e0", "prompt": GOOD_ROWS[0]["prompt"]},
            {"id": "e1", "prompt": GOOD_ROWS[3]["prompt"]}, BAD_ROWS[0]]
    src, out = write_jsonl(tmp_path / "embed.jsonl", rows), tmp_path / "embed-out.parquet"
    proc = submit_batch_job(ray_head, "--input", str(src), "--output", str(out), "--model", path,
                            "--task", "embed", "--dimensions", "16", "--dtype", "float32",
                            "--max-model-len", str(MAX_MODEL_LEN))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "3 rows, 1 errors" in proc.stdout and "rows/s" in proc.stdout
    written = read_output(out)
    assert [r["id"] for r in written] == [r["id"] for r in rows]
    for row, source in zip(written[:2], rows):
        ids = tok(source["prompt"])["input_ids"]
        assert row["error"] is None and row["prompt_tokens"] == len(ids)
        hf = hf_last_state(model, ids)[:16]
        torch.testing.assert_close(torch.tensor(row["embedding"]), hf / hf.norm(),
                                   atol=1e-4, rtol=1e-3)
    assert written[2]["embedding"] is None and "max_model_len" in written[2]["error"]


def test_a_lora_job_runs_each_row_through_its_adapter(ray_head, tmp_path, tiny_path):
    """``--lora-modules`` declares adapters (written by PEFT), ``--lora`` is the job's; a row's
    ``lora`` column picks another; each row's greedy text is PEFT's for its adapter."""
    from transformers import AutoTokenizer

    from lora_adapters import ATTENTION, MLP, peft_greedy, write_adapter

    paths = {"a": write_adapter(tiny_path, str(tmp_path / "a"), 8, ATTENTION + MLP, seed=41),
             "b": write_adapter(tiny_path, str(tmp_path / "b"), 4, MLP, seed=42, std=0.3)}
    rows = [{"id": "r0", "prompt": GOOD_ROWS[0]["prompt"]},
            {"id": "r1", "prompt": GOOD_ROWS[1]["prompt"], "lora": "b"},
            {"id": "r2", "prompt": GOOD_ROWS[3]["prompt"], "lora": "a"}]
    src, out = write_jsonl(tmp_path / "lora.jsonl", rows), tmp_path / "lora-out.jsonl"
    proc = submit_batch_job(ray_head, "--input", str(src), "--output", str(out),
                            "--lora-modules", f"a={paths['a']},b={paths['b']}", "--lora", "a",
                            "--max-tokens", "6", "--ignore-eos", "--temperature", "0",
                            "--max-model-len", str(MAX_MODEL_LEN))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(tiny_path)
    for row, adapter in zip(read_output(out), ["a", "b", "a"]):
        prompt = next(r["prompt"] for r in rows if r["id"] == row["id"])
        ids = tok(prompt)["input_ids"]
        assert row["error"] is None, row
        want = tok.decode(peft_greedy(tiny_path, paths[adapter], ids, 6), skip_special_tokens=True)
        assert row["text"] == want, row["id"]


def test_a_row_naming_an_undeclared_adapter_fails_before_ray(tmp_path, tiny_path):
    from lora_adapters import write_adapter

    path = write_adapter(tiny_path, str(tmp_path / "a"), 4, ["q_proj"], seed=43)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt": "hi", "lora": "zz"}])
    proc = run_batch(["--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                      "--lora-modules", f"a={path}"], timeout=120)
    assert proc.returncode == 2 and "'zz'" in proc.stderr and "line 1" in proc.stderr, proc.stderr
    proc = run_batch(["--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                      "--lora-modules", f"a={path}", "--lora", "b"], timeout=120)
    assert proc.returncode == 2 and "--lora 'b'" in proc.stderr, proc.stderr
