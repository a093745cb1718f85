"""Eagle3Drafter: speculative decoding's EAGLE-3 drafter (``speculative_config`` method
``eagle3``) on the target's ranks; the network is ``nvray/models/eagle3.py``.

It is the draft model's machinery (``drafter.py``: its own paged KV cache with a twin of every
target block, the target's block tables, fed only in steps where a sequence drafts, one feed
forward and one forward per further draft, CUDA graphs in the target's pool) with three
differences:
- **Features.** The target stores, at every KV slot it computes, its feature there (three
  layers' input streams, ``AuxCapture``) in a cache beside the drafter's (``features``: one row
  a slot, a twin of every block, copied on write with it). A fed row at position i reads
  ``fc`` of the feature at i, so a sequence catches up on positions computed in steps where it
  did not draft, or that a prefix-cache hit gave it.
- **One position back.** Token p's row sits at position p - 1 (its feature's; token 0 has
  none): the drafter's cache lags the target's by one token and the newest token's row
  proposes the first draft. A further draft's row reads the row before's hidden state
  (``prenorm``) instead of a feature.
- **A prefix hit leaves its last block out** (``BlockManager(hits_skip_last_block)``): that
  block's last row holds the next block's first token, which differs between the sequences
  sharing it.
- **Rows of accepted drafts are fed again.** They were computed from the drafter's own hidden
  states; once verified, the target's features exist for them (``SpeculativeConfig.refeeds_accepted``).
Drafts are the LM head's greedy ids over the draft vocabulary, mapped to the target's (``d2t``).
The embeddings are the target's unless the checkpoint has its own. A rope without scaling
extends to ``max_model_len`` (EAGLE-3 configs often state 2048 positions; rope itself has no
limit); a scaled one must reach as far.
"""

from __future__ import annotations

from typing import Any

import torch

from nvray.config import EngineConfig
from nvray.loader import checkpoint_tensor_names
from nvray.models.eagle3 import ARCHITECTURES, AuxCapture, aux_layer_ids
from nvray.step_protocol import SeqStep, StepInput
from nvray.worker.device_lists import copy_cache_blocks, to_device
from nvray.worker.drafter import Drafter
from nvray.worker.inputs import StepBatch


class Eagle3Drafter(Drafter):
    shift = 1

    def __init__(self, *args: Any, target: torch.nn.Module, **kwargs: Any) -> None:
        self.target = target
        super().__init__(*args, **kwargs)
        cfg = self.hf_config
        self.capture = self._make_capture()
        self.capture.attach(target)
        self.feature_width = self.capture.feature_width
        rows = max(self.config.max_num_batched_tokens, self.inputs.graph_capacity)
        self.model.hidden_in = torch.zeros(rows, cfg.hidden_size, dtype=self.dtype,
                                           device=self.device)
        self.features = torch.zeros(0, self.feature_width, dtype=self.dtype, device=self.device)
        self.carry: torch.Tensor | None = None  # the last pass's prenorm rows

    def _make_capture(self) -> Any:
        """The target's side, storing each computed slot's feature (``capture.cache``)."""
        return AuxCapture(aux_layer_ids(self.hf_config, self.target.cfg.num_hidden_layers),
                          self.target.cfg.hidden_size)

    def _check_reach(self, max_model_len: int) -> None:
        cfg = self.hf_config
        scaling = getattr(cfg, "rope_scaling", None) or {}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_model_len)
        super()._check_reach(max_model_len)

    def _build(self, path: str, config: EngineConfig) -> torch.nn.Module:
        cfg = self.hf_config
        archs = getattr(cfg, "architectures", None) or []
        if not set(archs) & set(ARCHITECTURES):
            raise ValueError(f"speculative_config method 'eagle3': model={self.spec.model!r} is "
                             f"{archs}, not an EAGLE-3 drafter ({' or '.join(ARCHITECTURES)})")
        width, target_cfg = getattr(cfg, "target_hidden_size", None) or cfg.hidden_size, self.target.cfg
        if width != target_cfg.hidden_size:
            raise ValueError(f"speculative_config model={self.spec.model!r}: an EAGLE-3 drafter "
                             f"for a target of hidden size {width}, this target's is "
                             f"{target_cfg.hidden_size}")
        aux_layer_ids(cfg, target_cfg.num_hidden_layers)  # refused by name before any weight
        names = checkpoint_tensor_names(path) if config.load_format != "dummy" else set()
        cfg.eagle_own_embeddings = bool(names & {"embed_tokens.weight",
                                                 "model.embed_tokens.weight"})
        if not cfg.eagle_own_embeddings and cfg.hidden_size != target_cfg.hidden_size:
            raise ValueError(f"speculative_config model={self.spec.model!r}: an EAGLE-3 drafter "
                             f"of hidden size {cfg.hidden_size} without embeddings of its own "
                             f"cannot share the target's ({target_cfg.hidden_size} wide)")
        model = super()._build(path, config)
        if model.embed_tokens is None:  # the target's, as the drafter was trained with
            model.embed_tokens = self.target.model.embed_tokens
        return model

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (2, self.hf_config.hidden_size)  # normed, prenorm

    # ----------------------------------------------------------------- memory
    @property
    def kv_block_bytes(self) -> int:
        """The draft cache's share of a block and the target's features of its slots."""
        return super().kv_block_bytes + self.block_size * self.feature_width * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft cache and a feature cache of ``num_blocks`` blocks and one more (slot -1:
        a CUDA graph's padding rows store there)."""
        super().allocate_kv_cache(num_blocks)
        self.features = self.capture.cache = torch.empty(0)  # free the old cache first
        rows = (num_blocks + 1) * self.block_size if num_blocks else 0
        self.features = torch.zeros(rows, self.feature_width, dtype=self.dtype, device=self.device)
        self.capture.cache = self.features

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        blocks = self.features.view(-1, self.block_size, self.feature_width)
        copy_cache_blocks([*self.kv_caches, blocks], copies, self.device)

    def release_graphs(self) -> None:
        self.carry = None  # a view of the graphs' memory
        super().release_graphs()

    def close(self) -> None:
        super().close()
        self.capture.detach(self.target)
        self.target = None  # type: ignore[assignment]

    # -------------------------------------------------------------------- step
    def run(self, step: StepInput) -> torch.Tensor | None:
        try:
            return super().run(step)
        finally:
            self.carry = None  # (a view of graph memory: held no longer than the step)

    def _fed(self, s: SeqStep) -> SeqStep:
        fed = super()._fed(s)
        skip = int(s.draft_start == 0)  # token 0 has no feature before it: no row
        return fed._replace(token_ids=fed.token_ids[skip:], start_pos=fed.start_pos - 1 + skip)

    def _set_inputs(self, batch: StepBatch, prev_rows: list[int] | None) -> None:
        """Each row's H-wide input: ``fc`` of the target's feature at its position (the feed),
        or the prenorm hidden state of the row it follows (a further draft's pass)."""
        hidden_in = self._hidden_rows(batch.positions.shape[0])
        if prev_rows is None:
            rows = batch.positions.shape[0]
            slots = (batch.meta.slot_mapping if batch.meta is not None
                     else self.inputs.static_views().slots[0][:rows])  # type: ignore[union-attr]
            hidden_in[:rows] = self.model.combine(self.features[slots.long()])
        else:
            assert self.carry is not None
            where = to_device(prev_rows, self.device)
            hidden_in[:len(prev_rows)] = self.carry.index_select(0, where)

    def _hidden_rows(self, rows: int) -> torch.Tensor:
        """``hidden_in``, grown to ``rows`` where an eager start-up step needs more (before any
        graph reads it: a step's feed stays within ``max_num_batched_tokens``)."""
        hidden_in = self.model.hidden_in
        if rows > hidden_in.shape[0]:
            assert self.graphs is None, "a graph reads hidden_in: it cannot move"
            hidden_in = torch.zeros(rows, hidden_in.shape[1], dtype=self.dtype,
                                    device=self.device)
            self.model.hidden_in = hidden_in
        return hidden_in

    def _greedy(self, rows: torch.Tensor) -> torch.Tensor | None:
        self.carry = rows[:, 1]  # read by the next pass before it runs (every rank)
        logits = self.model.compute_logits(rows[:, 0])
        return self.model.target_ids(logits.argmax(-1)) if logits is not None else None
