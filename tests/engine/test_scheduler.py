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
    sched = make(max_num_seqs=1)
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
    add(sched, 40, "long", arrival=0.0)
    first = None
    for t in range(1, 20):  # a stream of short requests keeps arriving
        clock.now = float(t)
        add(sched, 2, f"short{t}", arrival=clock.now)
        out = sched.schedule()
        admitted = [s for s, _ in out.scheduled if s.request_id == "long"]
        for seq, _ in out.scheduled:  # finish whatever ran so the next one can be admitted
            sched.finish(seq, "stop")
        if admitted:
            first = t
            break
    assert first is not None and first >= 5  # waited its aging time, then went ahead


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
    seqs = [add(sched, 6, f"r{i}") for i in range(3)]
    run_step(sched)
    sched.finish_many(seqs, lambda s: "stop")
    assert sched.block_manager.num_free_blocks == 16 and not sched.has_unfinished()
