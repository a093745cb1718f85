"""The ``nvray`` command, run as a user runs it (the console script pip installs):
``nvray --help`` lists its subcommands; ``nvray serve --help`` every app argument with its
default; a bad argument exits 2 naming it; ``nvray serve MODEL --option value`` deploys the app
of ``serve run deployments:build_app`` and it answers over HTTP."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import ray
import requests
from ray import serve

from deployments.args import AppArgs
from nvray.bench.http_load import wait_healthy

NVRAY = os.path.join(os.path.dirname(sys.executable), "nvray")


def nvray(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([NVRAY, *args], capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})


def test_nvray_help_lists_its_subcommands():
    done = nvray("--help")
    assert done.returncode == 0, done.stderr
    for command in ("serve", "generate", "batch", "bench"):
        assert re.search(rf"^\s+{command}\s", done.stdout, re.M), (command, done.stdout)
    as_module = subprocess.run([sys.executable, "-m", "nvray", "--help"], capture_output=True,
                               text=True, timeout=60)
    assert as_module.returncode == 0 and as_module.stdout == done.stdout


def test_serve_help_gives_every_app_argument_with_its_default():
    done = nvray("serve", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # help lines wrap anywhere
    for name in AppArgs.model_fields:
        if name != "model":
            assert f"--{name.replace('_', '-')}" in text, name
    assert "sequences per engine batch (default: 256)" in text
    assert "--enforce-eager, --no-enforce-eager" in text
    assert "'tiny' for the embedded random-weight Qwen3 (default: tiny)" in text


@pytest.mark.parametrize("args, named", [
    (["tiny", "--max-num-seqs", "0"], "max_num_seqs"),
    (["tiny", "--engine-options", "{not json"], "engine_options"),
    (["/no/such/checkpoint"], "/no/such/checkpoint"),
    (["tiny", "--api-key", ""], "--api-key: give a value"),
])
def test_a_bad_argument_exits_2_naming_it(args, named):
    done = nvray("serve", *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_nvray_serve_deploys_the_app_that_serve_run_does(serve_http):
    address = ray.get_runtime_context().gcs_address
    done = nvray("serve", "tiny", "--address", address, "--name", "cli", "--route-prefix",
                 "/cli", "--non-blocking", "--served-model-name", "cli-tiny",
                 "--max-model-len", "256", "--num-cpus-per-rank", "1", "--no-enable-prefix-caching",
                 timeout=300)
    try:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        url = f"{serve_http}/cli"
        wait_healthy(url)
        assert [m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]] \
            == ["cli-tiny"]
        r = requests.post(f"{url}/v1/completions", timeout=120, json={
            "model": "cli-tiny", "prompt": "Hello", "max_tokens": 300, "ignore_eos": True})
        assert r.status_code == 400 and "256" in r.text, r.text  # its max_model_len, not 512's
        r = requests.post(f"{url}/v1/completions", timeout=120, json={
            "model": "cli-tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    finally:
        serve.delete("cli")
