"""NVRAY_CACHE_DIR gathers a node's caches: an engine started with it keeps Triton's and
Inductor's compiled kernels under it, unless the compiler's own variable says otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_PROBE = """
import json, os, triton
from nvray import LLM
llm = LLM("tiny", runtime="inprocess", max_model_len=256)
print(json.dumps({"triton": triton.knobs.cache.dir,
                  "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""


def _engine_caches(env: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**base, **env}, timeout=300,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_engine_keeps_compiled_kernels_under_nvray_cache_dir(tmp_path):
    root = str(tmp_path)
    assert _engine_caches({"NVRAY_CACHE_DIR": root}) == {
        "triton": os.path.join(root, "triton"), "inductor": os.path.join(root, "inductor")}


def test_a_compilers_own_cache_variable_wins(tmp_path):
    own = str(tmp_path / "own-triton")
    caches = _engine_caches({"NVRAY_CACHE_DIR": str(tmp_path), "TRITON_CACHE_DIR": own})
    assert caches == {"triton": own, "inductor": os.path.join(str(tmp_path), "inductor")}
