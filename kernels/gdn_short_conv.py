"""Gated DeltaNet's causal conv over short chunks (``nvray/layers/gated_deltanet.py``):
speculative decoding's verification steps, whose chunks are a sequence's newest token and its
few drafts. One kernel does what the general path does in a dozen (the chunks laid out after
their windows, the conv, SiLU, the held rows kept, the new windows stored).

Contract
--------
``gdn_short_conv(mixed, conv_state, weight, read_rows, write_rows, resumes, query_start_loc,
real_lens, held_at, held_mixed, held_conv) -> conv``

* ``mixed``: ``[T, C]`` the tokens' conv inputs, contiguous; ``conv_state``: ``[rows, C,
  K - 1]`` each row's last K - 1 inputs, contiguous, ``mixed``'s dtype; ``weight``: ``[C, K]``.
* ``query_start_loc``: ``[N + 1]`` int32, the chunks' rows; ``real_lens``: ``[N]`` int, how
  many of a chunk's rows are tokens (the rest a CUDA graph's padding); ``read_rows``,
  ``write_rows``: ``[N]`` int64, the row each chunk's window comes from and the one its new
  window goes to; ``resumes``: ``[N]`` bool (false: a zero window).
* ``held_at``: ``[T]`` int64 or None: each row's row in ``held_mixed`` / ``held_conv``
  (``[rows * R, C]``), where its input and its output are kept too.
* returns ``[T, C]`` in ``mixed``'s dtype: ``SiLU(sum_m weight[:, m] * x[t - K + 1 + m])``
  over the chunk's window followed by its rows; a chunk's new window is its last K - 1 inputs
  before its padding (window entries where it has fewer tokens).
* No chunk that resumes may read a row another chunk writes (each program reads its window and
  then writes its new one, in no order across programs): the engine's chunks read and write
  their own slots, held chunks write the scratch row, which only chunks that do not resume
  read (a graph's padding sequences).

One kernel, grid ``(N, cdiv(C, BLOCK_C))``: each program loads its window once and walks its
chunk's rows. ``gdn_short_conv_ref`` is the torch reference (``nvray/layers/gated_delta_rule.py``:
the general path's pieces).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


__all__ = ["gdn_short_conv"]

_BLOCK_C = 128


@triton.jit
def _inputs(x_ptr, window_ptr, start, p, use, c, cmask, channels, resumes, K: tl.constexpr):
    """A chunk's inputs at positions ``p`` (a vector; p < 0: its window's entry K - 1 + p),
    where ``use``, as a [BLOCK_C, len(p)] float32 tile."""
    old = (p < 0) & use & (p * 0 + resumes.to(tl.int32) > 0)
    from_window = tl.load(window_ptr + c[:, None] * (K - 1) + (K - 1 + p)[None, :],
                          mask=cmask[:, None] & old[None, :], other=0.0)
    from_rows = tl.load(x_ptr + (start + p)[None, :] * channels + c[:, None],
                        mask=cmask[:, None] & ((p >= 0) & use)[None, :], other=0.0)
    return tl.where((p < 0)[None, :], from_window.to(tl.float32), from_rows.to(tl.float32))


@triton.jit
def _short_conv_kernel(x_ptr, state_ptr, w_ptr, out_ptr, read_ptr, write_ptr, resumes_ptr,
                       qsl_ptr, lens_ptr, held_ptr, held_x_ptr, held_out_ptr, channels,
                       HOLD: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    n = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    m = tl.arange(0, KP)  # a window's taps (K of them)
    start = tl.load(qsl_ptr + n).to(tl.int64)
    end = tl.load(qsl_ptr + n + 1).to(tl.int64)
    real = tl.load(lens_ptr + n).to(tl.int64)
    resumes = tl.load(resumes_ptr + n) != 0
    window = state_ptr + tl.load(read_ptr + n) * channels * (K - 1)
    w = tl.load(w_ptr + c[:, None] * K + m[None, :], mask=cmask[:, None] & (m < K)[None, :],
                other=0.0).to(tl.float32)
    # the new window (the last K - 1 inputs before the padding), read before any store: a
    # chunk that is not held writes the row it read
    final = _inputs(x_ptr, window, start, real - (K - 1) + m, m < K - 1, c, cmask, channels,
                    resumes, K)
    for t in range(0, end - start):
        taps = _inputs(x_ptr, window, start, t - (K - 1) + m, m < K, c, cmask, channels,
                       resumes, K)
        acc = tl.sum(w * taps, axis=1)
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (start + t) * channels + c, out.to(out_ptr.dtype.element_ty),
                 mask=cmask)
        if HOLD:
            at = tl.load(held_ptr + start + t)
            x = tl.load(x_ptr + (start + t) * channels + c, mask=cmask)
            tl.store(held_x_ptr + at * channels + c, x.to(held_x_ptr.dtype.element_ty), mask=cmask)
            tl.store(held_out_ptr + at * channels + c, out.to(held_out_ptr.dtype.element_ty),
                     mask=cmask)
    written = state_ptr + tl.load(write_ptr + n) * channels * (K - 1)
    tl.store(written + c[:, None] * (K - 1) + m[None, :], final.to(state_ptr.dtype.element_ty),
             mask=cmask[:, None] & (m < K - 1)[None, :])


def gdn_short_conv(mixed: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                   read_rows: torch.Tensor, write_rows: torch.Tensor, resumes: torch.Tensor,
                   query_start_loc: torch.Tensor, real_lens: torch.Tensor,
                   held_at: torch.Tensor | None, held_mixed: torch.Tensor,
                   held_conv: torch.Tensor) -> torch.Tensor:
    if not (mixed.is_contiguous() and conv_state.is_contiguous() and weight.is_contiguous()):
        raise ValueError("mixed, conv_state and weight must be contiguous")
    if held_at is not None and not (held_mixed.is_contiguous() and held_conv.is_contiguous()):
        raise ValueError("the held buffers must be contiguous")
    num, channels = read_rows.shape[0], mixed.shape[1]
    out = torch.empty_like(mixed)
    if num == 0:
        return out
    hold = held_at is not None
    read_rows, write_rows = read_rows.long(), write_rows.long()  # int64 row offsets
    _short_conv_kernel[(num, triton.cdiv(channels, _BLOCK_C))](
        mixed, conv_state, weight, out, read_rows, write_rows, resumes, query_start_loc,
        real_lens, held_at.long() if hold else read_rows, held_mixed if hold else mixed,
        held_conv if hold else out, channels, HOLD=hold, K=weight.shape[1],
        KP=triton.next_power_of_2(weight.shape[1]), BLOCK_C=_BLOCK_C)
    return out
