"""Objects frozen out of the cyclic GC after start-up (``nvray/gc_freeze.py``) are released at
the process's exit, so a script that leaves its engine running ends quietly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_script_that_never_shuts_its_llm_down_ends_without_leak_reports():
    """Triton 3.9's bindings (nanobind) report at exit every object of theirs still alive;
    frozen reference cycles were never collected, so such a script ended with hundreds of
    "nanobind: leaked ..." lines."""
    pytest.importorskip("triton")
    code = ("import triton\n"  # as on a GPU host, where the engine's kernels import it
            "from nvray import LLM\n"
            "llm = LLM('tiny', runtime='inprocess', max_model_len=128)\n"
            "print('STARTED')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "STARTED" in proc.stdout, proc.stderr[-2000:]
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]
