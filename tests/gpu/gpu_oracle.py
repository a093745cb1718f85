"""The bf16 oracle of the GPU tier: HF transformers' Qwen3 in fp32 on the same (bf16) weights.

A token nvray picks greedily must be an argmax up to bf16 noise: its fp32 logit must be within
``NEAR_TIE_FACTOR`` times the bf16 noise of the fp32 maximum, where the noise is measured at the
same position as the RMS difference between HF's own bf16 and fp32 logits. A wrong model picks
tokens many noise levels below the maximum; an exact-match rule would instead fail on the
near-ties that 151936 random logits always have somewhere.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import time
from typing import Callable

import torch

NEAR_TIE_FACTOR = 4.0


@functools.lru_cache(maxsize=None)
def hf_model_gpu(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to("cuda").eval()


@torch.no_grad()
def hf_logits(path: str, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """[len(ids), V] fp32 logits of every position of ``ids`` (one forward, no cache); in
    float32 through the modeling module's own torch functions (``_modules_own_functions``)."""
    model = hf_model_gpu(path, dtype)
    with _modules_own_functions(model) if dtype == torch.float32 else contextlib.nullcontext():
        return model(torch.tensor([ids], device="cuda")).logits[0].float()


@contextlib.contextmanager
def _modules_own_functions(model):  # noqa: ANN001 - an HF model
    """transformers swaps Qwen3.5's torch gated delta rules for fla-core's Triton kernels where
    fla-core is installed, whose float32 dots run in TF32 (about 1e-3 relative): the fp32 oracle
    would not be fp32, and would differ from run to run as fla-core's autotuner picks other
    tiles. While this is held the module's own torch rules run (a module without them is left
    as it is); the bf16 oracle, whose noise the near-argmax rule measures, keeps fla-core's."""
    module = sys.modules[type(model).__module__]
    swapped = {name: value for name, value in vars(module).items()
               if "gated_delta_rule" in name and hasattr(value, "__wrapped__")}
    try:
        for name, value in swapped.items():
            setattr(module, name, inspect.unwrap(value))
        yield
    finally:
        for name, value in swapped.items():
            setattr(module, name, value)


def check_greedy_near_argmax(path: str, prompt: list[int], output: list[int],
                             logits: Callable[[list[int], torch.dtype], torch.Tensor] | None = None
                             ) -> dict[str, float]:
    """Assert each output token is an fp32-oracle argmax up to bf16 noise; returns match rates.
    ``logits(ids, dtype)`` is the oracle (default: HF's model of ``path``)."""
    logits = logits or functools.partial(hf_logits, path)
    ids = prompt + output
    ref = logits(ids, torch.float32)[len(prompt) - 1:-1]  # [n_out, V]
    bf16 = logits(ids, torch.bfloat16)[len(prompt) - 1:-1]
    assert torch.isfinite(ref).all() and torch.isfinite(bf16).all()
    noise = (bf16 - ref).pow(2).mean(-1).sqrt()  # [n_out] bf16 noise per position
    chosen = ref.gather(1, torch.tensor(output, device="cuda").unsqueeze(1)).squeeze(1)
    gap = ref.max(-1).values - chosen
    bad = (gap > NEAR_TIE_FACTOR * noise + 1e-3).nonzero().flatten().tolist()
    assert not bad, (f"tokens {bad} of {len(output)} are not argmaxes up to bf16 noise: "
                     f"gap {gap[bad].tolist()} vs noise {noise[bad].tolist()}")
    exact = (ref.argmax(-1) == torch.tensor(output, device="cuda")).float().mean().item()
    return {"fp32_argmax_rate": exact, "max_gap_over_noise": float((gap / noise).max())}


def wait_gpu_memory_below(used_bytes: int, timeout_s: float = 60.0, settle_s: float = 3.0) -> None:
    """Ray ranks give their memory back when their process exits, a moment after shutdown.
    Returns once the device's use is at most ``used_bytes``, or once it has stopped falling for
    ``settle_s`` (what is left then, a CUDA context or the allocator's cache, never comes back:
    waiting the whole ``timeout_s`` for it cost a minute a call)."""
    deadline = time.monotonic() + timeout_s
    lowest, since = None, time.monotonic()
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if total - free <= used_bytes:
            return
        if lowest is None or total - free < lowest - (16 << 20):
            lowest, since = total - free, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return
        time.sleep(0.25)
