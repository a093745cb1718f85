"""Log-probabilities of chosen tokens and the top-k at their positions, on the device.

``LogprobRows`` gathers, for one step, the rows that report log-probabilities: sampled rows
whose spec asks (scored against the sampled id, known only on the device) and prompt rows
(scored against the next prompt token). Each row's log-softmax is taken over the model's raw
logits (fp32), so temperature, penalties and filters never change what is reported. Prompt rows
go through the LM head in chunks, so scoring a long prompt never holds a [tokens, vocab] tensor.
The results reach the host through pinned buffers and an event, like the sampled ids.
"""

from __future__ import annotations

from typing import Callable

import torch

from nvray.outputs import TokenLogprobs

_CHUNK_ROWS = 512  # prompt rows per LM-head call


def _score(logits: torch.Tensor, targets: torch.Tensor, k: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(1, targets.long().unsqueeze(1)).squeeze(1)
    if k == 0:
        empty = logp.new_empty(logp.shape[0], 0)
        return chosen, empty.long(), empty
    top_vals, top_ids = logp.topk(k, dim=-1)
    return chosen, top_ids, top_vals


class LogprobRows:
    """Accumulates scored rows of one step; ``to_host()`` starts their copy."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add_sampled(self, logits: torch.Tensor, sampled: torch.Tensor) -> None:
        if logits.shape[0]:
            self.parts.append(_score(logits, sampled, self.k))

    def add_prompt(self, hidden: torch.Tensor, targets: torch.Tensor,
                   lm_head: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """Every rank calls this (the LM head is a collective); rank 0 keeps the scores."""
        for lo in range(0, hidden.shape[0], _CHUNK_ROWS):
            logits = lm_head(hidden[lo:lo + _CHUNK_ROWS])
            if logits is not None:
                self.parts.append(_score(logits, targets[lo:lo + _CHUNK_ROWS], self.k))

    def to_host(self) -> "HostLogprobs":
        chosen = torch.cat([p[0] for p in self.parts])
        ids = torch.cat([p[1] for p in self.parts]).to(torch.int32)
        vals = torch.cat([p[2] for p in self.parts])
        if chosen.device.type != "cuda":
            return HostLogprobs(chosen, ids, vals, None)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (chosen, ids, vals)]
        for dst, src in zip(host, (chosen, ids, vals)):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return HostLogprobs(*host, event)


class HostLogprobs:
    def __init__(self, chosen: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor,
                 event: torch.cuda.Event | None) -> None:
        self.chosen, self.ids, self.vals, self.event = chosen, ids, vals, event

    def result(self, ks: list[int]) -> list[TokenLogprobs]:
        """Row i keeps its own top ``ks[i]`` (the rows were computed with the largest k)."""
        if self.event is not None:
            self.event.synchronize()
        chosen, ids, vals = self.chosen.tolist(), self.ids.tolist(), self.vals.tolist()
        return [TokenLogprobs(c, i[:k], v[:k]) for c, i, v, k in zip(chosen, ids, vals, ks)]
