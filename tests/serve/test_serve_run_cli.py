"""`serve run deployments:app` exactly as the README gives it: a fresh Ray, the tiny model,
the OpenAI API on 127.0.0.1:8000, answered by the real openai client. It starts where a head
was killed (`ray start --head`, then SIGKILL): the machine's record of that cluster is left
behind, and `serve run` must start a local cluster with a warning instead of retrying the dead
head forever."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest
import requests

from nvray.bench.startup import ctrl_c_enabled

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
URL = "http://127.0.0.1:8000"


def _port_in_use() -> bool:
    try:
        requests.get(URL, timeout=1)
        return True
    except requests.ConnectionError:
        return False


RECORD = "/tmp/ray/ray_current_cluster"  # where `ray start` records the machine's cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_a_head_leaving_its_record(env: dict[str, str]) -> str:
    """``ray start --head`` on a free port, then SIGKILL every process of that head; returns the
    address its record still names."""
    port = _free_port()
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                    "--num-cpus=0", "--include-dashboard=false", "--disable-usage-stats"],
                   env=env, check=True, capture_output=True, timeout=120)
    address = f"127.0.0.1:{port}"
    with open(RECORD) as f:
        assert f.read().strip() == address
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if address in cmdline or f"gcs_server_port={port}" in cmdline:
            os.kill(int(pid), signal.SIGKILL)
    return address


ALARMING_ON_STOP = ("Traceback", "graceful_shutdown failed", "Stack (most recent call first)",
                    "ERROR", "Error")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if _port_in_use():
        pytest.fail("127.0.0.1:8000 is taken; `serve run` needs it")
    log = open(tmp_path_factory.mktemp("serve-run") / "serve.log", "w+")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    saved = open(RECORD).read() if os.path.exists(RECORD) else None
    try:
        dead = _kill_a_head_leaving_its_record(env)
        yield from _serve_run(log, env, dead)
    finally:
        if saved is None:
            os.remove(RECORD)
        else:
            with open(RECORD, "w") as f:
                f.write(saved)


def _serve_run(log, env: dict[str, str], dead: str):  # noqa: ANN001, ANN202 - the fixture's body
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    # as a user runs it: Ray's token authentication left at its default (on for the new cluster)
    user_env = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    # Ctrl-C must reach it as from a terminal, also where this test runs with SIGINT ignored
    proc = subprocess.Popen(ctrl_c_enabled([serve_bin, "run", "deployments:app"]), cwd=REPO,
                            env=user_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "serve run exited early"
            try:
                if requests.get(f"{URL}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:  # proxy not up yet, or replica still starting
                pass
            time.sleep(1)
        else:
            raise TimeoutError("serve run did not become healthy within 240 s")
        started = _log_once_it_has(log, "nvray engine ready")  # Ray relays it a moment later
        assert "Token authentication is enabled" not in started  # Ray's notice of its default
        assert f"a Ray cluster was recorded at {dead} but its head does not answer" in started
        assert "blocking ray.get inside async actor" not in started  # the driver's threads
        ready = [line for line in started.splitlines() if "nvray engine ready" in line]
        assert len(ready) == 1, started[-3000:]  # model, device, KV cache, graphs, start-up
        assert re.search(r"model 'tiny' from /\S+ on cpu .*KV cache [\d,]+ blocks x 16 tokens .*no "
                         r"CUDA graphs.*started in [\d.]+ s; Ray cluster at [\d.]+:\d+ ",
                         ready[0]), ready[0]
        path = re.search(r"from (/\S+) on", ready[0]).group(1)
        assert os.path.exists(os.path.join(path, "config.json"))  # the checkpoint it serves
        yield URL
    except BaseException:
        log.seek(0)
        print(log.read()[-4000:])
        raise
    finally:
        log.seek(0, os.SEEK_END)
        before_stop = log.tell()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        try:
            proc.wait(timeout=60)
            stopped = True
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            stopped = False
        log.seek(before_stop)
        stopping = log.read()
        log.close()
    # the teardown fails the module if Ctrl-C did not stop it, or printed stack dumps or a
    # failed shutdown
    assert stopped, "serve run was still running 60 s after Ctrl-C:\n" + stopping[-3000:]
    assert "Got KeyboardInterrupt, shutting down" in stopping, stopping[-3000:]  # its Ctrl-C path
    alarming = [line for line in stopping.splitlines()
                if any(word in line for word in ALARMING_ON_STOP)]
    assert not alarming, "\n".join(alarming[:20])
    # Ray's five lines per compiled-graph teardown ("Tearing down compiled DAG" ...)
    assert "compiled DAG" not in stopping and "Teardown complete" not in stopping, stopping[-3000:]


def _log_once_it_has(log, text: str, timeout_s: float = 30.0) -> str:  # noqa: ANN001 - a file
    """The whole log, once ``text`` is in it (or the time-out has passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        log.seek(0)
        content = log.read()
        if text in content or time.monotonic() > deadline:
            return content
        time.sleep(0.2)


def test_serve_run_answers_the_openai_client(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    resp = client.completions.create(model="tiny", prompt="Hello", max_tokens=8,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 8 and resp.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny", max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.role == "assistant"


def test_a_mistyped_second_serve_run_fails_at_once_and_leaves_the_app_up(served, tmp_path):
    """A second `serve run` naming a missing checkpoint fails in its own process, before
    deploying anything: the running app still answers (it replaced app `default` before, and
    /health then answered nothing)."""
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    missing = str(tmp_path / "no-such-model")
    done = subprocess.run([serve_bin, "run", "deployments:build_app", f"model={missing}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert done.returncode != 0
    assert f"model='{missing}' is not a local checkpoint directory" in done.stdout + done.stderr
    assert requests.get(f"{served}/health", timeout=10).status_code == 200
