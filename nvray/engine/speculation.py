"""The engine's side of speculative decoding (``nvray/speculative.py`` says how a step verifies).

``Speculator.propose`` runs before each schedule: every running sequence that is decoding (its
prompt computed, no token being sampled) and may speculate gets up to k drafts in
``Sequence.drafts``, which the scheduler adds to its tokens for the step and the step builder
sends after its newest token. With overlapped steps, ``may_draft`` tells the engine whether the
next step may carry drafts: if so it runs with nothing in flight, else it overlaps and carries
none. ``Speculator.emitted`` turns a verified step's sampled ids into the
tokens the sequence keeps and counts them.

A sequence may speculate unless its tokens depend on more than the target's distribution at
each position given the tokens before it, as the ranks sample it: bad words, ``min_tokens``
not yet reached; beam search opts out. A grammar's sequence speculates too: rank 0 masks each
draft position for the drafts before it (``nvray/worker/grammar_masks.py``). Drafts never run past ``max_tokens`` or
``max_model_len``. A request with ``speculate=False`` opts out. Log-probabilities are the
target's: the ranks compute them at every verified position, and a kept token takes its
position's. Penalties at a draft position count the drafts before it as output (a token kept
there follows them: ``step_protocol.sample_specs``).

With a draft model (``SpeculativeConfig.drafts_on_ranks``) the engine decides how many drafts
each sequence gets, not what they are: ``Sequence.drafts`` holds that many ``MODEL_DRAFT``
marks, the step builder sends them as placeholders the ranks' drafter fills
(``nvray/step_protocol.py``), and the step's answer says what they were. The draft model's
cache is fed only in steps where a sequence drafts, with what it lacks of that sequence
(``Sequence.draft_len``: its tokens before that are in the draft cache; a prefix hit's blocks
whose draft rows an earlier sequence fed count, ``BlockManager.mark_drafted``; after a
preemption, those of its hit again): steps without drafts (large batches, pauses, overlapped
steps) cost the draft model nothing, and a sequence that drafts again first feeds the tokens it
missed (its prompt past those blocks the first time), up to ``feed_budget`` tokens a step. A
draft position's penalties and grammar mask follow the drafts before it: the ranks read the
drafts back for them (``step_protocol.sample_specs``, ``nvray/worker/grammar_masks.py``).

With ``adaptive`` (the default), a sequence's ``DraftPace`` sets how many drafts it proposes:
the runs it verifies cost a forward pass over every draft, so a sequence whose drafts fail
proposes fewer and, failing on, pauses; one whose drafts hold proposes up to k.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence as Sequence_

from nvray.engine.prefix_cache import CachedPrefix
from nvray.engine.sequence import SeqPlan, Sequence
from nvray.speculative import SpecCounters, SpeculativeConfig, accepted_run


_MAX_PAUSE = 32  # steps a sequence whose drafts keep failing waits before it drafts again
MODEL_DRAFT = -1  # a draft the ranks' drafter proposes (see the module docstring)


class DraftPace:
    """How many drafts a sequence proposes next (``adaptive``): one more than its last run
    accepted (k after a run accepted whole); after a run that accepted none, one draft, and
    none at all for 2, 4, ... up to ``_MAX_PAUSE`` steps while such runs follow each other."""

    __slots__ = ("budget", "misses", "pause")

    def __init__(self, k: int) -> None:
        self.budget, self.misses, self.pause = k, 0, 0

    def allowed(self) -> int:
        if self.pause:
            self.pause -= 1
            return 0
        return self.budget

    def after(self, drafted: int, accepted: int, k: int) -> None:
        if accepted == 0:
            self.budget, self.misses = 1, self.misses + 1
            self.pause = min(1 << self.misses, _MAX_PAUSE)
            return
        self.misses = 0
        self.budget = min(k, self.budget + 1) if accepted == drafted else accepted + 1


class DraftMarks:
    """Which KV blocks' rows the draft cache holds, so a prefix hit on them need not feed the
    drafter those tokens again: a block is marked when a sequence's draft rows cover it, with
    the token after it (a head's last row is fed that token), and keeps the mark until the pool
    reuses it (``BlockPool.on_reuse`` is ``clear``). Only for tables of one group (drafters run
    beside targets without windowed layers)."""

    def __init__(self, num_blocks: int, block_size: int, num_groups: int,
                 rows_lag: bool) -> None:
        self.drafted = [False] * num_blocks
        self.next_token = [-1] * num_blocks  # the token after a block when its rows were fed
        self.block_size, self.num_groups, self.rows_lag = block_size, num_groups, rows_lag

    def clear(self, block_id: int) -> None:
        self.drafted[block_id] = False

    def mark(self, seq: Sequence) -> None:
        """After a step: mark the blocks of ``seq`` wholly before position ``draft_len - 1`` (a
        head's row at p is token p + 1's, so the row at ``draft_len - 1`` waits for the next
        feed; a draft model's rows are one ahead of that)."""
        if self.num_groups != 1:
            return
        bs, drafted = self.block_size, self.drafted
        for i in range(max(seq.draft_len - 1, 0) // bs - 1, -1, -1):
            block_id = seq.block_table[i]
            if drafted[block_id]:  # marked up to here by an earlier step (or another sequence)
                return
            drafted[block_id], self.next_token[block_id] = True, seq.token_ids[(i + 1) * bs]

    def drafted_tokens(self, seq: Sequence, cached: CachedPrefix) -> int:
        """How much of a cached prefix the draft cache holds for ``seq``: its leading marked
        blocks. A head's rows lag (``rows_lag``): a block's last row was fed the token after
        it, so a block counts only where that token is ``seq``'s too, and a marked block whose
        last row ``seq`` will feed again from another token loses its mark (the prefix's hash
        may lead to a block another sequence continued differently)."""
        if self.num_groups != 1:
            return 0
        bs, count, drafted = self.block_size, None, self.drafted
        for i, block_id in enumerate(cached.blocks):
            if self.rows_lag and self.next_token[block_id] != seq.token_ids[(i + 1) * bs]:
                drafted[block_id] = False
            if count is None and not drafted[block_id]:
                count = i
        return (len(cached.blocks) if count is None else count) * bs


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 feed_budget: int = 1 << 30) -> None:
        """``feed_budget``: most tokens a step feeds the draft model (``max_num_batched_tokens``:
        what the start-up's memory profile covers)."""
        self.config = config
        self.feed_budget = feed_budget
        self.k = config.num_speculative_tokens
        self.proposer = config.method_class.host_proposer(config)  # None: drafts on the ranks
        self.on_ranks = config.drafts_on_ranks
        self.max_model_len = max_model_len
        self.counters = SpecCounters(self.k)

    def may_draft(self, running: Sequence_[Sequence], plans: dict[int, SeqPlan]) -> bool:
        """Whether the next schedule may propose drafts: at most ``disable_by_batch_size``
        sequences run and one of them decodes, may speculate and is not pausing. (Then the
        engine runs the step with nothing in flight, so the drafts follow its newest tokens.)"""
        if not running or len(running) > self.config.disable_by_batch_size:
            return False
        return any(seq.num_computed_tokens >= seq.num_prompt_tokens
                   and self._may_speculate(seq, plans[seq.seq_id])
                   and not (self.config.adaptive and seq.draft_pace is not None
                            and seq.draft_pace.pause)
                   for seq in running)

    def propose(self, running: Sequence_[Sequence], plans: dict[int, SeqPlan],
                draft: bool = True) -> None:
        """Set each running sequence's drafts for the next schedule (none where it may not,
        none at all while more than ``disable_by_batch_size`` sequences run, and none with
        ``draft`` False: a step the engine overlaps; adaptive pauses count down all the same)."""
        if len(running) > self.config.disable_by_batch_size:
            for seq in running:
                seq.drafts = []
                seq.draft_feed = 0
            return
        for seq in running:
            seq.drafts = self._drafts(seq, plans[seq.seq_id], draft)
        if self.on_ranks:
            self._feed(running)

    def _feed(self, running: Sequence_[Sequence]) -> None:
        """What each drafting sequence feeds the draft model: the tokens its cache lacks up to
        the newest, within ``feed_budget`` a step. Sequences whose feed fits go first; a
        sequence that does not fit feeds a part of what it lacks from what is left, drafting
        nothing this step, and drafts once it has caught up."""
        budget, behind = self.feed_budget, []
        for seq in running:
            seq.draft_feed = 0
            if not seq.drafts:
                continue
            need = len(seq.token_ids) - seq.draft_len  # through its newest token
            if need > budget:
                seq.drafts = []
                behind.append(seq)
            else:
                seq.draft_feed = need
                budget -= need
        for seq in behind:
            seq.draft_feed = min(len(seq.token_ids) - seq.draft_len, budget)
            budget -= seq.draft_feed

    def _drafts(self, seq: Sequence, plan: SeqPlan, draft: bool) -> list[int]:
        num_tokens = len(seq.token_ids)
        if seq.num_computed_tokens < seq.num_prompt_tokens or not self._may_speculate(seq, plan):
            return []
        allowed = self._pace(seq).allowed() if self.config.adaptive else self.k  # pauses count
        if not draft or seq.num_pending or seq.num_computed_tokens != num_tokens - 1:
            return []  # an overlapped step, or its newest token is still being sampled
        params, num_output = seq.params, num_tokens - seq.num_prompt_tokens
        # the verified run emits up to k + 1 tokens: within max_tokens and max_model_len
        room = min(allowed, self.max_model_len - num_tokens - 1)
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - num_output - 1)
        if room <= 0:
            return []
        if self.proposer is None:  # the ranks' drafter proposes them
            return [MODEL_DRAFT] * room
        return self.proposer.propose(seq.token_ids, room)

    def _may_speculate(self, seq: Sequence, plan: SeqPlan) -> bool:
        """Whether this sequence's request allows drafts now (see the module docstring)."""
        params = seq.params
        return (params.speculate and not plan.bad_words
                and len(seq.token_ids) - seq.num_prompt_tokens >= plan.min_tokens)

    def _pace(self, seq: Sequence) -> DraftPace:
        if seq.draft_pace is None:
            seq.draft_pace = DraftPace(self.k)
        return seq.draft_pace

    def emitted(self, seq: Sequence, drafts: tuple[int, ...], sampled: list[int]) -> list[int]:
        """The tokens a verified run of ``seq`` keeps (``sampled``: one id per position),
        counted, and its pace adjusted."""
        tokens = accepted_run(drafts, sampled)
        self.counters.count(len(drafts), len(tokens) - 1)
        if self.config.adaptive:
            self._pace(seq).after(len(drafts), len(tokens) - 1, self.k)
        return tokens

    def stats(self) -> dict[str, Any]:
        return {**self.config.describe(), **self.counters.stats()}
