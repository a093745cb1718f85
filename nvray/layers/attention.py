"""Paged attention: metadata, backends and the layer that stores K/V then attends.

Every backend implements ``forward(q, k, v, k_cache, v_cache, meta, scale) -> out`` with
q ``[T, H, D]``, k/v ``[T, KVH, D]`` (this step's tokens), caches
``[num_blocks, block_size, KVH, D]``. It first writes k/v into the slots of
``meta.slot_mapping`` (slot -1: skip), then computes causal attention of each sequence's query
chunk over its whole context read from the cache — which serves prefill, prefill over a cached
prefix, chunked prefill and decode alike.

Backend choice lives in ``select_backend`` only: ``triton`` on CUDA when importable, else
``torch``; a forced backend that is not available is an ``ImportError`` saying why.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    query_start_loc: torch.Tensor  # [B+1] int32, cu_seqlens of the query chunks
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class TorchAttentionBackend:
    """Reference backend: per-sequence SDPA over the gathered context (CPU and tests)."""

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            blocks = meta.block_tables[i, :-(-ctx_len // block_size)].long()
            keys = k_cache[blocks].flatten(0, 1)[:ctx_len]  # [ctx, KVH, D]
            values = v_cache[blocks].flatten(0, 1)[:ctx_len]
            out[start:start + q_len] = self._attend(q[start:start + q_len], keys, values, scale)
            start += q_len
        return out

    @staticmethod
    def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid]
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid]

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        q_len, ctx_len = q.shape[0], k.shape[0]
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        # query i sits at position ctx_len - q_len + i and sees keys 0..that position
        pos_q = torch.arange(ctx_len - q_len, ctx_len, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= pos_q  # [q_len, ctx]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        return o.transpose(0, 1)


class TritonAttentionBackend:
    """Triton kernels from ``kernels/``: paged decode (split-K) and paged varlen prefill."""

    name = "triton"

    def __init__(self) -> None:
        import kernels  # noqa: PLC0415 - GPU-only import, done where it is used
        self.kernels = kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kn = self.kernels
        kn.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return kn.paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                             meta.seq_lens, scale)
        return kn.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables,
                                          meta.query_start_loc, meta.seq_lens,
                                          meta.max_query_len, scale)


def backend_available(name: str, device: torch.device) -> tuple[bool, str]:
    """(available, reason if not)."""
    if name == "torch":
        return True, ""
    if device.type != "cuda":
        return False, f"the {name} attention backend needs a CUDA device, the engine runs on {device}"
    if importlib.util.find_spec(name) is None:
        return False, f"the {name} attention backend needs {name}: pip install 'nvray[{name}]'"
    return True, ""


def select_backend(name: str, device: torch.device) -> TorchAttentionBackend | TritonAttentionBackend:
    """The one place that picks the attention backend (``auto`` or a forced name)."""
    if name == "auto":
        name = next(n for n in ("triton", "torch") if backend_available(n, device)[0])
    ok, reason = backend_available(name, device)
    if not ok:
        raise ImportError(reason)
    return TritonAttentionBackend() if name == "triton" else TorchAttentionBackend()


class Attention(nn.Module):
    """Stores this step's K/V into the layer's paged cache and attends over the context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)  # set by the model runner once the cache is allocated
        self.v_cache = torch.empty(0)
        self.backend: TorchAttentionBackend | TritonAttentionBackend = TorchAttentionBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
