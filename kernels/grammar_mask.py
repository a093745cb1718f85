"""Grammar token masks applied to chosen rows of the logits, in place.

Contract
--------
``mask_logits(logits, masks, rows, sources) -> None``

* ``logits``: ``[S, V]`` (any float dtype), last dim contiguous.
* ``masks``: ``[M, W]`` int32, contiguous, same device: packed token bitmasks, bit ``t % 32``
  of word ``t // 32`` set where token ``t`` is allowed (xgrammar's layout); ``W * 32 >= V``.
* ``rows``, ``sources``: ``[n]`` int32 or int64, same device: logits row ``rows[i]`` takes
  mask ``sources[i]``. Rows not listed are left alone; listed rows are distinct.

Every token a row's mask forbids becomes -inf; allowed tokens keep their value (the kernel
writes only forbidden positions and reads no logits). One program per (listed row, block of
``BLOCK`` tokens). The row count is the grid's, not an argument, so one compiled variant serves
every batch (Triton specializes integer arguments equal to 1 or divisible by 16, and a variant
compiled mid-run stalls the step). ``mask_logits_ref`` is the pure-torch reference with the
same signature (the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["mask_logits"]

BLOCK = 4096  # tokens per program: 128 mask words


@triton.jit
def _mask_logits_kernel(logits_ptr, logits_stride, masks_ptr, mask_words, rows_ptr, sources_ptr,
                        vocab_size, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    source = tl.load(sources_ptr + i).to(tl.int64)
    words = block * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(masks_ptr + source * mask_words + words, mask=words < mask_words, other=0)
    forbidden = ((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
    forbidden = tl.reshape(forbidden, (BLOCK,))
    tokens = block * BLOCK + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"),
             mask=forbidden & (tokens < vocab_size))


def mask_logits(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor,
                sources: torch.Tensor) -> None:
    n, vocab_size = rows.numel(), logits.shape[1]
    if n == 0:
        return
    assert logits.stride(1) == 1 and masks.is_contiguous() and masks.dtype == torch.int32
    assert masks.shape[1] * 32 >= vocab_size, "masks narrower than the vocabulary"
    grid = (n, triton.cdiv(vocab_size, BLOCK))
    _mask_logits_kernel[grid](logits, logits.stride(0), masks, masks.shape[1], rows, sources,
                              vocab_size, BLOCK=BLOCK)
