"""Speculative decoding: propose a few tokens cheaply, verify them in one forward pass.

``SpeculativeConfig`` is the engine's ``speculative_config`` (vLLM's names): ``method``
(``"ngram"``: prompt lookup on the host; ``"draft_model"``: a small model with the target's
vocabulary, ``model``, run on the target's ranks: ``nvray/worker/drafter.py``; ``"eagle3"``:
an EAGLE-3 head, ``model``, reading the target's hidden states on its ranks:
``nvray/worker/eagle_drafter.py``; ``"mtp"``: Qwen3.5's multi-token-prediction head from the
target's own checkpoint, reading its final hidden states: ``nvray/worker/mtp_drafter.py``; each
method is a plug-in class declaring where it runs and what it builds:
``nvray/speculative_methods.py``),
``num_speculative_tokens`` (k), ``prompt_lookup_min`` /
``prompt_lookup_max`` (the n-gram lengths tried, longest first), ``disable_by_batch_size``: no
drafts in a step while more sequences than this run (default 32: past that a verification
step's k + 1 rows a sequence cost more than good drafts save on an 8B model, and such steps
overlap as without speculation; docs/speculative.md has the figures); nvray's ``adaptive``
(default True):
each sequence drafts as many tokens as its drafts have lately earned
(``nvray/engine/speculation.py``).

How a step verifies (``nvray/engine``): a speculating sequence computes its newest token and its
drafts ``d1..dk`` in one step; the ranks sample a token at each of those k + 1 positions, exactly
as they would sample that position without speculation (the row of the j-th draft's position
uses the sequence's token index + j, so a seeded request meets the same noise). The engine keeps
the sampled tokens up to and including the first that differs from its draft
(``accepted_run``): every kept token was drawn from the target's distribution given the tokens
before it, so the output has exactly the distribution of decoding without speculation, and a
greedy or seeded request the very same tokens. With a deterministic proposer (n-gram) this
accepts draft ``d`` with probability p(d), what rejection sampling accepts it with; the draft
model proposes its greedy tokens, so the same holds for it.

``NgramProposer.propose``: the longest suffix of the sequence (``prompt_lookup_max`` tokens down
to ``prompt_lookup_min``) that occurred earlier in it; the drafts are the tokens that followed
its latest earlier occurrence, copied on into the drafts themselves where that occurrence is
within k of the end (a repeating stretch drafts its next period: ``a b a b`` drafts ``a b a b``
for k = 4, not just the ``a b`` the text holds).

What does not speculate (it decodes a token a step, in the same batch): sequences with bad
words, a ``min_tokens`` still to reach and beam searches. Models with recurrent layers
(Qwen3.5) hold each verified chunk's rows until the engine says how many it kept
(``nvray/worker/held_chunks.py``). With a drafter on the ranks, the ranks read its drafts back
for the penalties and grammar masks of the draft positions. Log-probabilities are the target's at each kept
token's position; penalties at a draft position count the drafts before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from nvray.speculative_methods import SPECULATIVE_METHODS, NgramProposer, SpeculativeMethod

__all__ = ["NgramProposer", "SpecCounters", "SpeculativeConfig", "accepted_run"]

_MAX_SPECULATIVE_TOKENS = 16


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config {name}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 32
    adaptive: bool = True  # each sequence's drafts follow its acceptance (engine/speculation.py)
    model: str | None = None  # draft_model: the drafter's checkpoint directory (or "tiny")

    @classmethod
    def of(cls, value: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the engine option (a dict of these fields, or None: no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        _require(isinstance(value, dict), "", value, "must be a dict of SpeculativeConfig's "
                 "fields (method, num_speculative_tokens, ...)")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        _require(not unknown, "keys", unknown, f"unknown (known: {', '.join(sorted(known))})")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        _require(self.method in SPECULATIVE_METHODS, "method", self.method,
                 f"must be one of {list(SPECULATIVE_METHODS)}")
        refusal = self.method_class.check_model(self.model)
        _require(refusal is None, "model", self.model, str(refusal))
        k = self.num_speculative_tokens
        _require(isinstance(k, int) and 1 <= k <= _MAX_SPECULATIVE_TOKENS,
                 "num_speculative_tokens", k, f"must be in [1, {_MAX_SPECULATIVE_TOKENS}]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _require(isinstance(lo, int) and lo >= 1, "prompt_lookup_min", lo, "must be >= 1")
        _require(isinstance(hi, int) and hi >= lo, "prompt_lookup_max", hi,
                 "must be >= prompt_lookup_min")
        _require(isinstance(self.adaptive, bool), "adaptive", self.adaptive, "must be a bool")
        batch = self.disable_by_batch_size
        _require(isinstance(batch, int) and batch >= 1, "disable_by_batch_size", batch,
                 "must be an int >= 1")

    @property
    def method_class(self) -> type[SpeculativeMethod]:
        """The method's plug-in (``nvray/speculative_methods.py``): what it declares and builds."""
        return SPECULATIVE_METHODS[self.method]

    @property
    def drafts_on_ranks(self) -> bool:
        """Whether the ranks propose the drafts (a model), not the engine's host."""
        return self.method_class.on_ranks

    @property
    def drafter_rows_lag(self) -> bool:
        """Whether the drafter's row at a position holds the next token (EAGLE-3, MTP): a
        block's last row then depends on the block after it."""
        return self.method_class.rows_lag

    @property
    def refeeds_accepted(self) -> bool:
        """Whether the drafter's rows of accepted drafts are fed again once verified (EAGLE-3,
        MTP: they were computed from its own hidden states, the target's features now
        exist)."""
        return self.method_class.refeeds_accepted

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def accepted_run(drafts: list[int] | tuple[int, ...], sampled: list[int]) -> list[int]:
    """The tokens a verified step emits: ``sampled`` (one per position, ``len(drafts) + 1``) up
    to and including the first that is not its position's draft."""
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return sampled[:i + 1]
    return sampled[:len(drafts) + 1]


class SpecCounters:
    """What speculation did, for ``stats()`` and ``/metrics`` (vLLM's counter meanings):
    ``num_drafts`` verified runs, ``num_draft_tokens`` tokens proposed, ``num_accepted_tokens``
    drafts kept, ``accepted_per_position`` how often the i-th draft was kept."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k

    def count(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def stats(self) -> dict[str, Any]:
        drafts, proposed, accepted = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {"num_drafts": drafts, "num_draft_tokens": proposed,
                "num_accepted_tokens": accepted,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate": accepted / proposed if proposed else 0.0,
                # tokens a verified run emits: the accepted drafts and the one sampled after
                "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}
