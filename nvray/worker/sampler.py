"""Sampler: logits of the rows to sample -> one token id per row.

Per row: banned ids (EOS/stop ids before ``min_tokens``) get -inf; temperature 0 is greedy
argmax; otherwise logits / temperature, then top-k, top-p and min-p filtering (a filtered token
gets probability exactly 0, so it can never be drawn), then an exponential-race draw
(argmax of p / E with E ~ Exp(1), equivalent to sampling from p). A row with a seed draws its
noise from a generator seeded by (seed, index of the token in the output), so its tokens do not
depend on which other requests share the batch, nor on preemption.

``compiled=True`` (the model runner's choice on the GPU): a batch without filters, bans or seeds
— the common case — runs the same draw as one ``torch.compile``d pass over the logits, in log
space (argmax of logits / T - log E; measured on an H100, 256 rows x 151936: three kernels,
0.40 ms, before this form); other batches take the eager path.
"""

from __future__ import annotations

import functools

import torch

from nvray.engine.step_input import SampleSpec

_MASK64 = (1 << 63) - 1


def _row_seed(seed: int, step_index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + step_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64


def _filter_sorted(sorted_logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """Mask (to -inf) what top-k/top-p/min-p remove; input sorted descending per row."""
    rows, vocab = sorted_logits.shape
    device = sorted_logits.device
    top_k = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs], device=device)
    top_p = torch.tensor([s.top_p for s in specs], device=device, dtype=torch.float32)
    min_p = torch.tensor([s.min_p for s in specs], device=device, dtype=torch.float32)
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


def _race(logits: torch.Tensor, temps: torch.Tensor, is_greedy: torch.Tensor) -> torch.Tensor:
    """Greedy rows: argmax; others: the exponential race on softmax(logits / temperature) in
    log space, argmax(logits / T - log E): the softmax's normalizer is the same for every token
    of a row, so it needs no pass of its own and the whole draw is one pass over the logits."""
    logits = logits.float()
    noise = torch.empty_like(logits).exponential_()
    race = torch.where(is_greedy.unsqueeze(1), logits, logits / temps.unsqueeze(1) - noise.log())
    return race.argmax(dim=-1)


@functools.cache
def _compiled_race():  # noqa: ANN202
    return torch.compile(_race, dynamic=True)


def _is_plain(specs: list[SampleSpec]) -> bool:
    """No bans, no seeds, no filters: what the compiled path computes."""
    return not _needs_filtering(specs) and not any(s.banned_token_ids or s.seed is not None
                                                   for s in specs)


def sample(logits: torch.Tensor, specs: list[SampleSpec], compiled: bool = False) -> torch.Tensor:
    """logits [S, V] -> token ids [S] (int64)."""
    if all(s.temperature == 0.0 for s in specs):
        if not any(s.banned_token_ids for s in specs):
            return logits.argmax(dim=-1)
    elif compiled and _is_plain(specs):
        dev = logits.device
        temps = torch.tensor([s.temperature or 1.0 for s in specs], pin_memory=True)
        greedy = torch.tensor([s.temperature == 0.0 for s in specs], pin_memory=True)
        return _compiled_race()(logits, temps.to(dev, non_blocking=True),
                                greedy.to(dev, non_blocking=True))
    logits = logits.to(torch.float32, copy=True)  # the caller's logits stay as they were
    for i, spec in enumerate(specs):
        if spec.banned_token_ids:
            logits[i, list(spec.banned_token_ids)] = float("-inf")
    greedy = logits.argmax(dim=-1)
    if all(s.temperature == 0.0 for s in specs):
        return greedy
    temps = torch.tensor([s.temperature or 1.0 for s in specs], device=logits.device)
    scaled = logits / temps.unsqueeze(1)
    if _needs_filtering(specs):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        scaled = torch.full_like(scaled, float("-inf")).scatter_(1, order, _filter_sorted(sorted_logits, specs))
    probs = scaled.softmax(dim=-1)
    sampled = (probs / _exponential_noise(tuple(probs.shape), specs, logits.device)).argmax(dim=-1)
    is_greedy = torch.tensor([s.temperature == 0.0 for s in specs], device=logits.device)
    return torch.where(is_greedy, greedy, sampled)
