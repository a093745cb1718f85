"""Scheduler: continuous batching with chunked prefill under one token budget.

Each ``schedule()`` call builds one batch:
1. running sequences first (decodes and unfinished prefill chunks), each taking what it needs
   from the token budget; when KV blocks run out, the lowest-ranked running sequence is
   preempted by recompute (blocks freed, back to the waiting queue, re-prefilled later);
2. then, if nothing was preempted, waiting sequences in policy order (``fcfs``; ``sjf``:
   shortest first, but a request waiting longer than ``aging_s`` goes first, in arrival order,
   so none waits forever; ``priority``: lower value first), prefix-cache hits included, their
   prompt split into chunks when it exceeds the remaining budget.
A long prompt therefore never stalls running decodes.

Multi-LoRA (``lora_slots``: ``nvray/lora/slots.py``): a waiting sequence whose adapter has no
GPU slot, while every slot serves running sequences, waits (the sequences behind it may go); a
sequence holds its adapter's slot while it runs and gives it back when it finishes or is
preempted. A sequence whose adapter must be loaded while its files changed since they were
checked (rewritten or gone) is not admitted: it waits in ``take_stale_adapters()`` for the
engine to fail it, so no step loads files other than those checked.

With overlapped steps a running sequence whose last planned token is its ``max_tokens``-th is
not scheduled again: the step sampling that token is in flight, and its result finishes it;
nor is one that waits for its newest token (``Sequence.waits_for_tokens``) while it is pending.
A request for prompt log-probabilities skips the prefix cache (every position is computed).
A model with recurrent state (prefix caching on) ends a sequence's chunk at its state save point
(``BlockManager.state_save_point``): the state there is kept for later prompts.

Pipeline stages (``pipeline_depth`` P > 1: a step per stage in flight): a sequence whose
newest token is being sampled is never scheduled (the ids stay on the last stage, so there are
no placeholders), and each step takes at most its share of the sequences that could run,
ceil(min(max_num_seqs, running + waiting) / P), so that the P steps in flight split them
between them. Chunks of one prompt may be in consecutive steps: every stage runs steps in order.

Forks (a request's ``n`` choices): a waiting sequence ``fork_of`` another waits until that one
has launched all prompt tokens but the last, then takes those blocks (shared, ref counted) and
computes only the last prompt token itself; writes into a shared block copy it first
(``BlockManager``). If the source finished first, or its windowed layers gave back blocks the
fork needs, or (a model with recurrent state) the source computed past the shared prompt (its
state holds its own tokens then), the fork prefills on its own (from the source's kept state
where prefix caching keeps one: the fork waits while the source computes up to the shared
prompt, by which time the source's first chunk, cut at its save point, is cached).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from nvray.engine.block_manager import BlockManager
from nvray.engine.prefix_cache import NO_PREFIX
from nvray.engine.sequence import Sequence, SequenceStatus
from nvray.lora.adapter import weights_version
from nvray.lora.slots import LoRASlots


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num_new_tokens)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", enable_chunked_prefill: bool = True, aging_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, pipeline_depth: int = 1,
                 lora_slots: LoRASlots | None = None) -> None:
        assert policy in ("fcfs", "sjf", "priority"), f"unknown policy {policy}"
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.aging_s = aging_s
        self.clock = clock
        self.pipeline_depth = pipeline_depth
        self.lora_slots = lora_slots
        self.stale_adapters: list[Sequence] = []  # to fail: their adapter changed on disk
        self.step_seqs = max_num_seqs  # sequences one step may take (its share, pipelined)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (a beam forked from another) runs next."""
        self._start_running(seq)

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled is None:
            seq.first_scheduled = self.clock()
        self.running.append(seq)
        if seq.lora is not None:
            self.lora_slots.acquire(seq)  # type: ignore[union-attr]

    def _stop_running(self, seq: Sequence) -> None:
        """``seq`` left the running list: its blocks and adapter slot go back."""
        self.block_manager.free(seq)
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq)  # type: ignore[union-attr]

    def _admits_adapter(self, seq: Sequence) -> bool:
        lora, slots = seq.lora, self.lora_slots
        if lora is None:
            return True
        assert slots is not None, "a request with an adapter reached an engine without LoRA"
        if not slots.can_admit(lora):
            return False
        if not slots.is_resident(lora) and weights_version(lora.path) != lora.version:
            if seq not in self.stale_adapters:
                self.stale_adapters.append(seq)
            return False
        return True

    def take_stale_adapters(self) -> list[Sequence]:
        """Waiting sequences whose adapter's files changed since they were checked."""
        stale, self.stale_adapters = self.stale_adapters, []
        return stale

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its blocks (it leaves its queue)."""
        self.finish_many([seq], lambda _: reason)

    def finish_many(self, seqs: list[Sequence], reason_of: Callable[[Sequence], str]) -> None:
        """Finish sequences, running or waiting (one pass over the running list); a token still
        being sampled for one is dropped."""
        done = {s.seq_id for s in seqs if s.status is SequenceStatus.RUNNING}
        if done:
            self.running = [s for s in self.running if s.seq_id not in done]
        for seq in seqs:
            if seq.status is SequenceStatus.WAITING:  # not scheduled yet, or preempted
                self.waiting.remove(seq)
            self._stop_running(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason_of(seq)
            seq.num_pending = 0

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.pipeline_depth > 1:
            runnable = min(self.max_num_seqs, len(self.running) + len(self.waiting))
            self.step_seqs = max(1, -(-runnable // self.pipeline_depth))
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i, bm = 0, self.block_manager
        bs, groups = bm.block_size, bm.num_groups
        scheduled = out.scheduled
        pipelined = self.pipeline_depth > 1
        while i < len(self.running) and budget > 0 and len(scheduled) < self.step_seqs:
            seq = self.running[i]
            num_tokens = len(seq.token_ids) + seq.num_pending  # seq.num_tokens, inlined
            if seq.num_pending and (pipelined or seq.waits_for_tokens
                                    or num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens):
                i += 1  # its last token is being sampled, or its next needs it on the host
                continue
            num_new = min(num_tokens + len(seq.drafts) - seq.num_computed_tokens, budget)
            if seq.state_save_at > seq.num_computed_tokens:  # the chunk ends where it is kept
                num_new = min(num_new, seq.state_save_at - seq.num_computed_tokens)
            if num_new == 0:  # prefilled, nothing to generate (max_tokens=0): it finishes
                i += 1
                continue
            if (seq.num_computed_tokens + num_new > len(seq.block_table) // groups * bs  # new
                    or (seq.shares_blocks and bm.needs_blocks(seq, num_new))):  # blocks, a copy
                if bm.windowed:  # what its windows no longer read makes room first
                    bm.release_out_of_window(seq)
                if seq.drafts and not bm.can_append_slots(seq, num_new):
                    num_new -= len(seq.drafts[:num_new - 1])  # drafts never preempt anyone
                    seq.drafts = []
                if not self._make_room(seq, num_new, i, out):
                    continue  # seq itself was preempted; the next one moved into slot i
                self.block_manager.append_slots(seq, num_new)
            scheduled.append((seq, num_new))
            budget -= num_new
            i += 1
        return budget

    def _make_room(self, seq: Sequence, num_new: int, index: int, out: SchedulerOutput) -> bool:
        """Preempt lower-ranked running sequences until ``seq`` fits; False if ``seq`` went."""
        while not self.block_manager.can_append_slots(seq, num_new):
            candidates = self.running[index + 1:]
            victim = max(candidates, key=self._victim_key) if candidates else seq
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _victim_key(self, seq: Sequence) -> tuple[float, ...]:
        if self.policy == "priority":
            return (seq.priority, seq.arrival_time)
        return (seq.arrival_time,)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._stop_running(seq)
        seq.status = SequenceStatus.WAITING
        seq.drafts = []  # it computes its tokens again first
        seq.draft_len = seq.draft_feed = 0  # its blocks are gone: a hit's drafted ones count again
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        for seq in self._waiting_in_policy_order():
            if (budget <= 0 or len(self.running) >= self.max_num_seqs
                    or len(out.scheduled) >= self.step_seqs):
                break
            if seq.num_pending and self.pipeline_depth > 1:
                continue  # preempted while its token was sampled: it waits for that token
            if not self._admits_adapter(seq):
                continue  # every adapter slot serves running sequences
            if seq.fork_of is not None:
                forked = self._try_fork(seq, out, budget)
                if forked is None:
                    continue  # its fork source has not computed the shared prompt yet
                if forked:
                    budget -= out.scheduled[-1][1]
                    continue
                if seq.fork_of is not None:
                    break  # no room now
            # prompt log-probabilities need every prompt position computed
            cached = (NO_PREFIX if seq.params.prompt_logprobs is not None
                      else bm.find_cached_prefix(seq))
            start = cached.num_blocks * bm.block_size
            remaining = seq.num_tokens - start
            num_new = min(remaining, budget)
            if self.enable_chunked_prefill and (save := bm.state_save_point(
                    seq, start, cached.kv_cached_tokens)) > 0:
                num_new = min(num_new, save - start)  # the chunk ends where its state is kept
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            if not bm.can_allocate(cached, cached.num_blocks * bm.block_size + num_new):
                break
            self.waiting.remove(seq)
            bm.allocate_prefix(seq, cached)
            bm.append_slots(seq, num_new)
            self._start_running(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new

    def _try_fork(self, seq: Sequence, out: SchedulerOutput, budget: int) -> bool | None:
        """Schedule ``seq`` on its fork source's prompt blocks: True if done; None while the
        source has not launched the shared prompt tokens; False if the blocks aren't free (or
        the source finished: then ``fork_of`` is cleared and ``seq`` prefills on its own)."""
        source, bm = seq.fork_of, self.block_manager
        assert source is not None
        if source.status is SequenceStatus.FINISHED:
            seq.fork_of = None
            return False
        shared = seq.num_prompt_tokens - 1  # the last prompt token: each choice samples its own
        if source.status is SequenceStatus.WAITING or source.num_computed_tokens < shared:
            return None
        if bm.windowed and not bm.holds_prefix(source, shared):
            seq.fork_of = None  # its windows moved past the prompt's end: prefill on its own
            return False
        if bm.num_state_slots and source.num_computed_tokens != shared:
            seq.fork_of = None  # its recurrent state moved past the shared prompt: the same
            return False
        num_new = min(seq.num_tokens - shared, budget)
        if not bm.can_fork(shared, num_new):
            return False
        self.waiting.remove(seq)
        bm.fork(seq, source, shared)
        bm.append_slots(seq, num_new)
        seq.fork_of = None
        self._start_running(seq)
        out.scheduled.append((seq, num_new))
        return True

    def _waiting_in_policy_order(self) -> list[Sequence]:
        if self.policy == "fcfs":
            return list(self.waiting)
        if self.policy == "priority":
            return sorted(self.waiting, key=lambda s: (s.priority, s.arrival_time))
        now = self.clock()
        return sorted(self.waiting, key=lambda s: self._sjf_key(s, now))

    def _sjf_key(self, seq: Sequence, now: float) -> tuple[int, float, float]:
        aged = now - seq.arrival_time >= self.aging_s
        if aged:
            return (0, seq.arrival_time, 0.0)
        return (1, float(seq.num_tokens - seq.num_computed_tokens), seq.arrival_time)
