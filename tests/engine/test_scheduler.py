"""Scheduler: mixed batches under a token budget, policy order, SJF aging, preemption."""

from __future__ import annotations

from nvray.engine.block_manager import BlockManager
from nvray.engine.scheduler import Scheduler
from nvray.engine.sequence import Sequence, SequenceStatus
from nvray.sampling_params import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 64, block_size: int = 4, **kwargs) -> Scheduler:
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_num_batched_tokens", 64)
    return Scheduler(BlockManager(num_blocks, block_size), **kwargs)


def add(sched: Scheduler, n_tokens: int, name: str, arrival: float = 0.0, priority: int = 0) -> Sequence:
    seq = Sequence(name, list(range(100, 100 + n_tokens)), SamplingParams(), arrival, priority)
    sched.add(seq)
    return seq


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    """One schedule + the bookkeeping the engine does (a sampled token when a seq is caught up)."""
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(7)
    return [(seq.request_id, n) for seq, n in out.scheduled]


def test_long_prompt_is_chunked_and_never_stalls_running_decodes():
    sched = make(max_num_batched_tokens=8)
    add(sched, 3, "short")
    assert run_step(sched) == [("short", 3)]
    add(sched, 30, "long")
    for _ in range(3):
        batch = run_step(sched)
        assert batch[0] == ("short", 1)  # the decode always runs
        assert batch[1] == ("long", 7)  # the prompt takes the rest of the budget


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    add(sched, 3, "short")
    run_step(sched)
    add(sched, 8, "fits-next-step")
    assert run_step(sched) == [("short", 1)]  # 1 + 8 > 8: the prompt is not split


def test_fcfs_admits_in_arrival_order():
    sched = make(max_num_seqs=1, clock=FakeClock())  # no request aged: SJF would take r1
    for i, n in enumerate([30, 5, 10]):
        add(sched, n, f"r{i}", arrival=i)
    assert run_step(sched)[0][0] == "r0"


def test_sjf_admits_shortest_first():
    sched = make(max_num_seqs=3, max_num_batched_tokens=100, policy="sjf", clock=FakeClock())
    for i, n in enumerate([30, 5, 10]):
        add(sched, n, f"r{i}", arrival=0)
    assert [name for name, _ in run_step(sched)] == ["r1", "r2", "r0"]


def test_sjf_aging_lets_a_long_request_through():
    clock = FakeClock()
    sched = make(max_num_seqs=1, policy="sjf", aging_s=5.0, clock=clock)
    add(sched, 40, "long", arrival=3.0)
    first = None
    for t in range(4, 20):  # a stream of short requests keeps arriving
        clock.now = float(t)
        add(sched, 2, f"short{t}", arrival=clock.now)
        out = sched.schedule()
        admitted = [s for s, _ in out.scheduled if s.request_id == "long"]
        for seq, _ in out.scheduled:  # finish whatever ran so the next one can be admitted
            sched.finish(seq, "stop")
        if admitted:
            first = t
            break
    assert first == 3 + 5  # waited exactly its aging time, then went ahead of shorter ones


def test_priority_admits_lower_value_first():
    sched = make(max_num_seqs=1, policy="priority")
    add(sched, 5, "low", arrival=0, priority=5)
    add(sched, 5, "high", arrival=1, priority=-1)
    assert run_step(sched)[0][0] == "high"


def test_preemption_by_recompute_when_blocks_run_out():
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = add(sched, 7, "a", arrival=0)  # 2 blocks
    b = add(sched, 7, "b", arrival=1)  # 2 blocks
    run_step(sched)  # both prefilled; each now has 8 tokens, 7 computed
    run_step(sched)  # decodes: token 8 fits in the 2nd block; 9 tokens now
    out = sched.schedule()  # a needs a 3rd block: b (newest) is preempted
    assert [s.request_id for s, _ in out.scheduled] == ["a"]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.waiting[0] is b
    assert sched.block_manager.num_free_blocks == 4 - len(a.block_table)
    assert b.num_preemptions == 1 and sched.num_preemptions == 1 and a.num_preemptions == 0


def three_running(policy: str, priorities: tuple[int, int, int]
                  ) -> tuple[Scheduler, list[Sequence]]:
    """Three 7-token prompts (2 blocks each of 6) prefilled and decoded once: 9 tokens each,
    the next decode needs a 3rd block. Returned in arrival order."""
    sched = make(num_blocks=6, block_size=4, policy=policy)
    seqs = [add(sched, 7, name, arrival=float(i), priority=p)
            for i, (name, p) in enumerate(zip("abc", priorities))]
    run_step(sched)
    run_step(sched)
    assert all(s.num_tokens == 9 for s in seqs) and sched.block_manager.num_free_blocks == 0
    return sched, seqs


def test_preemption_takes_the_newest_running_sequence():
    sched, (a, b, c) = three_running("fcfs", (0, 0, 0))
    out = sched.schedule()
    assert out.preempted == [c]
    assert [s.request_id for s, _ in out.scheduled] == ["a", "b"]


def test_preemption_under_priority_takes_the_lowest_priority_first():
    sched, (a, b, c) = three_running("priority", (0, 5, 1))  # b ranks last, though not newest
    out = sched.schedule()
    assert out.preempted == [b]
    assert sorted(s.request_id for s, _ in out.scheduled) == ["a", "c"]


def test_a_preempted_sequence_goes_ahead_of_those_already_waiting():
    sched = make(num_blocks=4, block_size=4, max_num_seqs=2)
    a = add(sched, 7, "a", arrival=0)
    b = add(sched, 7, "b", arrival=1)
    waiter = add(sched, 3, "waiter", arrival=2)  # no seat: max_num_seqs=2
    run_step(sched)
    run_step(sched)
    out = sched.schedule()  # a needs a 3rd block: b is preempted
    assert out.preempted == [b]
    assert list(sched.waiting) == [b, waiter]
    sched.finish(a, "stop")
    assert [name for name, _ in run_step(sched)] == ["b", "waiter"]


def test_finished_sequences_release_all_blocks():
    sched = make(num_blocks=16)
    assert not sched.has_unfinished() and sched.num_preemptions == 0
    seqs = [add(sched, 6, f"r{i}") for i in range(3)]
    assert sched.has_unfinished()  # waiting only
    run_step(sched)
    assert sched.has_unfinished() and not sched.waiting  # running only
    sched.finish_many(seqs, lambda s: "stop")
    assert sched.block_manager.num_free_blocks == 16 and not sched.has_unfinished()
    assert all(s.finish_reason == "stop" and s.is_finished for s in seqs)


def test_finish_ends_one_sequence_waiting_or_running_with_its_reason():
    sched = make(num_blocks=16, max_num_seqs=1)
    running, waiting = add(sched, 3, "running"), add(sched, 3, "waiting")
    run_step(sched)
    sched.finish(waiting, "abort")
    sched.finish(running, "length")
    assert (waiting.finish_reason, running.finish_reason) == ("abort", "length")
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 16


def test_a_sequence_preempted_twice_counts_both():
    """The engine tells a preempted sequence's stale results by its preemption count."""
    sched = make(num_blocks=3, block_size=4, policy="priority")
    a, b = add(sched, 7, "a", arrival=0), add(sched, 3, "b", arrival=1)
    run_step(sched)
    run_step(sched)
    assert sched.schedule().preempted == [b]  # a needs a 3rd block
    sched.finish(a, "stop")
    c = add(sched, 3, "c", arrival=2, priority=-1)  # admitted first, so b runs behind it
    assert [name for name, _ in run_step(sched)] == ["c", "b"]
    run_step(sched)
    assert sched.schedule().preempted == [b]  # c needs a 2nd block
    assert b.num_preemptions == 2 and sched.num_preemptions == 2 and c.num_preemptions == 0


def add_fork(sched: Scheduler, source: Sequence, name: str, **kwargs) -> Sequence:
    """A choice of ``source``'s request: the same prompt, forked from it."""
    seq = Sequence(name, source.prompt_token_ids, SamplingParams(), **kwargs)
    seq.fork_of = source
    sched.add(seq)
    return seq


def test_a_fork_waits_for_its_source_then_shares_the_full_prompt_blocks():
    sched = make(num_blocks=8, block_size=4)
    source = add(sched, 9, "source")  # 2 full prompt blocks, then the last prompt token
    fork = add_fork(sched, source, "fork")
    assert run_step(sched) == [("source", 9)]  # the fork waits: nothing computed to share yet
    assert run_step(sched) == [("source", 1), ("fork", 1)]  # only its last prompt token
    bm = sched.block_manager
    assert fork.block_table[:2] == source.block_table[:2]
    assert all(bm.pool.blocks[b].ref_count == 2 for b in source.block_table[:2])
    assert fork.block_table[2] not in source.block_table and fork.num_cached_tokens == 8
    assert bm.take_copies() == []  # full blocks are shared, never written again
    assert bm.num_free_blocks == 8 - 4


def test_a_fork_copies_the_shared_block_it_writes_into():
    sched = make(num_blocks=8, block_size=4)
    source = add(sched, 7, "source")  # its 2nd block holds prompt tokens 4..6
    fork = add_fork(sched, source, "fork")
    run_step(sched)
    assert run_step(sched) == [("source", 1), ("fork", 1)]
    bm = sched.block_manager
    assert fork.block_table[0] == source.block_table[0]
    assert bm.pool.blocks[source.block_table[0]].ref_count == 2
    assert fork.block_table[1] != source.block_table[1]
    assert bm.pool.blocks[source.block_table[1]].ref_count == 1
    assert bm.take_copies() == [(source.block_table[1], fork.block_table[1])]
    assert bm.take_copies() == [] and bm.num_copied_blocks == 1
    assert fork.ranks_table_len == 0  # the ranks get the fork's whole table


def test_a_fork_whose_source_finished_prefills_on_its_own():
    sched = make(num_blocks=8, block_size=4)
    source = add(sched, 6, "source")
    fork = add_fork(sched, source, "fork")
    run_step(sched)
    sched.finish(source, "stop")
    assert run_step(sched) == [("fork", 6)]
    assert fork.fork_of is None and fork.num_cached_tokens == 0


def test_a_fork_without_room_waits_and_so_do_those_behind_it():
    sched = make(num_blocks=4, block_size=4)
    source = add(sched, 13, "source")  # 4 blocks: the cache is full
    fork = add_fork(sched, source, "fork")
    behind = add(sched, 2, "behind", arrival=1.0)
    run_step(sched)
    assert run_step(sched) == [("source", 1)]  # no free block for the fork's own
    assert list(sched.waiting) == [fork, behind] and fork.fork_of is source


def test_a_fork_ahead_of_its_waiting_source_lets_the_others_through():
    sched = make(num_blocks=16, block_size=4, policy="priority")
    source = add(sched, 6, "source", priority=1)
    fork = add_fork(sched, source, "fork", priority=0)  # ranked first, but nothing to share
    other = add(sched, 3, "other", priority=2)
    assert run_step(sched) == [("source", 6), ("other", 3)]
    assert list(sched.waiting) == [fork]


def test_running_sequences_whose_next_token_is_pending_are_skipped_when_they_must_wait():
    sched = make(num_blocks=16, block_size=4)
    waits, last, free = (add(sched, 4, name, arrival=float(i))
                         for i, name in enumerate(["waits", "last", "free"]))
    last.params = SamplingParams(max_tokens=1)
    run_step(sched)
    for seq in (waits, last, free):  # overlapped: each one's sampled token is still on the device
        seq.token_ids.pop()
        seq.num_pending = 1
    waits.waits_for_tokens = True  # its next step needs that token on the host
    assert run_step(sched) == [("free", 1)]  # last's pending token is its max_tokens-th


def test_a_prefilled_sequence_with_nothing_to_generate_is_not_scheduled():
    sched = make(num_blocks=16, block_size=4)
    done = Sequence("done", [1, 2, 3], SamplingParams(max_tokens=0))
    sched.add(done)
    other = add(sched, 2, "other")
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("done", 3), ("other", 2)]
    done.num_computed_tokens = 3
    other.num_computed_tokens = 2
    other.append_token(7)
    assert [(s.request_id, n) for s, n in sched.schedule().scheduled] == [("other", 1)]


def test_a_fork_starts_once_its_source_computed_all_but_the_last_prompt_token():
    sched = make(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    source = add(sched, 9, "source")
    fork = add_fork(sched, source, "fork")
    assert run_step(sched) == [("source", 8)]  # a chunk: the 8 tokens the fork shares
    assert run_step(sched) == [("source", 1), ("fork", 1)]
    assert run_step(sched) == [("source", 1), ("fork", 1)]  # both decode from here on
    sched.finish(fork, "stop")
    assert sched.running == [source] and fork.is_finished


def test_a_preempted_fork_prefills_again_on_its_own():
    sched = make(num_blocks=4, block_size=4)
    source = add(sched, 5, "source")  # 2 blocks
    fork = add_fork(sched, source, "fork")
    run_step(sched)
    run_step(sched)  # the fork shares block 0 and takes its own second block
    assert sched.block_manager.num_free_blocks == 1
    for _ in range(3):  # the source decodes into its 2nd block
        run_step(sched)
    out = sched.schedule()  # both need a 3rd block: one is free, the fork is preempted
    assert out.preempted == [fork]
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
    sched.finish(source, "stop")
    num_tokens = fork.num_tokens
    assert run_step(sched) == [("fork", num_tokens)] and fork.fork_of is None


def test_a_fork_without_room_while_its_source_waits_for_its_token_schedules_nothing():
    sched = make(num_blocks=4, block_size=4)
    source = add(sched, 13, "source")  # 4 blocks: the cache is full
    fork = add_fork(sched, source, "fork")
    run_step(sched)
    source.token_ids.pop()  # overlapped: the sampled token is still on the device, and the
    source.num_pending = 1  # source's next step needs it on the host
    source.waits_for_tokens = True
    out = sched.schedule()
    assert out.scheduled == [] and list(sched.waiting) == [fork] and fork.fork_of is source


def test_a_pending_token_holds_back_only_its_own_sequence():
    """Overlapped decodes: the sequence whose next step needs its pending token on the host is
    skipped; the one right behind it, with outputs still to make, decodes in this step."""
    sched = make(num_blocks=16, block_size=4)
    waits, free = (add(sched, 4, name, arrival=float(i)) for i, name in enumerate(["waits", "free"]))
    free.params = SamplingParams(max_tokens=8)  # its pending token is the 1st of 8
    run_step(sched)
    for seq in (waits, free):  # overlapped: each one's sampled token is still on the device
        seq.token_ids.pop()
        seq.num_pending = 1
    waits.waits_for_tokens = True
    assert run_step(sched) == [("free", 1)]


def test_a_prefilled_sequence_with_nothing_to_generate_is_skipped_behind_others():
    sched = make(num_blocks=16, block_size=4)
    first, second = add(sched, 2, "first"), add(sched, 2, "second", arrival=1.0)
    done = Sequence("done", [1, 2, 3], SamplingParams(max_tokens=0), 2.0)
    sched.add(done)
    for seq, n in sched.schedule().scheduled:  # all three prefill; only two sample a token
        seq.num_computed_tokens += n
    first.append_token(7)
    second.append_token(7)
    assert [(s.request_id, n) for s, n in sched.schedule().scheduled] == [("first", 1),
                                                                         ("second", 1)]


def test_a_prompt_takes_what_the_budget_leaves_down_to_one_token_and_none_of_nothing():
    sched = make(max_num_batched_tokens=9)
    for name in ("a", "b", "c"):
        add(sched, 8, name)
    assert run_step(sched) == [("a", 8), ("b", 1)]  # chunked: b starts with the last token
    assert run_step(sched) == [("a", 1), ("b", 7), ("c", 1)]
    sched = make(max_num_batched_tokens=8)
    first, second = add(sched, 8, "first"), add(sched, 8, "second")
    assert run_step(sched) == [("first", 8)]  # nothing left: the second is not scheduled
    assert list(sched.waiting) == [second] and second.block_table == []


def test_a_fork_takes_its_tokens_from_the_budget_and_the_next_prompt_gets_the_rest():
    sched = make(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    source = add(sched, 9, "source")
    add_fork(sched, source, "fork")
    assert run_step(sched) == [("source", 8)]
    add(sched, 10, "other", arrival=1.0)
    assert run_step(sched) == [("source", 1), ("fork", 1), ("other", 6)]


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt_despite_a_cached_prefix():
    """Prompt log-probabilities need every prompt position computed: no prefix-cache hit."""
    sched = make(num_blocks=16, block_size=4)
    first = add(sched, 9, "first")
    run_step(sched)
    sched.block_manager.cache_full_blocks(first)  # its 2 full prompt blocks
    prompt = first.prompt_token_ids
    sched.add(Sequence("plain", prompt, SamplingParams(), 1.0))
    sched.add(Sequence("scored", prompt, SamplingParams(prompt_logprobs=0), 2.0))
    assert run_step(sched) == [("first", 1), ("plain", 1), ("scored", 9)]


def launch(sched: Scheduler) -> list[tuple[str, int]]:
    """One schedule as a pipelined engine launches it: a sequence caught up has its token
    sampled on the last stage, pending until that step's ids come back (``land``)."""
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.num_pending = 1
    return [(seq.request_id, n) for seq, n in out.scheduled]


def land(seqs: list[Sequence]) -> None:
    for seq in seqs:
        seq.num_pending = 0
        seq.append_token(7)


def test_pipelined_steps_split_the_sequences_and_skip_those_in_flight():
    """Two stages: each step takes half of what can run, never a sequence whose token is being
    sampled; a prompt's chunks may follow each other in consecutive steps."""
    sched = make(num_blocks=64, block_size=4, max_num_batched_tokens=16, pipeline_depth=2)
    seqs = [add(sched, 4, name, arrival=float(i)) for i, name in enumerate("abcd")]
    first = launch(sched)
    second = launch(sched)
    assert first == [("a", 4), ("b", 4)] and second == [("c", 4), ("d", 4)]
    assert launch(sched) == []  # every sequence waits for its token
    land(seqs[:2])  # the first step's ids came back
    assert launch(sched) == [("a", 1), ("b", 1)]
    long = add(sched, 40, "long", arrival=9.0)
    land(seqs[2:])
    assert launch(sched) == [("c", 1), ("d", 1), ("long", 14)]  # its share: ceil(5 / 2) = 3
    land(seqs[:2])
    assert launch(sched) == [("a", 1), ("b", 1), ("long", 14)]  # the next chunk, in flight
    assert long.num_computed_tokens == 28 and long.num_pending == 0


def test_drafts_that_do_not_fit_are_dropped_instead_of_preempting():
    """Speculation: a's drafts would need a 3rd block, which only b's preemption frees; the
    drafts go, a decodes its one token, b keeps running."""
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = add(sched, 6, "a", arrival=0)  # 2 blocks
    b = add(sched, 6, "b", arrival=1)  # 2 blocks
    run_step(sched)  # prefilled: 7 tokens each, 6 computed; token 7 fits in block 2
    a.drafts = [1, 2, 3]  # positions 7..9: a 3rd block
    out = sched.schedule()
    assert out.preempted == [] and [(s.request_id, n) for s, n in out.scheduled] == [("a", 1),
                                                                                 ("b", 1)]
    assert a.drafts == [] and len(a.block_table) == 2
    sched2 = make(num_blocks=8, block_size=4)
    d = add(sched2, 6, "d")
    run_step(sched2)
    d.drafts = [1, 2, 3]  # drafts that fit stay
    assert [(s.request_id, n) for s, n in sched2.schedule().scheduled] == [("d", 4)]


def test_a_sequence_preempted_with_a_draft_feed_feeds_nothing_stale_when_it_returns():
    """A draft model's feed (the tokens its cache lacks) is set before the schedule; when that
    schedule preempts the sequence, the feed goes with its blocks: back with a first chunk
    shorter than the old feed, its step feeds the drafter nothing beyond its blocks."""
    from nvray.engine.sequence import SeqPlan
    from nvray.engine.step_builder import build_step_input

    sched, (a, b, c) = three_running("fcfs", (0, 0, 0))
    c.draft_len, c.draft_feed = 0, 9  # its whole text, as Speculator._feed would set it
    out = sched.schedule()
    assert out.preempted == [c] and c.draft_feed == 0 and c.draft_len == 0
    sched.finish_many([a, b], lambda s: "stop")
    small = make(num_blocks=6, block_size=4, max_num_batched_tokens=4)
    small.block_manager, small.waiting = sched.block_manager, sched.waiting
    out = small.schedule()  # c again, its first chunk of 4 tokens
    assert [(s.request_id, n) for s, n in out.scheduled] == [("c", 4)]
    plans = {c.seq_id: SeqPlan.of(c.params, ())}
    (step,) = build_step_input(out, plans).seqs
    assert step.draft_tokens == () and len(step.block_table) == 1
