"""Sampler: logits of the rows to sample -> one token id per row.

Per row: banned ids (EOS/stop ids before ``min_tokens``) get -inf; temperature 0 is greedy
argmax; otherwise logits / temperature, then top-k, top-p and min-p filtering (a filtered token
gets probability exactly 0, so it can never be drawn), then an exponential-race draw
(argmax of p / E with E ~ Exp(1), equivalent to sampling from p). A row with a seed draws its
noise from a generator seeded by (seed, index of the token in the output), so its tokens do not
depend on which other requests share the batch, nor on preemption. When every sampled row has
a top-k of at most ``_MAX_CANDIDATES``, the filters and the race run over each row's top K
tokens (``topk``, K the largest top-k) instead of the sorted vocabulary: the same tokens survive,
and a seeded row meets the same noise at each of them, so it draws the same token either way —
except where tokens of equal logits straddle a filter's cut, which keeps one of them on each path
(on an H100, bf16 logits: 2 rows of 64 differed with top-k 20 and top-p 0.95). Other filtered
batches sort the vocabulary, or with ``fused=True`` take each row's smallest kept logit from a
sort-free kernel (``kernels/filter_threshold.py``): the same tokens survive, except that all
tokens tied with the smallest kept logit do (a sort keeps some); a batch without seeds then
races in the fused kernel over the tokens at or above each row's threshold, a seeded one races
eagerly as above.

``fused=True`` (the model runner's choice on the GPU) also runs a batch without filters, bans or
seeds — the common case — and a greedy batch without bans as one Triton kernel
(``kernels/sample_race.py``: greedy rows take the argmax, the others a Gumbel race, the same
distribution); its noise seed comes from torch's default generator. A batch whose rows share one
temperature passes it as a scalar, so the launch needs no host tensor. Other batches take the
eager path.
"""

from __future__ import annotations

import torch

from nvray.step_protocol import SampleSpec
from nvray.worker.device_lists import to_device

_MASK64 = (1 << 63) - 1
# top-k up to this many tokens filters and races over each row's top K instead of sorting the
# whole vocabulary (H100, 256 rows of 151,936: the sort path took 6.4 ms of GPU time a step)
_MAX_CANDIDATES = 1024


def _row_seed(seed: int, step_index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + step_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64


def _filter_values(specs: list[SampleSpec], vocab: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' top-k (int32, ``vocab`` where off), top-p and min-p (float32) on device."""
    top_k = to_device([s.top_k if s.top_k > 0 else vocab for s in specs], device, torch.int32)
    top_p = to_device([s.top_p for s in specs], device, torch.float32)
    min_p = to_device([s.min_p for s in specs], device, torch.float32)
    return top_k, top_p, min_p


def _filter_sorted(sorted_logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """Mask (to -inf) what top-k/top-p/min-p remove; input sorted descending per row."""
    vocab = sorted_logits.shape[1]
    top_k, top_p, min_p = _filter_values(specs, vocab, sorted_logits.device)
    rank = torch.arange(vocab, device=sorted_logits.device).unsqueeze(0)  # [1, V]
    masked = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = masked.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p 1 is off: a float32 cumsum may reach 1 before the last token
    remove = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    remove |= probs < (min_p * probs[:, :1].squeeze(1)).unsqueeze(1)
    remove[:, 0] = False  # the most likely token always survives
    return masked.masked_fill(remove, float("-inf"))


def _needs_filtering(specs: list[SampleSpec]) -> bool:
    return any(s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0.0 for s in specs)


def _exponential_noise(specs: list[SampleSpec], vocab: int, device: torch.device,
                       columns: torch.Tensor | None = None) -> torch.Tensor:
    """E ~ Exp(1) for every row and token [S, V], or for the tokens in ``columns`` only
    [S, K]. A seeded row draws its whole vocabulary from its own generator and keeps the
    columns asked for, so its noise at a token never depends on which columns those are."""
    noise = torch.empty(len(specs), vocab if columns is None else columns.shape[1],
                        device=device).exponential_()
    for i, spec in enumerate(specs):
        if spec.seed is not None:
            gen = torch.Generator(device=device).manual_seed(_row_seed(spec.seed, spec.step_index))
            row = torch.empty(vocab, device=device).exponential_(generator=gen)
            noise[i] = row if columns is None else row[columns[i]]
    return noise


def _candidate_count(specs: list[SampleSpec], vocab: int) -> int:
    """K when every sampled (non-greedy) row keeps at most its ``top_k <= K`` best tokens:
    then the top K of each row hold every token it can draw; 0 otherwise."""
    ks = [s.top_k for s in specs if s.temperature != 0.0]
    if not ks or min(ks) <= 0 or max(ks) > _MAX_CANDIDATES:
        return 0
    return min(max(ks), vocab)


def _thresholds(scaled: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """Each row's smallest logit that top-k/top-p/min-p keep [S], from the sort-free kernel
    (``kernels/filter_threshold.py``)."""
    from kernels import filter_thresholds  # noqa: PLC0415 - GPU-only import

    return filter_thresholds(scaled, *_filter_values(specs, scaled.shape[1], scaled.device))


def _fused_race(scaled: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Unseeded rows: the race in one kernel over each row's tokens at or above its threshold."""
    from kernels import race_sample  # noqa: PLC0415 - GPU-only import

    return race_sample(scaled, 1.0, _kernel_seed(), thresholds)


def _race(scaled: torch.Tensor, specs: list[SampleSpec], fused: bool) -> torch.Tensor:
    """Filter ``scaled`` (logits / temperature) and draw one token per row."""
    vocab = scaled.shape[1]
    filtered = _needs_filtering(specs)
    k = _candidate_count(specs, vocab) if filtered else 0
    if k:  # the rows' top K, sorted: the filters and the race over K columns, not V
        top, columns = scaled.topk(k, dim=-1)
        probs = _filter_sorted(top, specs).softmax(dim=-1)
        noise = _exponential_noise(specs, vocab, scaled.device, columns)
        return columns.gather(1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
    if filtered and fused:
        thresholds = _thresholds(scaled, specs)
        if not any(s.seed is not None for s in specs):
            return _fused_race(scaled, thresholds)
        scaled = scaled.masked_fill(scaled < thresholds.unsqueeze(1), float("-inf"))
    elif filtered:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        scaled = torch.full_like(scaled, float("-inf")).scatter_(
            1, order, _filter_sorted(sorted_logits, specs))
    noise = _exponential_noise(specs, vocab, scaled.device)
    return (scaled.softmax(dim=-1) / noise).argmax(dim=-1)


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


def _kernel_seed() -> int:
    """The race kernel's noise seed, from torch's default generator."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def _fused_sample(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    from kernels import race_sample  # noqa: PLC0415 - GPU-only import

    return race_sample(logits, _temperatures(specs, logits.device), _kernel_seed())


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
    sampled = _race(logits / temps.unsqueeze(1), specs, fused)
    is_greedy = to_device([s.temperature == 0.0 for s in specs], logits.device, torch.bool)
    return torch.where(is_greedy, greedy, sampled)
