"""A test session's cache directory (``tests/conftest.py``: checkpoints, compiled kernels) is
removed when the session ends, instead of piling up in the temp directory run after run."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a pytest session in this process (collecting only): where was its cache, is it still there?
_SESSION = """
import os, pytest
pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", "tests/test_session_cache.py"])
cache = os.environ["NVRAY_CACHE_DIR"]
print("CACHE", cache, os.path.exists(cache))
"""


def test_a_session_leaves_no_cache_directory_behind(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NVRAY_CACHE_DIR"}
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", _SESSION], cwd=REPO, env=env, timeout=300,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    cache, exists = out.stdout.strip().splitlines()[-1].split()[1:]
    assert os.path.dirname(cache) == str(tmp_path)  # the session made it there
    assert exists == "False"
    assert not [p for p in os.listdir(tmp_path) if p.startswith("nvray-test-cache-")]
