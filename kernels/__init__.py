"""Triton kernels of nvray: paged KV-cache store, paged decode and prefill attention, the
attention prologue (per-head q/k RMSNorm + rotary, optionally fused with the KV store), the
hidden-state RMSNorm (with the residual add, and the TP all-reduce's sum), the MLP's gated activation (both optionally
quantizing their output for the FP8 layer they feed), the sampler's
greedy-or-tempered draw and its sort-free top-k/top-p/min-p thresholds, grammar token
masks applied to chosen logits rows, the decode step of Gated DeltaNet linear attention, and
FP8 linear layers (activation quantization, the per-channel and block-scaled GEMMs).

Each launcher validates its arguments (``ValueError`` naming the argument) and
has a pure-torch reference ``*_ref`` with the same signature. See each module's
docstring for the exact contract. To run the kernels on CPU tensors (tests),
set ``TRITON_INTERPRET=1`` before this package is first imported.
"""

from __future__ import annotations


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

from .fp8_gemm import (block_fp8_mm, block_fp8_mm_ref, channel_fp8_mm,  # noqa: E402
                       channel_fp8_mm_ref, fp8_linear, fp8_linear_ref, quantize_fp8_act,
                       quantize_fp8_act_ref)
from .filter_threshold import filter_thresholds, filter_thresholds_ref  # noqa: E402
from .fused_moe import fused_moe, fused_moe_ref, moe_align, moe_align_ref  # noqa: E402
from .gdn_commit import gdn_commit, gdn_commit_ref  # noqa: E402
from .gdn_decode import gdn_decode, gdn_decode_ref  # noqa: E402
from .gdn_rows import gdn_rows, gdn_rows_ref  # noqa: E402
from .gdn_short_conv import gdn_short_conv, gdn_short_conv_ref  # noqa: E402
from .grammar_mask import mask_logits, mask_logits_ref  # noqa: E402
from .decode_attention import (decode_scratch_bytes, paged_decode_attention,  # noqa: E402
                               paged_decode_attention_ref)
from .prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_ref, qk_norm_rope_store  # noqa: E402
from .rms_norm import (rms_norm, rms_norm_fp8, rms_norm_fp8_ref, rms_norm_ref,  # noqa: E402
                       sum_rms_norm, sum_rms_norm_ref)
from .sample_race import race_sample, race_sample_ref  # noqa: E402
from .silu_mul import (silu_and_mul, silu_and_mul_fp8, silu_and_mul_fp8_ref,  # noqa: E402
                       silu_and_mul_ref)
from .store_kv import store_kvcache, store_kvcache_ref  # noqa: E402

__all__ = [
    "block_fp8_mm",
    "block_fp8_mm_ref",
    "channel_fp8_mm",
    "channel_fp8_mm_ref",
    "fp8_linear",
    "fp8_linear_ref",
    "quantize_fp8_act",
    "quantize_fp8_act_ref",
    "store_kvcache",
    "store_kvcache_ref",
    "decode_scratch_bytes",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "qk_norm_rope",
    "qk_norm_rope_ref",
    "qk_norm_rope_store",
    "rms_norm",
    "rms_norm_ref",
    "rms_norm_fp8",
    "rms_norm_fp8_ref",
    "sum_rms_norm",
    "sum_rms_norm_ref",
    "filter_thresholds",
    "filter_thresholds_ref",
    "gdn_commit",
    "gdn_commit_ref",
    "gdn_decode",
    "gdn_decode_ref",
    "gdn_rows",
    "gdn_rows_ref",
    "gdn_short_conv",
    "gdn_short_conv_ref",
    "mask_logits",
    "mask_logits_ref",
    "race_sample",
    "race_sample_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "silu_and_mul_fp8",
    "silu_and_mul_fp8_ref",
]
