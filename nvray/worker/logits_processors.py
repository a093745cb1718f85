"""Penalties, logit biases and allowed ids: batched changes to the logits before sampling.

``adjust_logits(logits, specs, prev_sampled)`` changes, in place, the rows whose ``SampleSpec``
asks for it (vLLM's definitions):

- ``allowed_token_ids``: every other id gets -inf; ``logit_bias``: ``logit += bias``;
- then (vLLM's order) repetition penalty ``r`` on every token of the prompt or the output: a
  positive logit is divided by ``r``, a negative one multiplied;
- frequency ``f`` and presence ``p`` penalties on the output: ``logit -= f * count + p``
  for every token that occurs ``count >= 1`` times.

Each change is a few tensor operations over all the rows that need it; each row's tokens come as
one int32 buffer, joined with numpy into one (row, token) list for the device (never a Python
loop over tokens or the vocabulary). A row whose newest output
token is still on the device (overlapped steps) counts it from ``prev_sampled``.
"""

from __future__ import annotations

import numpy as np
import torch

from nvray.step_protocol import Penalties, SampleSpec
from nvray.worker.device_lists import to_device


def adjust_logits(logits: torch.Tensor, specs: list[SampleSpec],
                  prev_sampled: torch.Tensor | None) -> torch.Tensor:
    """logits [S, V] float32, changed in place and returned."""
    _apply_allowed(logits, specs)
    _apply_bias(logits, specs)
    rows = [i for i, s in enumerate(specs) if s.penalties is not None]
    if rows:
        _apply_penalties(logits, rows, [specs[i].penalties for i in rows], prev_sampled)  # type: ignore[misc]
    return logits


def _gathered(penalties: list[Penalties], prompt: bool, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) of every prompt (``prompt``) or known output token of each row, flat."""
    arrays = [np.frombuffer(p.tokens, dtype=np.int32) for p in penalties]
    parts = [a[:p.num_prompt_tokens] if prompt else a[p.num_prompt_tokens:]
             for a, p in zip(arrays, penalties)]
    rows = np.repeat(np.arange(len(parts)), [len(part) for part in parts])
    return to_device(rows, device), to_device(np.concatenate(parts), device)


def _output_counts(penalties: list[Penalties], vocab: int, device: torch.device,
                   prev_sampled: torch.Tensor | None) -> torch.Tensor:
    """[R, V] how often each token occurs in each row's output (pending token included)."""
    counts = torch.zeros(len(penalties), vocab, device=device)
    rows, tokens = _gathered(penalties, False, device)
    counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
    pending = [(r, p.pending_row) for r, p in enumerate(penalties) if p.pending_row >= 0]
    if pending:
        assert prev_sampled is not None, "a pending output token but no previous step's ids"
        where = to_device(pending, device)
        newest = prev_sampled[where[:, 1]].long()
        counts.index_put_((where[:, 0], newest), torch.ones_like(newest, dtype=counts.dtype),
                          accumulate=True)
    return counts


def _apply_penalties(logits: torch.Tensor, rows: list[int], penalties: list[Penalties],
                     prev_sampled: torch.Tensor | None) -> None:
    device, vocab = logits.device, logits.shape[1]
    index = to_device(rows, device)
    sub = logits.index_select(0, index)
    counts = _output_counts(penalties, vocab, device, prev_sampled)
    rep = to_device([p.repetition for p in penalties], device, logits.dtype).unsqueeze(1)
    if any(p.repetition != 1.0 for p in penalties):
        seen = counts > 0
        prompt_rows, prompt_tokens = _gathered(penalties, True, device)
        seen[prompt_rows, prompt_tokens] = True
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = to_device([p.frequency for p in penalties], device, logits.dtype).unsqueeze(1)
    pres = to_device([p.presence for p in penalties], device, logits.dtype).unsqueeze(1)
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits.index_copy_(0, index, sub)


def _apply_bias(logits: torch.Tensor, specs: list[SampleSpec]) -> None:
    entries = [(i, token, bias) for i, s in enumerate(specs) for token, bias in s.logit_bias]
    if not entries:
        return
    device = logits.device
    rows = to_device([e[0] for e in entries], device)
    tokens = to_device([e[1] for e in entries], device)
    biases = to_device([e[2] for e in entries], device, logits.dtype)
    logits.index_put_((rows, tokens), biases, accumulate=True)


def _apply_allowed(logits: torch.Tensor, specs: list[SampleSpec]) -> None:
    entries = [(i, token) for i, s in enumerate(specs) if s.allowed_token_ids is not None
               for token in s.allowed_token_ids]
    if not entries:
        return
    device = logits.device
    restricted = to_device([s.allowed_token_ids is not None for s in specs], device, torch.bool)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    where = to_device(entries, device)
    keep[where[:, 0], where[:, 1]] = True
    logits.masked_fill_(restricted.unsqueeze(1) & ~keep, float("-inf"))
