"""MtpDrafter: Qwen3.5's MTP head as the drafter (``speculative_config`` method ``mtp``) on the
target's ranks; the network is ``nvray/models/qwen3_5_mtp.py``, its weights the target
checkpoint's ``mtp.*`` tensors.

It is the EAGLE-3 drafter's machinery (``eagle_drafter.py``: token p's row at position p - 1,
a feature cache beside its paged KV cache, accepted drafts fed again from the target's
features, a prefix hit's last block left out) with the head's differences: the feature of a
position is the target's final hidden state there (``FinalCapture``, H wide), a further draft's
row reads the head's own normed output (what it proposed from), and the drafts are the
target's LM head's greedy ids over the full vocabulary. The head's layer is TP-sharded as the
target's full-attention layers are; ``fc`` is replicated; the embeddings and LM head are the
target's own modules.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from nvray.config import EngineConfig
from nvray.loader import checkpoint_tensor_names
from nvray.models.qwen3_5_mtp import ARCHITECTURE, PREFIX, FinalCapture, mtp_layers
from nvray.worker.drafter import Drafter
from nvray.worker.eagle_drafter import Eagle3Drafter


class MtpDrafter(Eagle3Drafter):
    def _load_config(self, path: str) -> Any:
        """The target's own config (its ``hf_overrides`` too: a scaled rope reaches the head),
        naming the head's architecture."""
        cfg = copy.copy(self.target.cfg)
        cfg.mtp_target_architectures = getattr(cfg, "architectures", None) or []
        cfg.architectures = [ARCHITECTURE]
        return cfg

    def _make_capture(self) -> Any:
        return FinalCapture(self.target.cfg.hidden_size)

    def _check_reach(self, max_model_len: int) -> None:
        Drafter._check_reach(self, max_model_len)  # the target's positions: its own reach

    def _build(self, path: str, config: EngineConfig) -> torch.nn.Module:
        archs = self.hf_config.mtp_target_architectures
        if not any(a.startswith("Qwen3_5") for a in archs) or not mtp_layers(self.hf_config):
            raise ValueError(f"speculative_config method 'mtp' needs a model with an MTP head "
                             f"(Qwen3.5: mtp_num_hidden_layers in its config); {archs} has none")
        if config.load_format != "dummy" and not any(
                n.startswith(PREFIX) for n in checkpoint_tensor_names(path)):
            raise ValueError(f"speculative_config method 'mtp': {path} has no {PREFIX}* "
                             "tensors (a checkpoint saved without its MTP head)")
        model = super(Eagle3Drafter, self)._build(path, config)
        model.embed_tokens = self.target.model.embed_tokens
        model.logits_of = self.target.compute_logits
        return model

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.hf_config.hidden_size,)

    def _greedy(self, rows: torch.Tensor) -> torch.Tensor | None:
        self.carry = rows  # read by the next pass before it runs (every rank)
        logits = self.model.compute_logits(rows)
        return logits.argmax(-1) if logits is not None else None
