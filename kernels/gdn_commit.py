"""Gated DeltaNet's held rows committed (speculative decoding on Qwen3.5,
``nvray/layers/gated_deltanet.py``): the tokens of a verified chunk the engine kept, applied
to their slot's conv window and recurrent state in place.

Contract
--------
``gdn_commit(held_mixed, held_conv, held_g, held_beta, conv_state, ssm_state, slots, starts,
counts, held_rows, num_k_heads, head_k_dim, head_v_dim) -> None``

* ``held_mixed``, ``held_conv``: ``[rows * R, conv_dim]`` (R = ``held_rows``), a slot's held
  tokens at rows ``slot * R + j``: their conv inputs (``[q | k | v]`` projections) and their
  conv outputs (after SiLU), in ``conv_state``'s dtype; ``held_g``, ``held_beta``:
  ``[rows * R, HV]`` float32, their log-decays and write strengths.
* ``conv_state``: ``[rows, conv_dim, K - 1]``; ``ssm_state``: ``[rows, HV, head_k_dim,
  head_v_dim]`` float32, contiguous.
* ``slots``, ``starts``, ``counts``: ``[N]`` int32: the slots to commit, the position of their
  held chunk's first token (0: the chunk started the sequence, from zero state) and how many
  of its first tokens to apply (1..R; 0: the entry does nothing, as a CUDA graph's padding
  entries).
* Each slot's conv window becomes the last K - 1 entries of its old window followed by the kept
  inputs; its S takes each kept token's gated delta rule update in order (q and k of the conv
  output L2-normalised, value head h reading key head ``h // (HV / num_k_heads)``), as
  ``count`` decode steps would have.
* ``head_k_dim`` must be a power of two.

Two kernels: the windows (grid ``(N, cdiv(conv_dim, BLOCK_C))``) and the rule (grid
``(N, HV, cdiv(head_v_dim, BV))``: a ``[head_k_dim, BV]`` tile of S held in registers through
the kept tokens, so S is read and written once whatever the count).
``gdn_commit_ref`` is the torch reference (``nvray/layers/gated_delta_rule.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


from .gdn_decode import delta_update, unit_key

__all__ = ["gdn_commit"]

_BLOCK_C = 256
_BV = 32


@triton.jit
def _window_kernel(held_ptr, state_ptr, slots_ptr, starts_ptr, counts_ptr, channels, R,
                   K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    row = tl.load(slots_ptr + n).to(tl.int64)
    count = tl.load(counts_ptr + n)
    resumes = tl.load(starts_ptr + n) > 0
    i = tl.arange(0, KP)  # the new window's entries
    t = count + i  # ... taken from [old window (K - 1) | held inputs (R)]
    real = cmask[:, None] & ((i < K - 1) & (i * 0 + count > 0))[None, :]  # count 0: none
    from_old = (t < K - 1)[None, :]
    base = state_ptr + row * channels * (K - 1) + c[:, None] * (K - 1)
    old = tl.load(base + t[None, :], mask=real & from_old, other=0.0)
    old = tl.where(resumes, old, tl.zeros_like(old))  # a chunk from position 0: zero state
    held_row = row * R + (t - (K - 1))
    held = tl.load(held_ptr + held_row[None, :] * channels + c[:, None],
                   mask=real & ~from_old, other=0.0)
    tl.store(base + i[None, :], tl.where(from_old, old, held.to(old.dtype)), mask=real)


@triton.jit
def _rule_kernel(conv_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, starts_ptr, counts_ptr, R,
                 num_v_heads, group, key_dim, conv_dim, DK: tl.constexpr, DV: tl.constexpr,
                 BV: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = vs < DV
    kh = h // group
    dk = tl.arange(0, DK)
    row = tl.load(slots_ptr + n).to(tl.int64)
    count = tl.load(counts_ptr + n)
    resumes = tl.load(starts_ptr + n) > 0
    vmask = vmask & (vs * 0 + count > 0)  # 0 kept: the entry does nothing
    tile = state_ptr + ((row * num_v_heads + h) * DK + dk[:, None]) * DV + vs[None, :]
    s = tl.load(tile, mask=vmask[None, :], other=0.0)
    s = tl.where(resumes, s, 0.0)
    for j in range(0, count):
        at = row * R + j
        token = conv_ptr + at * conv_dim
        k = unit_key(tl.load(token + key_dim + kh * DK + dk).to(tl.float32))
        v = tl.load(token + 2 * key_dim + h * DV + vs, mask=vmask, other=0.0).to(tl.float32)
        s = delta_update(s, k, v, tl.load(g_ptr + at * num_v_heads + h),
                         tl.load(beta_ptr + at * num_v_heads + h))
    tl.store(tile, s, mask=vmask[None, :])


def gdn_commit(held_mixed: torch.Tensor, held_conv: torch.Tensor, held_g: torch.Tensor,
               held_beta: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
               slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, held_rows: int,
               num_k_heads: int, head_k_dim: int, head_v_dim: int) -> None:
    if head_k_dim & (head_k_dim - 1):
        raise ValueError(f"head_k_dim={head_k_dim} must be a power of two")
    if not (held_mixed.is_contiguous() and held_conv.is_contiguous() and ssm_state.is_contiguous()
            and conv_state.is_contiguous()):
        raise ValueError("the held buffers and the states must be contiguous")
    num, channels = slots.shape[0], held_mixed.shape[1]
    if num == 0:
        return
    kernel = conv_state.shape[2] + 1
    num_v_heads = ssm_state.shape[1]
    _window_kernel[(num, triton.cdiv(channels, _BLOCK_C))](
        held_mixed, conv_state, slots, starts, counts, channels, held_rows, K=kernel,
        KP=triton.next_power_of_2(kernel - 1), BLOCK_C=_BLOCK_C)
    bv = min(_BV, triton.next_power_of_2(head_v_dim))
    _rule_kernel[(num, num_v_heads, triton.cdiv(head_v_dim, bv))](
        held_conv, held_g, held_beta, ssm_state, slots, starts, counts, held_rows, num_v_heads,
        num_v_heads // num_k_heads, num_k_heads * head_k_dim, channels, DK=head_k_dim,
        DV=head_v_dim, BV=bv)
