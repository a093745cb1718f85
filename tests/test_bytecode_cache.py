"""Bytecode under NVRAY_CACHE_DIR where the interpreter keeps none.

A process that writes no bytecode (``PYTHONDONTWRITEBYTECODE=1``) and calls ``keep_bytecode``
before importing a package installed without any keeps its bytecode under
``<NVRAY_CACHE_DIR>/pycache``, and the next such process reads it from there. Where the
interpreter writes bytecode, or the package came with it, or ``NVRAY_BYTECODE_CACHE=0``, nothing
changes. A rank asks for it before it imports torch. Each case runs a real interpreter.
"""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = str(Path(__file__).parents[1])
_OWN_VARS = ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "NVRAY_BYTECODE_CACHE",
             "NVRAY_CACHE_DIR", "PYTHONPATH")

_IMPORT_PROBE = """
import json
from nvray.cache_dirs import keep_bytecode
kept = keep_bytecode("probe_pkg")
import probe_pkg
print(json.dumps({"kept": kept, "value": probe_pkg.VALUE, "cached": probe_pkg.part.__cached__}))
"""

_IMPORTED_FIRST = """
import json
import probe_pkg
from nvray.cache_dirs import keep_bytecode
print(json.dumps({"kept": keep_bytecode("probe_pkg"), "value": probe_pkg.VALUE}))
"""

_RANK_PROBE = """
import json, sys
import nvray.runtime.rank_worker as rank_worker
from nvray.config import EngineConfig
calls = []
rank_worker.keep_bytecode = lambda package: calls.append((package, "torch" in sys.modules))
rank_worker.RankWorker(EngineConfig(device="cpu"), 0)
print(json.dumps({"calls": calls, "torch_after": "torch" in sys.modules}))
"""


def _installed_package(tmp_path: Path, *, with_bytecode: bool) -> Path:
    site = tmp_path / "site"
    package = site / "probe_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from probe_pkg import part\nVALUE = part.VALUE\n")
    (package / "part.py").write_text("VALUE = 42\n")
    if with_bytecode:
        assert compileall.compile_dir(str(package), quiet=1)
    return site


def _python(code: str, site: Path | None, cache: Path, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in _OWN_VARS}
    path = os.pathsep.join([str(site), REPO] if site else [REPO])
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=120, check=True,
                         capture_output=True, text=True,
                         env={**base, "PYTHONPATH": path, "NVRAY_CACHE_DIR": str(cache), **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.pyc")) if root.exists() else []


def test_without_bytecode_it_is_kept_under_the_cache_dir_and_read_back(tmp_path):
    site, cache = _installed_package(tmp_path, with_bytecode=False), tmp_path / "cache"
    first = _python(_IMPORT_PROBE, site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert first["kept"] == str(cache / "pycache") and first["value"] == 42
    cached = Path(first["cached"])
    assert cached.is_relative_to(cache / "pycache") and cached.exists()
    assert _files(site) == []  # nothing written beside the sources
    written = cached.stat().st_mtime_ns

    second = _python(_IMPORT_PROBE, site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert second == first
    assert cached.stat().st_mtime_ns == written  # read, not compiled again


def test_an_interpreter_that_writes_bytecode_is_left_alone(tmp_path):
    site, cache = _installed_package(tmp_path, with_bytecode=False), tmp_path / "cache"
    result = _python(_IMPORT_PROBE, site, cache)
    assert result["kept"] is None
    assert Path(result["cached"]).parent == site / "probe_pkg" / "__pycache__"
    assert _files(cache) == []


def test_a_package_installed_with_its_bytecode_is_left_alone(tmp_path):
    site, cache = _installed_package(tmp_path, with_bytecode=True), tmp_path / "cache"
    shipped = _files(site)
    result = _python(_IMPORT_PROBE, site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert result["kept"] is None and Path(result["cached"]) in shipped
    assert _files(cache) == []


def test_nvray_bytecode_cache_0_turns_it_off(tmp_path):
    site, cache = _installed_package(tmp_path, with_bytecode=False), tmp_path / "cache"
    result = _python(_IMPORT_PROBE, site, cache, PYTHONDONTWRITEBYTECODE="1",
                     NVRAY_BYTECODE_CACHE="0")
    assert result["kept"] is None and result["value"] == 42
    assert _files(cache) == [] and _files(site) == []


def test_an_unwritable_cache_dir_changes_nothing(tmp_path):
    site = _installed_package(tmp_path, with_bytecode=False)
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    result = _python(_IMPORT_PROBE, site, not_a_dir, PYTHONDONTWRITEBYTECODE="1")
    assert result["kept"] is None and result["value"] == 42
    assert _files(site) == []


def test_a_package_already_imported_is_left_alone(tmp_path):
    site, cache = _installed_package(tmp_path, with_bytecode=False), tmp_path / "cache"
    result = _python(_IMPORTED_FIRST, site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert result == {"kept": None, "value": 42}
    assert _files(cache) == []


def test_a_rank_keeps_bytecode_for_torch_before_importing_it(tmp_path):
    result = _python(_RANK_PROBE, None, tmp_path / "cache")
    assert result == {"calls": [["torch", False]], "torch_after": True}


_CHILDREN_PROBE = """
import json, os, subprocess, sys
from nvray.cache_dirs import children_keep_bytecode
child = "import json, probe_pkg; print(json.dumps(probe_pkg.part.__cached__))"
with children_keep_bytecode("probe_pkg") as kept:
    cached = json.loads(subprocess.run([sys.executable, "-c", child], check=True,
                                       capture_output=True, text=True).stdout)
print(json.dumps({"kept": kept, "cached": cached,
                  "after": [os.environ.get("PYTHONDONTWRITEBYTECODE"),
                            os.environ.get("PYTHONPYCACHEPREFIX")]}))
"""


def test_processes_started_meanwhile_keep_bytecode_and_the_environment_is_restored(tmp_path):
    site, cache = _installed_package(tmp_path, with_bytecode=False), tmp_path / "cache"
    result = _python(_CHILDREN_PROBE, site, cache, PYTHONDONTWRITEBYTECODE="1")
    assert result["kept"] == str(cache / "pycache")
    cached = Path(result["cached"])
    assert cached.is_relative_to(cache / "pycache") and cached.exists()  # the child wrote it
    assert result["after"] == ["1", None] and _files(site) == []


def test_processes_started_meanwhile_are_left_alone_where_bytecode_is_kept_or_shipped(tmp_path):
    cache = tmp_path / "cache"
    for case, shipped, env in (("writes", False, {}),
                               ("off", False, {"PYTHONDONTWRITEBYTECODE": "1",
                                               "NVRAY_BYTECODE_CACHE": "0"}),
                               ("shipped", True, {"PYTHONDONTWRITEBYTECODE": "1"})):
        site = _installed_package(tmp_path / case, with_bytecode=shipped)  # a fresh one each
        result = _python(_CHILDREN_PROBE, site, cache, **env)
        assert result["kept"] is None, case
        assert not Path(result["cached"]).is_relative_to(cache), case
    assert _files(cache) == []


_LOCAL_CLUSTER_PROBE = """
import json, os, sys
import ray
from nvray import cache_dirs
from nvray.runtime import cluster
kept = os.path.join(os.environ["NVRAY_CACHE_DIR"], "pycache")
os.environ.pop("RAY_ADDRESS", None)
cache_dirs._bytecode_dir = lambda package, optimize: kept  # as if Ray had come without bytecode
cluster.recorded_cluster_address = lambda: None  # no other cluster on this machine
cluster.ensure_ray()  # as LLM() connects, with no cluster to join: it starts a local one
try:
    seen = ray.get(ray.remote(lambda: [os.environ.get("PYTHONPYCACHEPREFIX"), sys.pycache_prefix,
                                       sys.dont_write_bytecode]).remote(), timeout=120)
finally:
    ray.shutdown()
print(json.dumps({"worker": seen, "driver": os.environ.get("PYTHONPYCACHEPREFIX")}))
"""


def test_a_local_cluster_started_by_nvray_keeps_its_workers_bytecode(tmp_path):
    cache = tmp_path / "cache"
    result = _python(_LOCAL_CLUSTER_PROBE, None, cache, PYTHONDONTWRITEBYTECODE="1")
    kept = str(cache / "pycache")
    assert result == {"worker": [kept, kept, False], "driver": None}


def test_the_environment_is_restored_when_the_start_fails(monkeypatch, tmp_path):
    from nvray import cache_dirs

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setattr(cache_dirs, "_bytecode_dir", lambda package, optimize: str(tmp_path))
    with pytest.raises(RuntimeError, match="ray.init failed"):
        with cache_dirs.children_keep_bytecode("ray") as kept:
            assert os.environ.get("PYTHONPYCACHEPREFIX") == kept == str(tmp_path)
            assert "PYTHONDONTWRITEBYTECODE" not in os.environ
            raise RuntimeError("ray.init failed")
    assert os.environ.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert "PYTHONPYCACHEPREFIX" not in os.environ


def test_an_optimized_interpreter_looks_for_its_own_level_of_bytecode(tmp_path):
    site, cache = _installed_package(tmp_path, with_bytecode=True), tmp_path / "cache"  # level 0
    result = _python(_IMPORT_PROBE, site, cache, PYTHONDONTWRITEBYTECODE="1", PYTHONOPTIMIZE="1")
    assert result["kept"] == str(cache / "pycache") and ".opt-1" in result["cached"]
