"""Vocabulary-parallel embedding and LM head.

The vocabulary is split into equal shards (padded up when it does not divide); each rank
embeds the ids in its shard and an all-reduce sums the partial embeddings. The LM head computes
each rank's slice of the logits and gathers them on rank 0, which samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nvray.layers.tp import all_reduce, gather_last_dim, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size())
        self.vocab_start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        expected = (self.vocab_size, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected shape {expected}, checkpoint has {tuple(loaded.shape)}")
        rows = min(self.shard_size, self.vocab_size - self.vocab_start)
        param.data.zero_()
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        return all_reduce(y * mask.unsqueeze(-1).to(y.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [S, hidden] -> [S, vocab]
        logits = gather_last_dim(F.linear(hidden, self.weight))
        return logits[:, :self.vocab_size] if logits is not None else None
