"""``NVRAY_CACHE_DIR``: the one directory where nvray keeps what it builds and may reuse.

Under it: the tiny model's checkpoint (``nvray.models.tiny``), Triton's compiled kernels
(``triton/``) and Inductor's (``inductor/``). Without ``NVRAY_CACHE_DIR`` the tiny model goes to
``~/.cache/nvray`` and the compilers keep their own defaults (``~/.triton/cache``, a temp dir);
with it, every cache of a node lives in one place, which can be a volume that outlives a
container, so a replica restarted on a new container starts with its kernels compiled. A
compiler directory set on its own (``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``) wins.
"""

from __future__ import annotations

import os

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
