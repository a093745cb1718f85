"""Where the kernel tests run: under Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``,
set by ``tests/kernels/conftest.py`` on a machine without CUDA), or compiled on a GPU."""

from __future__ import annotations

import pytest
import torch


def kernel_device() -> tuple[bool, torch.device]:
    """(interpreting, device) for the calling test module; skips the module when the kernels
    were imported compiled and there is no GPU to run them on."""
    from kernels import decode_attention  # noqa: PLC0415 - after the module's importorskip

    interpreting = decode_attention._INTERPRET  # noqa: SLF001 - how the kernels were built
    if not interpreting and not torch.cuda.is_available():
        pytest.skip("kernels were imported without TRITON_INTERPRET=1 and there is no CUDA device",
                    allow_module_level=True)
    return interpreting, torch.device("cpu" if interpreting else "cuda")
