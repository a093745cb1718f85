"""The kernels' pure-torch references, one per launcher of ``kernels/`` with the same signature
and the same argument checks (each calls its kernel module's validator): the oracle the kernel
tests (CPU interpreter and GPU tier) hold every launcher to. The engine never calls these:
its CPU paths are the layers' own torch code (``nvray/layers``), and ``kernels.moe_align_ref``,
the CPU path of ``moe_align``, stays with its kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.decode_attention import (_check_window,
                                      _validate_q_cache_tables as _decode_attention_validate)
from kernels.filter_threshold import _validate as _filter_threshold_validate
from kernels.fp8_gemm import (_check_block_args as _fp8_gemm_check_block_args,
                              _check_channel_args as _fp8_gemm_check_channel_args)
from kernels.fused_moe import _check_args as _fused_moe_check_args
from kernels.prefill_attention import _validate as _prefill_attention_validate
from kernels.qk_norm_rope import _validate as _qk_norm_rope_validate
from kernels.rms_norm import _validate as _rms_norm_validate
from kernels.sample_race import _validate as _sample_race_validate
from kernels.silu_mul import _validate as _silu_mul_validate
from kernels.store_kv import _validate as _store_kv_validate
from nvray.layers.gated_delta_rule import (commit_reference, decode_reference, rows_reference,
                                           short_conv_reference)
from nvray.quantization.fp8_math import (Fp8Activation, check_group, dequantize, linear_ref,
                                         quantize_activation, to_cache_dtype)


def _gather_seq_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table_row: torch.Tensor, n: int, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference helper: context positions ``start .. n - 1`` of one sequence, fp32
    ``[n - start, Hkv, D]``; the blocks wholly before ``start`` (and their table entries) are
    not read."""
    block_size = k_cache.shape[1]
    first = start // block_size
    nblk = (n + block_size - 1) // block_size
    blocks = block_table_row[first:nblk].long()
    skip, count = start - first * block_size, n - start
    k = k_cache[blocks].reshape(-1, k_cache.shape[2], k_cache.shape[3])[skip:skip + count].float()
    v = v_cache[blocks].reshape(-1, v_cache.shape[2], v_cache.shape[3])[skip:skip + count].float()
    return k, v


def _window_start(n: int, q_len: int, window: int) -> int:
    """Reference helper: the first position any of the ``q_len`` queries at positions
    ``n - q_len .. n - 1`` sees (0 without a window)."""
    return max(0, n - q_len - window + 1) if window else 0


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,  # ignored
    max_seq_len: int | None = None,  # ignored
    order: torch.Tensor | None = None,  # ignored (it changes no result)
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Pure-torch reference of :func:`paged_decode_attention` (fp32 math, one loop per sequence;
    with a window it gathers the window's positions only)."""
    batch = q.shape[0] if q.dim() == 3 else -1
    num_heads, num_kv_heads, head_dim, _ = _decode_attention_validate(
        q, k_cache, v_cache, block_tables, seq_lens, batch
    )
    window = _check_window(sliding_window)
    group = num_heads // num_kv_heads
    out = torch.zeros((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        if n <= 0:
            continue
        # positions n - W .. n - 1 (all of them without a window)
        k, v = _gather_seq_kv(k_cache, v_cache, block_tables[b], n, _window_start(n, 1, window))
        k = k.repeat_interleave(group, dim=1)  # [n, H, D]: q head h -> kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # [H, n]
        p = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out


def filter_thresholds_ref(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                          min_p: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference of :func:`filter_thresholds`: sort each row, filter it as the
    sampler's sort path does, and return the smallest logit it keeps."""
    _filter_threshold_validate(logits, top_k, top_p, min_p)
    rows, vocab = logits.shape
    ordered = logits.sort(dim=-1, descending=True).values
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    probs = ordered.masked_fill(rank >= k, float("-inf")).softmax(dim=-1)
    top_p = top_p.unsqueeze(1)  # 1 is off: a float32 cumsum may pass 1 before the last token
    keep = (rank < k) & ((probs.cumsum(dim=-1) - probs < top_p) | (top_p >= 1.0))
    keep &= probs >= min_p.unsqueeze(1) * probs[:, :1]
    keep[:, 0] = True
    return ordered.masked_fill(~keep, float("inf")).min(dim=-1).values


def quantize_fp8_act_ref(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_activation(x, group)


def block_fp8_mm_ref(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    _fp8_gemm_check_block_args(a, a_scale, w, w_scale, block)
    a_deq = a.float() * a_scale.repeat_interleave(block[1], dim=1)
    return (a_deq @ dequantize(w, w_scale, block).t()).to(out_dtype)


def channel_fp8_mm_ref(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                       w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    _fp8_gemm_check_channel_args(a, a_scale, w, w_scale)
    return ((a.float() * a_scale) @ dequantize(w, w_scale.view(-1, 1), None).t()).to(out_dtype)


def fp8_linear_ref(x: torch.Tensor | Fp8Activation, w: torch.Tensor, w_scale: torch.Tensor,
                   block: tuple[int, int] | None, bias: torch.Tensor | None) -> torch.Tensor:
    return linear_ref(x, w, w_scale, block, bias)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None,
                  block_shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Pure-torch reference of :func:`fused_moe` (same contract and roundings): a loop over the
    experts that have tokens, each one's weighted output index-added into a float32 sum. Syncs
    with the device (it reads the per-expert counts)."""
    fp8 = _fused_moe_check_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape)
    (t, h), (e, inter), top_k = x.shape, (w13.shape[0], w13.shape[1] // 2), topk_ids.shape[1]
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    if t * top_k == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1).to(torch.int64)
    weights = topk_weights.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        if fp8:
            w_gate_up = dequantize(w13[expert], w13_scale[expert], tuple(block_shape))
            w_down = dequantize(w2[expert], w2_scale[expert], tuple(block_shape))
        else:
            w_gate_up, w_down = w13[expert].float(), w2[expert].float()
        gate_up = x[tokens].float() @ w_gate_up.t()
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype).float()
        out.index_add_(0, tokens, (act @ w_down.t()) * weights[pairs, None])
    return out.to(x.dtype)


def gdn_commit_ref(held_mixed: torch.Tensor, held_conv: torch.Tensor, held_g: torch.Tensor,
                   held_beta: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                   slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                   held_rows: int, num_k_heads: int, head_k_dim: int, head_v_dim: int) -> None:
    commit_reference(held_mixed, held_conv, held_g, held_beta, conv_state, ssm_state, slots,
                     starts, counts, held_rows, num_k_heads, head_k_dim, head_v_dim)


def gdn_decode_ref(mixed: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, ssm_state: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor, num_k_heads: int,
                   head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    return decode_reference(mixed, conv_state, conv_weight, g, beta, ssm_state, slots,
                            positions, num_k_heads, head_k_dim, head_v_dim)


def gdn_rows_ref(conv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 ssm_state: torch.Tensor, read_rows: torch.Tensor, write_rows: torch.Tensor,
                 resumes: torch.Tensor, query_start_loc: torch.Tensor, num_k_heads: int,
                 head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    return rows_reference(conv, g, beta, ssm_state, read_rows, write_rows, resumes,
                          query_start_loc, num_k_heads, head_k_dim, head_v_dim)


def gdn_short_conv_ref(mixed: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       read_rows: torch.Tensor, write_rows: torch.Tensor, resumes: torch.Tensor,
                       query_start_loc: torch.Tensor, real_lens: torch.Tensor,
                       held_at: torch.Tensor | None, held_mixed: torch.Tensor,
                       held_conv: torch.Tensor) -> torch.Tensor:
    return short_conv_reference(mixed, conv_state, weight, read_rows, write_rows, resumes,
                                query_start_loc, real_lens, held_at, held_mixed, held_conv)


def mask_logits_ref(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor,
                    sources: torch.Tensor) -> None:
    vocab_size = logits.shape[1]
    tokens = torch.arange(vocab_size, device=masks.device)
    for row, source in zip(rows.tolist(), sources.tolist()):
        allowed = (masks[source, tokens // 32].long() >> (tokens % 32)) & 1
        logits[row, allowed == 0] = float("-inf")


def _tiles(rows: torch.Tensor, tiles: torch.Tensor):
    for slot, start, n in zip(*tiles.tolist()):
        if slot >= 0:
            yield slot, rows[start:start + n].long()


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, h: torch.Tensor, rows: torch.Tensor,
                    tiles: torch.Tensor, tile_rows: int = 16) -> None:
    h[1:] = 0
    for slot, idx in _tiles(rows, tiles):
        h[0, idx] = x[idx].float() @ a[slot].float().T


def lora_expand_ref(h: torch.Tensor, b: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                    tiles: torch.Tensor, slices: list[tuple[int, int, int]],
                    tile_rows: int = 16, chunks: int | None = None) -> None:
    r = b.shape[2]
    for slot, idx in _tiles(rows, tiles):
        for h_col, y_col, width in slices:
            part = h[:, idx, h_col:h_col + r].sum(0) @ b[slot, y_col:y_col + width].float().T
            y[idx, y_col:y_col + width] = (y[idx, y_col:y_col + width].float()
                                           + part).to(y.dtype)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Pure-torch reference of :func:`paged_prefill_attention` (fp32 math, one loop per sequence;
    with a window it gathers positions from the first query's window start on only)."""
    batch, num_heads, num_kv_heads, head_dim, _ = _prefill_attention_validate(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q
    )
    window = _check_window(sliding_window)
    group = num_heads // num_kv_heads
    out = torch.zeros((q.shape[0], num_heads, head_dim), dtype=q.dtype, device=q.device)
    for b in range(batch):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        qlen, n = q1 - q0, int(seq_lens[b])
        if qlen == 0:
            continue
        lo = _window_start(n, qlen, window)  # no query sees a position below it
        k, v = _gather_seq_kv(k_cache, v_cache, block_tables[b], n, lo)  # [n - lo, Hkv, D]
        k = k.repeat_interleave(group, dim=1)  # [n - lo, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,nhd->htn", q[q0:q1].float(), k) * scale  # [H, qlen, n - lo]
        q_pos = torch.arange(n - qlen, n, device=q.device)  # [qlen]
        k_pos = torch.arange(lo, n, device=q.device)  # [n - lo]
        visible = k_pos[None, :] <= q_pos[:, None]  # [qlen, n - lo]
        if window:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("htn,nhd->thd", p, v).to(q.dtype)
    return out


def qk_norm_rope_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                     num_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                     k_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`qk_norm_rope` (same contract)."""
    head_dim = _qk_norm_rope_validate(qkv, positions, cos_sin, num_heads, num_kv_heads, q_weight, k_weight)
    dtype = qkv.dtype
    q = qkv[:, :num_heads * head_dim].reshape(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].reshape(
        -1, num_kv_heads, head_dim)

    def norm(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:  # float32 out
        xf = x.float()
        if w is None:
            return xf
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()

    cos, sin = cos_sin[positions.long()].unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)

    return rotate(norm(q, q_weight)), rotate(norm(k, k_weight))


def sum_rms_norm_ref(parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, group: int | None | bool = False
                     ) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
    """Pure-torch reference of :func:`sum_rms_norm`, given the partial sums themselves."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    x = total.to(residual.dtype)
    if group is False:
        return rms_norm_ref(x, weight, eps, residual)  # type: ignore[return-value]
    return rms_norm_fp8_ref(x, weight, eps, residual, group)  # type: ignore[arg-type,return-value]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`rms_norm` (same contract)."""
    _rms_norm_validate(x, weight, residual)
    v = x if residual is None else x + residual
    vf = v.float()
    out = (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return out if residual is None else (out, v)


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None, group: int | None = None
                     ) -> Fp8Activation | tuple[Fp8Activation, torch.Tensor]:
    """Pure-torch reference of :func:`rms_norm_fp8` (same contract)."""
    check_group(x.shape[1], group)
    normed = rms_norm_ref(x, weight, eps, residual)
    out = normed if residual is None else normed[0]
    act = Fp8Activation(*quantize_activation(out, group), x.dtype)
    return act if residual is None else (act, normed[1])


def race_sample_ref(logits: torch.Tensor, temperatures: float | torch.Tensor, seed: int,
                    thresholds: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch reference of :func:`race_sample` (same contract; torch's Gumbel noise)."""
    _sample_race_validate(logits, temperatures, thresholds)
    rows, vocab = logits.shape
    t = (temperatures if isinstance(temperatures, torch.Tensor)
         else torch.full((rows,), float(temperatures), device=logits.device)).unsqueeze(1)
    x = torch.where(t == 0.0, logits.float(), logits.float() / t.clamp_min(1e-30))
    if thresholds is not None:
        x = x.masked_fill(x < thresholds.unsqueeze(1), float("-inf"))
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    u = torch.rand(rows, vocab, generator=gen, device=logits.device)
    drawn = (x - (-u.log()).log()).argmax(dim=-1)
    return torch.where(t.squeeze(1) == 0.0, x.argmax(dim=-1), drawn).to(torch.int32)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference of :func:`silu_and_mul` (same contract)."""
    _silu_mul_validate(x)
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul_fp8_ref(x: torch.Tensor, group: int | None = None) -> Fp8Activation:
    """Pure-torch reference of :func:`silu_and_mul_fp8` (same contract)."""
    check_group(x.shape[1] // 2, group)
    return Fp8Activation(*quantize_activation(silu_and_mul_ref(x), group), x.dtype)


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Pure-torch reference of :func:`store_kvcache` (same contract, in place)."""
    _store_kv_validate(key, value, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    for t in range(key.shape[0]):
        s = int(slot_mapping[t])
        if s < 0:
            continue
        k_cache[s // block_size, s % block_size] = to_cache_dtype(key[t], k_cache.dtype)
        v_cache[s // block_size, s % block_size] = to_cache_dtype(value[t], v_cache.dtype)
