"""Block tables travel to the ranks as changes: after every step the rank's copy of each
running sequence's table is the control plane's, through prefix hits, preemption (KV pressure),
forks that copy a shared block on write (n > 1, beam search) and aborts; freed sequences'
tables are dropped, and a running sequence sends no entry on most decode steps."""

from __future__ import annotations

import pytest
import torch

from nvray import LLM, BeamSearchParams, SamplingParams
from nvray.engine.block_manager import BlockManager
from nvray.engine.scheduler import SchedulerOutput
from nvray.engine.sequence import SeqPlan, Sequence
from nvray.engine.step_builder import build_step_input
from nvray.worker.block_tables import DeviceBlockTables
from oracle import random_prompts

MAX_STEPS = 2000


@pytest.fixture(scope="module")
def engine():  # noqa: ANN201
    llm = LLM("tiny", runtime="inprocess", max_model_len=256, max_num_batched_tokens=64,
              num_kvcache_blocks=24, kvcache_block_size=16)
    return llm.engine


def _assert_rank_tables_follow(engine) -> None:  # noqa: ANN001
    tables = engine.executor.runner.inputs.tables
    for seq in engine.scheduler.running:
        if seq.ranks_table_len:  # launched: the ranks hold what was sent
            held = tables.held[seq.seq_id]
            assert held[:seq.ranks_table_len] == seq.block_table[:seq.ranks_table_len], seq.seq_id


def test_rank_tables_follow_the_control_plane_and_freed_ones_go(engine):
    prompts = random_prompts(6, 40, 120, seed=61)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    forked = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=25, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy)
    engine.add_request("again", prompts[0], greedy)  # a prefix hit
    engine.add_request("fork", prompts[1][:37], forked)  # the forks share a partial block
    engine.add_request("gone", prompts[2], greedy)
    # beams fork from running beams: a launched beam copies the block it shares on write
    engine.add_request("beams", prompts[4][:21], BeamSearchParams(beam_width=3, max_tokens=12,
                                                                  ignore_eos=True))
    preemptions, copies = engine.scheduler.num_preemptions, engine.block_manager.num_copied_blocks
    sent = full = 0
    for k in range(MAX_STEPS):
        if k == 6:
            engine.abort_request("gone")
        if not engine.has_unfinished_requests():
            break
        engine.step()
        _assert_rank_tables_follow(engine)
        for launched in engine.stepper.in_flight:
            for seq_step in launched.step_input.seqs:
                sent += len(seq_step.block_table)
                full += seq_step.table_start + len(seq_step.block_table)
    else:
        pytest.fail(f"the engine did not drain in {MAX_STEPS} steps")
    assert engine.scheduler.num_preemptions > preemptions, "the workload must preempt"
    assert engine.block_manager.num_copied_blocks > copies, "the forks must copy a shared block"
    assert sent * 4 < full, f"{sent} of {full} table entries sent: the tables travel whole"
    # one more request: its first step drops the tables of every sequence freed before it
    engine.add_request("last", prompts[3][:20], SamplingParams(temperature=0.0, max_tokens=2))
    engine.step()
    last = engine.scheduler.running[0].seq_id
    assert set(engine.executor.runner.inputs.tables.rows) == {last}
    for _ in range(10):
        engine.step()


def test_a_launched_sequence_that_copies_a_shared_block_sends_the_new_entry():
    """The parent writes first into the block it shares with a fork (the engine's order may
    put either first): its copy replaces an entry the ranks already hold."""
    bm, params = BlockManager(num_blocks=16, block_size=4), SamplingParams(max_tokens=5)
    parent = Sequence("p", list(range(10)), params)
    child = Sequence("c", list(range(10)), params)
    plans = {s.seq_id: SeqPlan.of(params, ()) for s in (parent, child)}
    tables = DeviceBlockTables(4, 8, torch.device("cpu"))

    def launch(*scheduled: tuple[Sequence, int]) -> None:
        step = build_step_input(SchedulerOutput(list(scheduled)), plans, bm.take_copies(),
                                bm.take_released())
        tables.release(step.released)
        for seq_step in step.seqs:
            tables.sync(seq_step.seq_id, seq_step.block_table, seq_step.table_start, [], [])
        for seq, n in scheduled:
            seq.num_computed_tokens += n

    bm.append_slots(parent, 10)
    launch((parent, 10))  # 3 blocks, the last one partly filled
    parent.token_ids.append(10)
    child.token_ids.append(10)
    bm.fork(child, parent, 10)
    bm.append_slots(parent, 1)  # the parent writes into the shared block: a private copy
    assert bm.copies  # the copy happened
    launch((parent, 1))
    assert tables.held[parent.seq_id] == parent.block_table
    bm.append_slots(child, 1)  # the child is the block's only holder now: no copy
    launch((child, 1))
    assert tables.held[child.seq_id] == child.block_table
    bm.free(parent)
    launch((child, 0))
    assert parent.seq_id not in tables.rows and child.seq_id in tables.rows


def test_a_change_the_rank_cannot_apply_fails_loudly():
    tables = DeviceBlockTables(4, 8, torch.device("cpu"))
    idx, val = [], []
    with pytest.raises(AssertionError, match="seq 5 .* holds no table"):
        tables.sync(5, [7], 2, idx, val)
    assert tables.sync(5, [3, 4], 0, idx, val)[1] == [3, 4]
    with pytest.raises(AssertionError, match="seq 5 .* holds 2 entries"):
        tables.sync(5, [9], 3, idx, val)
    assert tables.sync(5, [9], 1, idx, val)[1] == [3, 9]  # entry 1 rewritten (copy-on-write)
    tables.release([5, 6])
    with pytest.raises(AssertionError, match="holds no table"):
        tables.sync(5, [], 2, idx, val)


def test_a_reused_row_holds_no_earlier_sequences_entries_and_the_padding_row_stays_zero():
    """CUDA graphs' padding reads entries past a sequence's own (and the padding row): never a
    previous holder's -1 (a windowed group's freed block), which the kernels would read as a
    block before the cache."""
    tables = DeviceBlockTables(3, 6, torch.device("cpu"))
    idx, val = [], []
    first, _ = tables.sync(1, [-1, -1, 5, 6, 7], 0, idx, val)
    tables.apply(torch.tensor(idx), torch.tensor(val, dtype=torch.int32))
    assert first != tables.pad_row
    tables.release([1])
    idx, val = [], []
    again, _ = tables.sync(2, [3], 0, idx, val)
    tables.apply(torch.tensor(idx), torch.tensor(val, dtype=torch.int32))
    assert again == first
    assert tables.group_tables[0][again].tolist() == [3, 0, 0, 0, 0, 0]
    other, _ = tables.sync(3, [4], 0, [], [])
    assert tables.pad_row not in (again, other)
    assert tables.group_tables[0][tables.pad_row].tolist() == [0] * 6
