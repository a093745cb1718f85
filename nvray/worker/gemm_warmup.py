"""Load the GEMM kernels a run will pick before it runs, so no step waits for the device.

cuBLAS picks its kernel by the problem's shape, and the first launch of a kernel that is not
loaded yet blocks the host until the device has drained its queue (measured on an H100, torch
2.11/CUDA 13: a matmul of a new row count behind 50 ms of queued work returned after 50.8 ms;
the same matmul again after 0.2 ms; ``CUDA_MODULE_LOADING=EAGER`` did not change it). On an
overlapped step that wait is the whole point lost: the host cannot prepare the next step while
the device works. Eager steps vary in row count — the LM head runs on the rows to sample (one
per sequence finishing its prompt or decoding), the layers on the step's tokens — so a run
meets new kernels until it has seen most sizes: the throughput bench's LM head waited 20-52 ms
on 7 of its 9 prefill steps.

``warm_gemms`` runs each distinct linear layer of the model (one per class and weight shape:
the layers call cuBLAS the same way) over ``token_counts(max_num_batched_tokens)`` and the LM
head over every row count a step samples (``EngineConfig.max_sampled_rows``), on zeros. Every
rank runs the same calls in the same order, so the tensor-parallel collectives inside the layers match up.
"""

from __future__ import annotations

import torch
from torch import nn

from nvray.layers.linear import LinearBase

# below this many tokens every count is warmed; above, one count per stride (kernel choice
# changes with the row count's tile multiple, not with each row)
_EVERY_UP_TO = 256
_STRIDES = ((2048, 8), (8192, 32), (None, 128))  # (up to, stride)


def token_counts(max_tokens: int) -> list[int]:
    """Row counts to warm the layers with, ascending: every count up to 256, then one in 8
    up to 2048, one in 32 up to 8192, one in 128 beyond; ``max_tokens`` itself last."""
    counts = list(range(1, min(_EVERY_UP_TO, max_tokens) + 1))
    m = counts[-1]
    for limit, stride in _STRIDES:
        top = max_tokens if limit is None else min(limit, max_tokens)
        counts.extend(range(m + stride, top + 1, stride))
        m = counts[-1]
    if counts[-1] != max_tokens:
        counts.append(max_tokens)
    return counts


def distinct_linears(model: nn.Module) -> list[LinearBase]:
    """One linear layer per (class, weight shape, dtype, bias or not)."""
    seen: dict[tuple, LinearBase] = {}
    for module in model.modules():
        if isinstance(module, LinearBase):
            key = (type(module), tuple(module.weight.shape), module.weight.dtype,
                   module.bias is not None)
            seen.setdefault(key, module)
    return list(seen.values())


@torch.inference_mode()
def warm_gemms(model: nn.Module, hidden_size: int, max_tokens: int, max_rows: int) -> int:
    """Run the model's GEMMs (its linear layers, then ``compute_logits`` on ``hidden_size``-wide
    rows) at the row counts steps will use; returns how many ran."""
    weight = next(model.parameters())
    linears = distinct_linears(model)
    widest = max([layer.weight.shape[1] for layer in linears] + [hidden_size])
    buffer = torch.zeros(max(max_tokens, max_rows) * widest, dtype=weight.dtype,
                         device=weight.device)

    def rows(m: int, width: int) -> torch.Tensor:  # contiguous, as the model's activations are
        return buffer[:m * width].view(m, width)

    runs = 0
    for layer in linears:
        for m in token_counts(max_tokens):
            layer(rows(m, layer.weight.shape[1]))
            runs += 1
    for m in range(1, max_rows + 1 if model.lm_head is not None else 1):  # a last stage's
        model.compute_logits(rows(m, hidden_size))
        runs += 1
    return runs
