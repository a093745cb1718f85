"""A decode step of Gated DeltaNet linear attention (``nvray/layers/gated_deltanet.py``): one
token per sequence, each sequence's conv inputs and recurrent state read and written in place
in its state slot.

Contract
--------
``gdn_decode(mixed, conv_state, conv_weight, g, beta, ssm_state, slots, positions,
num_k_heads, head_k_dim, head_v_dim) -> out``

* ``mixed``: ``[B, conv_dim]`` the token's q, k, v projection (``[q | k | v]``, q and k
  ``num_k_heads * head_k_dim`` wide), last dim contiguous; its dtype is the output's.
* ``conv_state``: ``[rows, conv_dim, K - 1]`` (mixed's dtype), the last K - 1 conv inputs of
  each slot; ``conv_weight``: ``[conv_dim, K]``.
* ``g``, ``beta``: ``[B, HV]`` float32, the token's log-decay and write strength per value head.
* ``ssm_state``: ``[rows, HV, head_k_dim, head_v_dim]`` float32, contiguous.
* ``slots``: ``[B]`` int32, each sequence's row (taken modulo ``rows``: -1 is the last row, the
  scratch row of a CUDA graph's padding); ``positions``: ``[B]`` the token's position: at 0 the
  sequence starts from zero state (conv inputs and S), whatever its row held.
* returns ``[B, HV, head_v_dim]`` in mixed's dtype, and updates both states in place: the conv
  window shifted by the token, S by the gated delta rule (value head h reads key head
  ``h // (HV / num_k_heads)``; q and k L2-normalised, q scaled by ``head_k_dim ** -0.5``).
* ``head_k_dim`` must be a power of two (128 in the released models).

Two kernels: the conv update (grid ``(B, cdiv(conv_dim, BLOCK_C))``), whose SiLU output goes to
a ``[B, conv_dim]`` buffer, then the rule (grid ``(B, HV, cdiv(head_v_dim, BV))``): each program
holds a ``[head_k_dim, BV]`` tile of S in registers, so S is read once and written once per step
(what bounds a decode step: 2 MiB a sequence per layer at Qwen3.5-9B's 32 heads of 128 x 128).
``gdn_decode_ref`` is the torch reference (``nvray/layers/gated_delta_rule.py``, the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


__all__ = ["gdn_decode"]

_BLOCK_C = 256
_BV = 32


@triton.jit
def _row_of(slots_ptr, b, rows):
    """The state row of sequence ``b``: its slot modulo ``rows`` (Python's: -1 is the last)."""
    slot = tl.load(slots_ptr + b).to(tl.int64) % rows
    return tl.where(slot < 0, slot + rows, slot)


@triton.jit
def _conv_update_kernel(x_ptr, stride_x, state_ptr, w_ptr, out_ptr, slots_ptr, pos_ptr, rows,
                        channels, K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    row = _row_of(slots_ptr, b, rows)
    resumes = tl.load(pos_ptr + b) > 0
    j = tl.arange(0, KP)  # the window's first K - 1 entries: the state
    in_state = j < K - 1
    base = state_ptr + row * channels * (K - 1) + c[:, None] * (K - 1)
    mask2 = cmask[:, None] & in_state[None, :]
    prev = tl.load(base + j[None, :], mask=mask2, other=0.0).to(tl.float32)
    prev = tl.where(resumes, prev, 0.0)  # a sequence at position 0: zero state
    later = tl.load(base + j[None, :] + 1, mask=mask2 & (j[None, :] + 1 < K - 1), other=0.0)
    later = tl.where(resumes, later, tl.zeros_like(later))
    x = tl.load(x_ptr + b * stride_x + c, mask=cmask, other=0.0)
    w = tl.load(w_ptr + c[:, None] * K + j[None, :], mask=mask2, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + c * K + K - 1, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.sum(prev * w, axis=1) + x.to(tl.float32) * w_last
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * channels + c, out.to(x.dtype), mask=cmask)
    shifted = tl.where(j[None, :] == K - 2, x[:, None].to(later.dtype), later)
    tl.store(base + j[None, :], shifted, mask=mask2)


@triton.jit
def unit_key(k):
    """A key (or query) head L2-normalised, as the rule reads it."""
    return k * tl.rsqrt(tl.sum(k * k) + 1e-6)


@triton.jit
def delta_update(s, k, v, g, beta):
    """One token's gated delta rule update of a ``[head_k_dim, BV]`` tile of S:
    ``S <- exp(g) S``, then ``S <- S + k (beta (v - S^T k))^T``."""
    s = s * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    return s + k[:, None] * delta[None, :]


@triton.jit
def _rule_kernel(conv_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, pos_ptr, rows,
                 num_v_heads, group, key_dim, conv_dim, scale, DK: tl.constexpr,
                 DV: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = vs < DV
    kh = h // group
    dk = tl.arange(0, DK)
    token = conv_ptr + b * conv_dim
    q = tl.load(token + kh * DK + dk).to(tl.float32)
    k = tl.load(token + key_dim + kh * DK + dk).to(tl.float32)
    q = unit_key(q) * scale
    k = unit_key(k)
    v = tl.load(token + 2 * key_dim + h * DV + vs, mask=vmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * num_v_heads + h)
    beta = tl.load(beta_ptr + b * num_v_heads + h)
    row = _row_of(slots_ptr, b, rows)
    resumes = tl.load(pos_ptr + b) > 0
    tile = state_ptr + ((row * num_v_heads + h) * DK + dk[:, None]) * DV + vs[None, :]
    s = tl.load(tile, mask=vmask[None, :], other=0.0)
    s = delta_update(tl.where(resumes, s, 0.0), k, v, g, beta)  # position 0: zero state
    tl.store(tile, s, mask=vmask[None, :])
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + (b * num_v_heads + h) * DV + vs, o.to(out_ptr.dtype.element_ty), mask=vmask)


def _check(mixed: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
           g: torch.Tensor, ssm_state: torch.Tensor, head_k_dim: int) -> None:
    if mixed.dim() != 2 or mixed.stride(-1) != 1:
        raise ValueError(f"mixed must be [B, conv_dim] with a contiguous last dim, got "
                         f"{tuple(mixed.shape)} strides {mixed.stride()}")
    if conv_state.shape[1] != mixed.shape[1] or conv_weight.shape[0] != mixed.shape[1]:
        raise ValueError("conv_state / conv_weight channels do not match mixed's conv_dim")
    if head_k_dim & (head_k_dim - 1):
        raise ValueError(f"head_k_dim={head_k_dim} must be a power of two")
    if g.dtype != torch.float32 or ssm_state.dtype != torch.float32 or not ssm_state.is_contiguous():
        raise ValueError("g, beta and ssm_state must be float32 (ssm_state contiguous)")


def gdn_decode(mixed: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
               g: torch.Tensor, beta: torch.Tensor, ssm_state: torch.Tensor,
               slots: torch.Tensor, positions: torch.Tensor, num_k_heads: int, head_k_dim: int,
               head_v_dim: int) -> torch.Tensor:
    _check(mixed, conv_state, conv_weight, g, ssm_state, head_k_dim)
    batch, channels = mixed.shape
    kernel = conv_weight.shape[1]
    num_v_heads = ssm_state.shape[1]
    rows = conv_state.shape[0]
    conv_out = torch.empty(batch, channels, dtype=mixed.dtype, device=mixed.device)
    out = torch.empty(batch, num_v_heads, head_v_dim, dtype=mixed.dtype, device=mixed.device)
    if batch == 0:
        return out
    _conv_update_kernel[(batch, triton.cdiv(channels, _BLOCK_C))](
        mixed, mixed.stride(0), conv_state, conv_weight, conv_out, slots, positions, rows,
        channels, K=kernel, KP=triton.next_power_of_2(kernel - 1), BLOCK_C=_BLOCK_C)
    bv = min(_BV, triton.next_power_of_2(head_v_dim))
    _rule_kernel[(batch, num_v_heads, triton.cdiv(head_v_dim, bv))](
        conv_out, g, beta, ssm_state, out, slots, positions, rows, num_v_heads,
        num_v_heads // num_k_heads, num_k_heads * head_k_dim, channels, head_k_dim ** -0.5,
        DK=head_k_dim, DV=head_v_dim, BV=bv)
    return out
