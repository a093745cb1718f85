"""Kernel tests run under Triton's CPU interpreter unless a CUDA GPU is present (with the
interpreter patched for numpy >= 2.4).

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


def _patch_interpreter_for_numpy_2_4() -> None:
    """Make Triton's interpreter work with numpy >= 2.4 (interpreter mode only).

    Triton 3.6's interpreter converts scalar tensors (1-element arrays) to
    Python ints with ``int(array)``, which numpy >= 2.4 rejects; that breaks
    ``range(tensor_start, tensor_end, ...)`` loops. Upstream fixed it by
    squeezing the array first (triton-lang/triton#9171); this applies the same
    one-line change to the installed interpreter. No effect on compiled kernels.
    """
    import triton

    try:
        interpreting = bool(triton.knobs.runtime.interpret)
    except AttributeError:  # pragma: no cover - other triton layouts
        import os

        interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not interpreting:
        return
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover
        return
    original = getattr(_interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_nvray_numpy_fix", False):
        return

    def _patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patched._nvray_numpy_fix = True
    _interp._patch_lang_tensor = _patched


_patch_interpreter_for_numpy_2_4()
