"""Compiling a start's Triton kernels ahead, side by side (``nvray/worker/compile_ahead.py``).

Each start runs in a child process with its own empty cache directory, as on a fresh machine.
The child counts the kernels Triton compiles (``jit_post_compile_hook``), telling apart those
compiled while the ahead-of-time pool was active from those compiled at a launch, and the
kernel launchers Triton builds with the C compiler, in the pool or not, and generates
greedily and at temperature 0.8 (the engine's seed: the same tokens unless a start's random
draws differ)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              # its starts size their KV cache from the device's memory, which tests beside it
              # would be taking and giving back during the memory profile
              pytest.mark.gpu_alone]

_CHILD = r"""
import json, sys
from triton import knobs
from triton.runtime import _async_compile
compiled = {"ahead": 0, "at_launch": 0}
def count(**kwargs):
    compiled["ahead" if _async_compile.active_mode.get() is not None else "at_launch"] += 1
knobs.runtime.jit_post_compile_hook = count
import threading
from triton.runtime import build
launchers = {"ahead": 0, "at_launch": 0}
real_build = build._build
def counting_build(name, *args, **kwargs):
    if name == "__triton_launcher":
        pooled = threading.current_thread().name.startswith("nvray-compile")
        launchers["ahead" if pooled else "at_launch"] += 1
    return real_build(name, *args, **kwargs)
build._build = counting_build
from nvray import LLM, SamplingParams
llm = LLM(sys.argv[1], runtime="inprocess", max_model_len=1024, max_num_seqs=16)
at_start = {**compiled, "launchers": dict(launchers)}
prompts = ["The capital of France is", "1 2 3 4"]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
drawn = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=12), use_tqdm=False)
print("RESULT " + json.dumps({"start": at_start, "ids": [o.token_ids for o in outs],
                              "sampled": [o.token_ids for o in drawn],
                              "phases": llm.engine.stats()["startup"]["phases_s"]}))
"""


def _start(model: str, cache_dir: str, ahead: str) -> dict:
    env = {**os.environ, "NVRAY_CACHE_DIR": cache_dir, "NVRAY_COMPILE_AHEAD": ahead}
    env.pop("TRITON_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", _CHILD, model], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_a_fresh_start_compiles_its_kernels_ahead_and_generates_the_same_tokens(
        qwen3_06b_path, tmp_path):
    ahead = _start(qwen3_06b_path, str(tmp_path / "ahead"), "")
    plain = _start(qwen3_06b_path, str(tmp_path / "plain"), "0")
    # every kernel the start launched was compiled ahead, none at its launch
    assert ahead["start"]["ahead"] > 10 and ahead["start"]["at_launch"] == 0, ahead["start"]
    assert plain["start"]["ahead"] == 0 and plain["start"]["at_launch"] >= ahead["start"]["ahead"]
    # and every launcher (a C extension) was built in the pool, none at a launch
    assert ahead["start"]["launchers"]["ahead"] > 0, ahead["start"]
    assert ahead["start"]["launchers"]["at_launch"] == 0, ahead["start"]
    assert plain["start"]["launchers"]["at_launch"] > 0, plain["start"]
    assert "compile_ahead" in ahead["phases"] and "compile_ahead" not in plain["phases"]
    assert ahead["ids"] == plain["ids"]
    assert ahead["sampled"] == plain["sampled"]  # the rehearsal's random draws were undone


def test_a_warm_start_compiles_nothing_and_generates_the_same_tokens(qwen3_06b_path, tmp_path):
    cache = tmp_path / "cache"
    first = _start(qwen3_06b_path, str(cache), "")
    entries = sorted(os.listdir(cache / "triton"))
    second = _start(qwen3_06b_path, str(cache), "")
    assert sorted(os.listdir(cache / "triton")) == entries  # every kernel came from the cache
    assert second["ids"] == first["ids"] and second["sampled"] == first["sampled"]
