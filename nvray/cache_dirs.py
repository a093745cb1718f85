"""``NVRAY_CACHE_DIR``: the one directory where nvray keeps what it builds and may reuse.

Under it: the tiny model's checkpoint (``nvray.models.tiny``), Triton's compiled kernels
(``triton/``) and Inductor's (``inductor/``). Without ``NVRAY_CACHE_DIR`` the tiny model goes to
``~/.cache/nvray`` and the compilers keep their own defaults (``~/.triton/cache``, a temp dir);
with it, every cache of a node lives in one place, which can be a volume that outlives a
container, so a replica restarted on a new container starts with its kernels compiled. A
compiler directory set on its own (``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``) wins.

``pycache/`` holds Python bytecode, for an environment that neither ships nor writes it: a
package manager that installs without compiling (uv's default) under ``PYTHONDONTWRITEBYTECODE=1``,
as container images often set. There every process compiles what it imports from source; a rank
spent 2-3 s of its start compiling torch on an H100 host. ``keep_bytecode(package)``, called by a
process nvray owns (a rank, before torch) before it imports ``package``, points that process's
bytecode at ``pycache/`` (``sys.pycache_prefix``, which mirrors the sources' absolute paths) when
the interpreter writes none, ``package`` came without any and the directory is writable; the next
such process on the node reads it. From then on every import of that process uses ``pycache/``
(a module installed with its bytecode is compiled there once). ``children_keep_bytecode(package)``
does the same through the environment for the processes started meanwhile: ``LLM()`` starting a
local Ray cluster gives it to Ray's daemons and, through them, to every worker. Anywhere else
they change nothing; ``NVRAY_BYTECODE_CACHE=0`` turns both off. Without ``NVRAY_CACHE_DIR`` it
lives in ``~/.cache/nvray/pycache``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import Iterator

COMPILER_CACHE_VARS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def cache_dir() -> str:
    return os.environ.get("NVRAY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                             "nvray")


def point_compiler_caches() -> None:
    """Send this process's Triton and Inductor caches under ``NVRAY_CACHE_DIR`` (when it is set
    and the compiler's own variable is not); call before the first compile."""
    root = os.environ.get("NVRAY_CACHE_DIR")
    if root:
        for var, sub in COMPILER_CACHE_VARS.items():
            if not os.environ.get(var):
                os.environ[var] = os.path.join(root, sub)


def switched_off(value: str | None) -> bool:
    """Whether an environment switch's value turns it off (0, false, off, no)."""
    return (value or "").strip().lower() in ("0", "false", "off", "no")


def _bytecode_dir(package: str, optimize: int) -> str | None:
    """``<cache_dir()>/pycache``, made, where bytecode may be kept for ``package``: it is not
    turned off, the package is Python source installed without its bytecode (for
    optimization level ``optimize``), and the directory is writable. Else None."""
    if switched_off(os.environ.get("NVRAY_BYTECODE_CACHE")):
        return None
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    source = spec.origin if spec is not None else None
    if not source or not source.endswith(".py"):
        return None  # not found, or not Python source
    folder, name = os.path.split(source)
    level = f".opt-{optimize}" if optimize else ""
    beside = os.path.join(folder, "__pycache__",
                          f"{name[:-3]}.{sys.implementation.cache_tag}{level}.pyc")
    if os.path.exists(beside):
        return None  # installed with its bytecode
    prefix = os.path.join(os.path.abspath(os.path.expanduser(cache_dir())), "pycache")
    try:
        os.makedirs(prefix, exist_ok=True)
    except OSError:
        return None
    # unwritable: every start would compile into nowhere, shipped bytecode too
    return prefix if os.access(prefix, os.W_OK) else None


def keep_bytecode(package: str) -> str | None:
    """Before importing ``package``: where this interpreter writes no bytecode and ``package``
    has none beside its source, keep this process's bytecode under ``<cache_dir()>/pycache``
    from now on. Returns that directory when it did so, else None."""
    if not sys.dont_write_bytecode or sys.pycache_prefix or package in sys.modules:
        return None
    prefix = _bytecode_dir(package, sys.flags.optimize)
    if prefix is not None:
        sys.pycache_prefix = prefix
        sys.dont_write_bytecode = False
    return prefix


@contextlib.contextmanager
def children_keep_bytecode(package: str) -> Iterator[str | None]:
    """While this process starts processes that inherit its environment (a local Ray cluster's
    daemons, whose workers inherit theirs): where that environment writes no bytecode
    (``PYTHONDONTWRITEBYTECODE``) and ``package`` has none beside its source, they keep theirs
    under ``<cache_dir()>/pycache`` (``PYTHONPYCACHEPREFIX`` set and ``PYTHONDONTWRITEBYTECODE``
    unset in the environment meanwhile; restored after). Yields that directory, or None where
    it changed nothing. The environment is the whole process's: a process another thread starts
    meanwhile gets it too. Those processes keep the bytecode of all they import, user code
    included, under the directory (which mirrors the sources' absolute paths)."""
    env = os.environ
    prefix = None
    if env.get("PYTHONDONTWRITEBYTECODE") and not env.get("PYTHONPYCACHEPREFIX"):
        prefix = _bytecode_dir(package, _optimize_level(env.get("PYTHONOPTIMIZE", "")))
    if prefix is None:
        yield None
        return
    off, before = env.pop("PYTHONDONTWRITEBYTECODE"), env.get("PYTHONPYCACHEPREFIX")
    env["PYTHONPYCACHEPREFIX"] = prefix
    try:
        yield prefix
    finally:
        env.setdefault("PYTHONDONTWRITEBYTECODE", off)
        if env.get("PYTHONPYCACHEPREFIX") == prefix:  # as set here: put back what was there
            if before is None:
                del env["PYTHONPYCACHEPREFIX"]
            else:
                env["PYTHONPYCACHEPREFIX"] = before


def _optimize_level(value: str) -> int:
    """The optimization level ``PYTHONOPTIMIZE=value`` gives an interpreter."""
    value = value.strip()
    return int(value) if value.isdigit() else (1 if value else 0)
