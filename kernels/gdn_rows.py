"""Short chunks of Gated DeltaNet linear attention (``nvray/layers/gated_deltanet.py``) through
the recurrent rule, token by token: speculative decoding's verification steps, whose chunks
are a sequence's newest token and its few drafts (the chunked form pads each to 64 tokens).

Contract
--------
``gdn_rows(conv, g, beta, ssm_state, read_rows, write_rows, resumes, query_start_loc,
num_k_heads, head_k_dim, head_v_dim) -> out``

* ``conv``: ``[T, conv_dim]`` the tokens' conv outputs (after SiLU: ``[q | k | v]``, q and k
  ``num_k_heads * head_k_dim`` wide), contiguous; its dtype is the output's.
* ``g``, ``beta``: ``[T, HV]`` float32, contiguous: each token's log-decay and write strength.
* ``ssm_state``: ``[rows, HV, head_k_dim, head_v_dim]`` float32, contiguous.
* ``query_start_loc``: ``[N + 1]`` int32, the chunks' token offsets; ``read_rows``,
  ``write_rows``: ``[N]`` int64, the state row each chunk starts from and the one its final
  state goes to (a held chunk's: the scratch row); ``resumes``: ``[N]`` bool, false: the chunk
  starts from zero state.
* returns ``[T, HV, head_v_dim]``: each token's ``S^T q`` after its update (q and k
  L2-normalised, q scaled by ``head_k_dim ** -0.5``; value head h reads key head
  ``h // (HV / num_k_heads)``), as the chunked form and decode steps compute it.
* ``head_k_dim`` must be a power of two.

One kernel, grid ``(N, HV, cdiv(head_v_dim, BV))``: each program holds a ``[head_k_dim, BV]``
tile of S in registers through its chunk's tokens, so S is read and written once a chunk.
``gdn_rows_ref`` is the torch reference (``nvray/layers/gated_delta_rule.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


from .gdn_decode import delta_update, unit_key

__all__ = ["gdn_rows"]

_BV = 32


@triton.jit
def _rows_kernel(conv_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, read_ptr, write_ptr,
                 resumes_ptr, qsl_ptr, num_v_heads, group, key_dim, conv_dim, scale,
                 DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = vs < DV
    kh = h // group
    dk = tl.arange(0, DK)
    start = tl.load(qsl_ptr + n).to(tl.int64)
    end = tl.load(qsl_ptr + n + 1).to(tl.int64)
    read = tl.load(read_ptr + n)
    s = tl.load(state_ptr + ((read * num_v_heads + h) * DK + dk[:, None]) * DV + vs[None, :],
                mask=vmask[None, :], other=0.0)
    s = tl.where(tl.load(resumes_ptr + n) != 0, s, 0.0)
    for t in range(start, end):
        token = conv_ptr + t * conv_dim
        q = unit_key(tl.load(token + kh * DK + dk).to(tl.float32)) * scale
        k = unit_key(tl.load(token + key_dim + kh * DK + dk).to(tl.float32))
        v = tl.load(token + 2 * key_dim + h * DV + vs, mask=vmask, other=0.0).to(tl.float32)
        s = delta_update(s, k, v, tl.load(g_ptr + t * num_v_heads + h),
                         tl.load(beta_ptr + t * num_v_heads + h))
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + (t * num_v_heads + h) * DV + vs,
                 o.to(out_ptr.dtype.element_ty), mask=vmask)
    write = tl.load(write_ptr + n)
    tl.store(state_ptr + ((write * num_v_heads + h) * DK + dk[:, None]) * DV + vs[None, :], s,
             mask=vmask[None, :])


def gdn_rows(conv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm_state: torch.Tensor,
             read_rows: torch.Tensor, write_rows: torch.Tensor, resumes: torch.Tensor,
             query_start_loc: torch.Tensor, num_k_heads: int, head_k_dim: int,
             head_v_dim: int) -> torch.Tensor:
    if head_k_dim & (head_k_dim - 1):
        raise ValueError(f"head_k_dim={head_k_dim} must be a power of two")
    num_v_heads = ssm_state.shape[1]
    out = torch.empty(conv.shape[0], num_v_heads, head_v_dim, dtype=conv.dtype,
                      device=conv.device)
    num = read_rows.shape[0]
    if num == 0:
        return out
    conv, g, beta = conv.contiguous(), g.contiguous(), beta.contiguous()
    bv = min(_BV, triton.next_power_of_2(head_v_dim))
    _rows_kernel[(num, num_v_heads, triton.cdiv(head_v_dim, bv))](
        conv, g, beta, ssm_state, out, read_rows.long(), write_rows.long(),
        resumes.to(torch.int32), query_start_loc, num_v_heads, num_v_heads // num_k_heads,
        num_k_heads * head_k_dim, conv.shape[1], head_k_dim ** -0.5, DK=head_k_dim,
        DV=head_v_dim, BV=bv)
    return out
