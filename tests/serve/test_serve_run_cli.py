"""`serve run deployments:app` exactly as the README gives it: a fresh Ray, the tiny model,
the OpenAI API on 127.0.0.1:8000, answered by the real openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import pytest
import requests

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
URL = "http://127.0.0.1:8000"


def _port_in_use() -> bool:
    try:
        requests.get(URL, timeout=1)
        return True
    except requests.ConnectionError:
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if _port_in_use():
        pytest.fail("127.0.0.1:8000 is taken; `serve run` needs it")
    log = open(tmp_path_factory.mktemp("serve-run") / "serve.log", "w+")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    proc = subprocess.Popen([serve_bin, "run", "deployments:app"], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
        yield URL
    except BaseException:
        log.seek(0)
        print(log.read()[-4000:])
        raise
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def test_serve_run_answers_the_openai_client(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    resp = client.completions.create(model="tiny", prompt="Hello", max_tokens=8,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 8 and resp.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny", max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.role == "assistant"
