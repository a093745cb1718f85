"""Paged attention: metadata, backends and the layer that stores K/V then attends.

Every backend implements ``forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window=None)
-> out`` with
q ``[T, H, D]``, k/v ``[T, KVH, D]`` (this step's tokens), caches
``[num_blocks, block_size, KVH, D]`` in the compute dtype or ``float8_e4m3fn`` (an FP8 cache:
values stored with scale 1, saturated at ±448, read back into the compute dtype; flash_attn
takes the compute dtype only). It first writes k/v into the slots of
``meta.slot_mapping`` (slot -1: skip) — unless k and v are None: the caller stored them
already (the model's fused prologue does, on the GPU) — then computes causal attention of each
sequence's query chunk over its whole context read from the cache, which serves prefill,
prefill over a cached prefix, chunked prefill and decode alike. ``sliding_window=W`` (an
``Attention`` layer's ``sliding_window``; None or 0: full causal attention) makes it local
attention as Gemma 3's local layers use it (HF transformers' sliding window): the query at
position ``p`` sees positions ``p - W < k <= p`` only. Then the cache blocks (and block-table
entries) whose positions all lie before the window of a sequence's first query of the step
(all ``< first query position - W + 1``) are never read: the engine may free them, leaving
stale or invalid ids (-1, another sequence's block) in the table.

Backend choice lives in ``select_backend`` only. ``auto``: ``flash_attn`` when it is importable,
the engine runs on CUDA, the KV block size is a multiple of 256 (flash-attn's paged-KV
requirement) and the cache is not FP8; else ``triton`` on CUDA; else ``torch``. A forced backend that cannot run is an
error saying why (``ImportError`` for a missing package, ``ValueError`` for a bad setting).
``supports_cuda_graphs`` says whether a backend's decode path can be captured in a CUDA graph
(no host syncs, no host-side per-sequence loops). ``decode_scratch_bytes(batch, layer,
kv_itemsize, max_seq_len, device)`` is what one layer's decode allocates besides its output at
that batch (0 where not known: flash-attn's own splits); the CUDA-graph memory estimate captures
the graph where it is largest.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nvray.quantization.fp8_math import to_cache_dtype


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int32 (or int64), cache slot of each new token; -1: skip
    query_start_loc: torch.Tensor  # [B+1] int32, cu_seqlens of the query chunks
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32 (only the first ceil(seq_len/block_size) read)
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    # with several block-table groups (kv_layout.py): each group's metadata (its slots and
    # tables; the rest shared), which a layer of that group reads (Attention.meta_of)
    groups: list["AttentionMetadata"] | None = None
    # models with recurrent layers (layers/gated_deltanet.py): [B] int32, each sequence's
    # state slot (-1: the scratch row)
    state_slots: torch.Tensor | None = None
    # speculative decoding on such models: [T] int32, each token's row in the recurrent
    # layers' held buffers (-1: its chunk is not held); None: no chunk is held
    state_held_at: torch.Tensor | None = None
    # a CUDA graph's layout: each sequence's query rows padded after its tokens (real_tokens()
    # marks the tokens), no host lists (cuda_graph.py)
    padded_rows: bool = False

    _cu_seqlens_k: torch.Tensor | None = None
    _decode_order: torch.Tensor | None = None
    _real_tokens: torch.Tensor | None = None
    _per_step: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # a group's: the step's metadata, whose per-step values it takes
    _parent: "AttentionMetadata | None" = field(default=None, repr=False, compare=False)

    def with_groups(self, slot_mappings: list[torch.Tensor],
                    block_tables: list[torch.Tensor]) -> "AttentionMetadata":
        """This metadata with one per group (the first group's slots and tables as its own;
        the per-step values computed once, here, for every group)."""
        self.groups = [dataclasses.replace(self, slot_mapping=s, block_tables=t, _parent=self)
                       for s, t in zip(slot_mappings, block_tables)]
        self.slot_mapping, self.block_tables = slot_mappings[0], block_tables[0]
        return self

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def once_per_step(self, key: str, make: Callable[[], Any]) -> Any:
        """What ``make()`` returns, made by the first layer that asks in this step and shared
        with the others (e.g. a recurrent layer's chunk layout)."""
        if self._parent is not None:
            return self._parent.once_per_step(key, make)
        if key not in self._per_step:
            self._per_step[key] = make()
        return self._per_step[key]

    def real_tokens(self) -> torch.Tensor:
        """[T] bool: the rows that are tokens, not a CUDA graph's padding (which writes no KV
        slot); computed once per step."""
        if self._parent is not None:
            return self._parent.real_tokens()
        if self._real_tokens is None:
            self._real_tokens = self.slot_mapping >= 0
        return self._real_tokens

    def cu_seqlens_k(self) -> torch.Tensor:
        """[B+1] int32 cumulative context lengths (computed once per step, on the device)."""
        if self._parent is not None:
            return self._parent.cu_seqlens_k()
        if self._cu_seqlens_k is None:
            cu = torch.zeros(self.seq_lens.shape[0] + 1, dtype=torch.int32, device=self.seq_lens.device)
            torch.cumsum(self.seq_lens, 0, out=cu[1:])
            self._cu_seqlens_k = cu
        return self._cu_seqlens_k

    def decode_order(self) -> torch.Tensor:
        """[B] int32, the sequences longest context first (computed once per step, on the
        device): the decode kernel starts its programs in this order, so a ragged batch's
        long sequences do not run alone at the end of the grid (H100, 256 sequences of
        100-1,100 tokens: an e4m3 cache read at 2.39 TB/s against 1.91 in row order)."""
        if self._parent is not None:
            return self._parent.decode_order()
        if self._decode_order is None:
            order = torch.argsort(self.seq_lens, descending=True)
            self._decode_order = order.to(torch.int32)
        return self._decode_order


def _no_decode_scratch(batch: int, layer: "Attention", kv_itemsize: int, max_seq_len: int,
                       device: torch.device) -> int:
    """``decode_scratch_bytes`` of a backend that counts none."""
    return 0


class TorchAttentionBackend:
    """Reference backend: per-sequence SDPA over the gathered context (CPU and tests)."""

    name = "torch"

    supports_cuda_graphs = False
    decode_scratch_bytes = staticmethod(_no_decode_scratch)  # never captured

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        if k is not None:
            self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            # with a window, gather from the block holding the first query's window start on:
            # the blocks before it may be freed (their table entries stale)
            lo = max(0, ctx_len - q_len - sliding_window + 1) if sliding_window else 0
            first = lo // block_size
            blocks = meta.block_tables[i, first:-(-ctx_len // block_size)].long()
            kv_len = ctx_len - first * block_size  # positions first * block_size .. ctx_len - 1
            keys = k_cache[blocks].flatten(0, 1)[:kv_len].to(q.dtype)  # [kv_len, KVH, D]
            values = v_cache[blocks].flatten(0, 1)[:kv_len].to(q.dtype)
            out[start:start + q_len] = self._attend(q[start:start + q_len], keys, values, scale,
                                                    sliding_window=sliding_window)
            start += q_len
        return out

    @staticmethod
    def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = to_cache_dtype(k[valid], k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slots] = to_cache_dtype(v[valid], v_cache.dtype)

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                sliding_window: int | None = None) -> torch.Tensor:
        """k/v: the last ``k.shape[0]`` positions of the context (all of them, or from a window's
        start on), the queries its last ``q.shape[0]``."""
        q_len, ctx_len = q.shape[0], k.shape[0]
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        # query i sits at (relative) position ctx_len - q_len + i and sees keys 0..that position,
        # the last sliding_window of them with a window
        pos_q = torch.arange(ctx_len - q_len, ctx_len, device=q.device).unsqueeze(1)
        pos_k = torch.arange(ctx_len, device=q.device).unsqueeze(0)
        mask = pos_k <= pos_q  # [q_len, ctx]
        if sliding_window:
            mask &= pos_k > pos_q - sliding_window
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        return o.transpose(0, 1)


class TritonAttentionBackend:
    """Triton kernels from ``kernels/``: paged decode (split-K) and paged varlen prefill."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        import kernels  # noqa: PLC0415 - GPU-only import, done where it is used
        self.kernels = kernels

    def decode_scratch_bytes(self, batch: int, layer: "Attention", kv_itemsize: int,
                             max_seq_len: int, device: torch.device) -> int:
        """The split-K partial outputs (``kernels.decode_scratch_bytes``)."""
        return self.kernels.decode_scratch_bytes(batch, layer.num_heads, layer.num_kv_heads,
                                                 layer.head_dim, kv_itemsize, max_seq_len, device,
                                                 sliding_window=layer.sliding_window)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        kn = self.kernels
        if k is not None:
            kn.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            # max_seq_len bounds the context host-side (sizes the split-K grid, no sync); in a
            # CUDA graph it is max_model_len, so one graph serves every context length
            return kn.paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                             meta.seq_lens, scale, max_seq_len=meta.max_seq_len,
                                             order=meta.decode_order(),
                                             sliding_window=sliding_window)
        return kn.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables,
                                          meta.query_start_loc, meta.seq_lens,
                                          meta.max_query_len, scale, sliding_window=sliding_window)


class FlashAttentionBackend:
    """flash-attn 2's paged-KV kernels (needs a KV block size that is a multiple of 256).

    K/V are written by the Triton store kernel; prefill is ``flash_attn_varlen_func`` over the
    paged cache (``block_table``), decode ``flash_attn_with_kvcache`` — the calls nano-vllm makes.
    Not exercised by the test suite: flash-attn is not installed on the machines we test on.
    """

    name = "flash_attn"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        import flash_attn  # noqa: PLC0415
        import kernels  # noqa: PLC0415

        self.varlen = flash_attn.flash_attn_varlen_func
        self.with_kvcache = flash_attn.flash_attn_with_kvcache
        self.store = kernels.store_kvcache

    decode_scratch_bytes = staticmethod(_no_decode_scratch)  # its own splits: not known here

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        if k is not None:
            self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        # flash-attn's window_size=(left, right): query i sees keys i - left .. i + right, so
        # the last W positions are (W - 1, 0); (-1, -1) is no window. Its kernels start their
        # walk at the window (they read no KV tile wholly before it).
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        if meta.is_decode_only:
            out = self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                    block_table=meta.block_tables, softmax_scale=scale, causal=True,
                                    window_size=window)
            return out.squeeze(1)  # [B, 1, H, D] -> [B, H, D]
        return self.varlen(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc,
                           cu_seqlens_k=meta.cu_seqlens_k(), max_seqlen_q=meta.max_query_len,
                           max_seqlen_k=meta.max_seq_len, softmax_scale=scale, causal=True,
                           window_size=window, block_table=meta.block_tables)


Backend = TorchAttentionBackend | TritonAttentionBackend | FlashAttentionBackend
_BACKENDS = {"flash_attn": FlashAttentionBackend, "triton": TritonAttentionBackend,
             "torch": TorchAttentionBackend}
_FLASH_BLOCK_MULTIPLE = 256


def backend_available(name: str, device: torch.device, block_size: int) -> tuple[bool, str]:
    """(available, reason if not)."""
    if name == "torch":
        return True, ""
    if device.type != "cuda":
        return False, f"the {name} attention backend needs a CUDA device, the engine runs on {device}"
    extra = name.replace("_", "-")
    for module in ((name, "triton") if name == "flash_attn" else (name,)):
        if importlib.util.find_spec(module) is None:
            return False, f"the {name} attention backend needs {module}: pip install 'nvray[{extra}]'"
    if name == "flash_attn" and block_size % _FLASH_BLOCK_MULTIPLE:
        return False, (f"the flash_attn attention backend needs kvcache_block_size to be a multiple "
                       f"of {_FLASH_BLOCK_MULTIPLE} (flash-attn's paged KV cache), got {block_size}")
    return True, ""


def select_backend(name: str, device: torch.device, block_size: int = 16,
                   fp8_kv_cache: bool = False) -> Backend:
    """The one place that picks the attention backend (``auto`` or a forced name); an FP8 KV
    cache rules out flash_attn, which reads caches in the compute dtype only."""
    usable = [n for n in _BACKENDS if not (fp8_kv_cache and n == "flash_attn")]
    if name == "auto":
        name = next(n for n in usable if backend_available(n, device, block_size)[0])
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend={name!r} is invalid: must be one of "
                         f"{['auto', *_BACKENDS]}")
    if name not in usable:
        raise ValueError("kv_cache_dtype='fp8' needs the triton or torch attention backend "
                         "(flash_attn reads caches in the compute dtype only)")
    ok, reason = backend_available(name, device, block_size)
    if not ok:
        raise (ValueError if "kvcache_block_size" in reason else ImportError)(reason)
    return _BACKENDS[name]()


class Attention(nn.Module):
    """Stores this step's K/V into the layer's paged cache and attends over the context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        """``sliding_window``: W for a local-attention layer (each query sees its last W
        positions, itself included; Gemma 3's local layers), None or 0 for full causal."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window or None
        self.k_cache = torch.empty(0)  # set by the model runner once the cache is allocated
        self.v_cache = torch.empty(0)
        self.kv_group = 0  # its block-table group (kv_layout.py), set with the cache
        self.backend: Backend = TorchAttentionBackend()

    def meta_of(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata for this layer's block-table group."""
        return meta if meta.groups is None else meta.groups[self.kv_group]

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        """k and v None: this step's K/V are in the cache already."""
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, self.meta_of(meta),
                                    self.scale, self.sliding_window)
