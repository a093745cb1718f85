"""Triton kernels of nvray: paged KV-cache store, paged decode and prefill attention, the
attention prologue (per-head q/k RMSNorm + rotary, optionally fused with the KV store), the
hidden-state RMSNorm (with the residual add, and the TP all-reduce's sum), the MLP's gated activation (both optionally
quantizing their output for the FP8 layer they feed), the sampler's
greedy-or-tempered draw and its sort-free top-k/top-p/min-p thresholds, grammar token
masks applied to chosen logits rows, the decode step of Gated DeltaNet linear attention, and
FP8 linear layers (activation quantization, the per-channel and block-scaled GEMMs).

Each launcher validates its arguments (``ValueError`` naming the argument); its pure-torch
reference, with the same signature, is in ``tests/kernel_refs.py`` (the kernel tests' oracle;
``moe_align_ref`` stays here: it is ``moe_align``'s CPU path). See each module's docstring for
the exact contract. To run the kernels on CPU tensors (tests), set ``TRITON_INTERPRET=1`` before
this package is first imported (``tests/kernels/conftest.py`` does).
"""

from __future__ import annotations

from .decode_attention import decode_scratch_bytes, paged_decode_attention
from .filter_threshold import filter_thresholds
from .fp8_gemm import block_fp8_mm, channel_fp8_mm, fp8_linear, quantize_fp8_act
from .fused_moe import fused_moe, moe_align, moe_align_ref
from .gdn_commit import gdn_commit
from .gdn_decode import gdn_decode
from .gdn_rows import gdn_rows
from .gdn_short_conv import gdn_short_conv
from .grammar_mask import mask_logits
from .prefill_attention import paged_prefill_attention
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_store
from .rms_norm import rms_norm, rms_norm_fp8, sum_rms_norm
from .sample_race import race_sample
from .silu_mul import silu_and_mul, silu_and_mul_fp8
from .store_kv import store_kvcache

__all__ = [
    "block_fp8_mm", "channel_fp8_mm", "fp8_linear", "quantize_fp8_act", "store_kvcache",
    "decode_scratch_bytes", "paged_decode_attention", "paged_prefill_attention", "qk_norm_rope",
    "qk_norm_rope_store", "rms_norm", "rms_norm_fp8", "sum_rms_norm", "filter_thresholds",
    "gdn_commit", "gdn_decode", "gdn_rows", "gdn_short_conv", "mask_logits", "race_sample",
    "silu_and_mul", "silu_and_mul_fp8", "fused_moe", "moe_align", "moe_align_ref",
]
