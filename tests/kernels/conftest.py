"""Kernel tests run under Triton's CPU interpreter unless a CUDA GPU is present.

``TRITON_INTERPRET`` must be set before ``triton`` decorates the kernels (i.e.
before ``kernels`` is first imported), so it is set here, at conftest import.
On a machine with CUDA the same tests run compiled on the GPU instead, unless
``TRITON_INTERPRET=1`` was already set by the caller.
"""

from __future__ import annotations

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
