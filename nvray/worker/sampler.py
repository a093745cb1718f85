"""Sampler: logits of the rows to sample -> one token id per row.

Per row: banned ids (EOS/stop ids before ``min_tokens``) get -inf; temperature 0 is greedy
argmax; otherwise logits / temperature, then top-k, top-p and min-p filtering (a filtered token
gets probability exactly 0, so it can never be drawn), then an exponential-race draw
(argmax of p / E with E ~ Exp(1), equivalent to sampling from p). A row with a seed draws its
noise from a generator seeded by (seed, index of the token in the output), so its tokens do not
depend on which other requests share the batch, nor on preemption.

``fused=True`` (the model runner's choice on the GPU): a batch without filters, bans or seeds —
the common case — and a greedy batch without bans run as one Triton kernel
(``kernels/sample_race.py``: greedy rows take the argmax, the others a Gumbel race, the same
distribution); its noise seed comes from torch's default generator. A batch whose rows share one
temperature passes it as a scalar, so the launch needs no host tensor. Other batches take the
eager path.
"""

from __future__ import annotations

import torch

from nvray.engine.step_input import SampleSpec
from nvray.worker.device_lists import to_device

_MASK64 = (1 << 63) - 1


def _row_seed(seed: int, step_index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + step_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64


def _filter_sorted(sorted_logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """Mask (to -inf) what top-k/top-p/min-p remove; input sorted descending per row."""
    rows, vocab = sorted_logits.shape
    device = sorted_logits.device
    top_k = to_device([s.top_k if s.top_k > 0 else vocab for s in specs], device)
    top_p = to_device([s.top_p for s in specs], device, torch.float32)
    min_p = to_device([s.min_p for s in specs], device, torch.float32)
    rank = torch.arange(vocab, device=device).unsqueeze(0)  # [1, V]
    masked = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = masked.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove = mass_before >= top_p.unsqueeze(1)
    remove |= probs < (min_p * probs[:, :1].squeeze(1)).unsqueeze(1)
    remove[:, 0] = False  # the most likely token always survives
    return masked.masked_fill(remove, float("-inf"))


def _needs_filtering(specs: list[SampleSpec]) -> bool:
    return any(s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0.0 for s in specs)


def _exponential_noise(shape: tuple[int, int], specs: list[SampleSpec], device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for i, spec in enumerate(specs):
        if spec.seed is not None:
            gen = torch.Generator(device=device).manual_seed(_row_seed(spec.seed, spec.step_index))
            noise[i].exponential_(generator=gen)
    return noise


def _is_plain(specs: list[SampleSpec]) -> bool:
    """No bans, no seeds, no filters: what the fused kernel computes."""
    return not _needs_filtering(specs) and not any(s.banned_token_ids or s.seed is not None
                                                   for s in specs)


def _temperatures(specs: list[SampleSpec], device: torch.device) -> float | torch.Tensor:
    """The rows' temperatures: one float when they share it, else a float32 tensor on device."""
    first = specs[0].temperature
    if all(s.temperature == first for s in specs):
        return first
    return to_device([s.temperature for s in specs], device, torch.float32)


def _ban(logits: torch.Tensor, specs: list[SampleSpec]) -> None:
    """-inf for each row's banned ids (one scatter for the whole batch)."""
    where = [(i, token) for i, spec in enumerate(specs) for token in spec.banned_token_ids]
    if where:
        index = to_device(where, logits.device)
        logits[index[:, 0], index[:, 1]] = float("-inf")


def _fused_sample(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    from kernels import race_sample  # noqa: PLC0415 - GPU-only import

    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    return race_sample(logits, _temperatures(specs, logits.device), seed)


def sample(logits: torch.Tensor, specs: list[SampleSpec], fused: bool = False) -> torch.Tensor:
    """logits [S, V] -> token ids [S] (int64; int32 from the fused kernel)."""
    if all(s.temperature == 0.0 for s in specs):
        if not any(s.banned_token_ids for s in specs):
            return _fused_sample(logits, specs) if fused else logits.argmax(dim=-1)
    elif fused and _is_plain(specs):
        return _fused_sample(logits, specs)
    logits = logits.to(torch.float32, copy=True)  # the caller's logits stay as they were
    _ban(logits, specs)
    greedy = logits.argmax(dim=-1)
    if all(s.temperature == 0.0 for s in specs):
        return greedy
    temps = to_device([s.temperature or 1.0 for s in specs], logits.device, torch.float32)
    scaled = logits / temps.unsqueeze(1)
    if _needs_filtering(specs):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        scaled = torch.full_like(scaled, float("-inf")).scatter_(1, order, _filter_sorted(sorted_logits, specs))
    probs = scaled.softmax(dim=-1)
    sampled = (probs / _exponential_noise(tuple(probs.shape), specs, logits.device)).argmax(dim=-1)
    is_greedy = to_device([s.temperature == 0.0 for s in specs], logits.device, torch.bool)
    return torch.where(is_greedy, greedy, sampled)
