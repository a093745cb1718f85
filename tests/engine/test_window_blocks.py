"""Windowed block-table groups (``nvray/kv_layout.py``): a group of window W gives back the
blocks its window has left as a sequence grows, prefix hits serve each group what it needs
after the hit (and no more than the windowed groups still cache), and a fork whose source's
window moved on prefills on its own. The layout itself: Gemma 3's groups."""

from __future__ import annotations

from nvray.engine.block_manager import BlockManager
from nvray.engine.scheduler import Scheduler
from nvray.engine.sequence import Sequence
from nvray.kv_layout import plan_kv_layout
from nvray.sampling_params import SamplingParams

BS, WINDOW = 4, 6  # a query at p reads positions p-5..p: blocks from (p-5)//4 on


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams())


def prefill(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate_prefix(seq, bm.find_cached_prefix(seq))
    bm.append_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def decode(bm: BlockManager, seq: Sequence, tokens: list[int]) -> None:
    for token in tokens:
        seq.append_token(token)
        bm.append_slots(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)


def entries(seq: Sequence, group: int, groups: int = 2) -> list[int]:
    return seq.block_table[group::groups]


def test_a_windowed_group_holds_only_the_blocks_its_window_reads():
    bm = BlockManager(num_blocks=40, block_size=BS, group_windows=(None, WINDOW))
    seq = seq_of(list(range(5)))
    prefill(bm, seq)
    decode(bm, seq, list(range(100, 125)))  # 30 tokens: 8 logical blocks
    full, local = entries(seq, 0), entries(seq, 1)
    assert len(full) == len(local) == 8 and min(full) >= 0
    # the next token (position 30) reads positions 25..30: blocks 6 and 7 only
    first = (seq.num_computed_tokens - WINDOW) // BS
    assert local[:first - 1] == [-1] * (first - 1) and min(local[first:]) >= 0
    assert bm.num_held_blocks(seq) <= 8 + 3
    assert bm.num_free_blocks == 40 - bm.num_held_blocks(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 40  # nothing leaked, nothing freed twice


def test_a_sequence_too_long_for_the_cache_without_windows_fits_with_them():
    """A full-attention layout would hold 2 x 25 blocks for 100 tokens: the cache has 32."""
    sched = Scheduler(BlockManager(num_blocks=32, block_size=BS, group_windows=(None, WINDOW)),
                      max_num_seqs=1, max_num_batched_tokens=8)
    seq = Sequence("long", list(range(60)), SamplingParams(max_tokens=40))
    sched.add(seq)
    for _ in range(200):
        out = sched.schedule()
        if not out.scheduled:
            break
        for s, n in out.scheduled:
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens and s.num_tokens < 100:
                s.append_token(7)
    assert seq.num_computed_tokens == 100 and sched.num_preemptions == 0
    # 25 full-group blocks; a step of 8 tokens from s reads s-5 .. s+7: at most 5 local blocks
    assert sched.block_manager.pool.peak_held <= 25 + 5


def test_a_prefix_hit_gives_windowed_groups_only_the_blocks_after_their_window():
    bm = BlockManager(num_blocks=40, block_size=BS, group_windows=(None, WINDOW))
    a = seq_of(list(range(21)))
    prefill(bm, a)  # 5 full blocks cached in both groups
    b = seq_of(list(range(21)) + [50, 51])
    cached = bm.find_cached_prefix(b)
    assert cached.num_blocks == 5
    # from position 20 the window reads positions 15..: blocks 3 and 4 of the local group
    assert cached.blocks[0::2] == entries(a, 0)[:5]
    assert cached.blocks[1::2] == [-1, -1, -1] + entries(a, 1)[3:5]
    bm.allocate_prefix(b, cached)
    bm.append_slots(b, b.num_tokens - b.num_computed_tokens)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 40


def test_no_hit_where_the_windowed_group_lost_the_blocks_before_the_prompts_end():
    """The full group still caches the prompt's blocks, but the local group's were evicted:
    a hit would leave the window without its keys, so there is none."""
    bm = BlockManager(num_blocks=12, block_size=BS, group_windows=(None, WINDOW))
    a = seq_of(list(range(13)))
    prefill(bm, a)
    decode(bm, a, [90, 91, 92, 93, 94, 95, 96, 97])  # the local group gives back blocks 0..2
    bm.free(a)
    hog = seq_of(list(range(200, 205)))
    prefill(bm, hog)  # 2 x 2 blocks: takes the local group's blocks given back first
    assert bm.find_cached_prefix(seq_of(list(range(13)) + [1])).num_blocks == 0
    plain = BlockManager(num_blocks=12, block_size=BS)
    prefill(plain, seq_of(list(range(13))))
    assert plain.find_cached_prefix(seq_of(list(range(13)) + [1])).num_blocks == 3


def _fork_after(prompt: list[int], decoded: int) -> Sequence:
    """A choice of ``prompt`` forked from a source that ran its prompt, then ``decoded``
    decode steps, once the scheduler has placed it."""
    sched = Scheduler(BlockManager(num_blocks=64, block_size=BS, group_windows=(None, WINDOW)),
                      max_num_seqs=4, max_num_batched_tokens=64)
    source = Sequence("r", prompt, SamplingParams(max_tokens=40))
    sched.add(source)
    for _ in range(decoded + 1):
        for s, n in sched.schedule().scheduled:
            s.num_computed_tokens += n
            s.append_token(5)
    child = Sequence("r", prompt, SamplingParams(max_tokens=40))
    child.fork_of = source
    sched.add(child)
    sched.schedule()
    return child


def test_a_fork_whose_source_moved_past_its_window_prefills_on_its_own():
    child = _fork_after(list(range(10)), 11)  # 21 tokens: the window at 16..
    assert child.fork_of is None and child.num_cached_tokens == 0  # its own prefill
    assert all(b >= 0 for b in child.block_table)


def test_a_fork_shares_its_sources_blocks_only_while_they_hold_every_position_it_reads():
    """Swept over how far the source has decoded: a fork either prefills on its own or shares
    blocks that hold every position its first query reads (its last prompt token's window,
    counted here from positions, not from the block manager's own arithmetic)."""
    prompt = list(range(10))
    shared = len(prompt) - 1  # the fork computes its last prompt token itself
    read = {p // BS for p in range(max(0, shared - WINDOW + 1), shared)}
    outcomes = set()
    for decoded in range(8):
        child = _fork_after(prompt, decoded)
        forked = child.num_cached_tokens == shared
        outcomes.add(forked)
        if forked:
            local = entries(child, 1)
            assert all(local[b] >= 0 for b in read), (decoded, local)
    assert outcomes == {True, False}  # the sweep crosses the point where the window moves on


def test_gemma3_12b_layers_make_one_full_and_five_local_groups():
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(48)]
    layout = plan_kv_layout(windows)
    assert layout.group_windows == (None,) + (1024,) * 5 and layout.slots_per_block == 8
    assert [layout.layer_slots[i] for i in (5, 11, 0, 1, 47)] == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                                  (0, 7)]
    # 4B: 5 global, 29 local layers in groups of 5 (the last local group has an empty slot)
    layout = plan_kv_layout([None if (i + 1) % 6 == 0 else 1024 for i in range(34)])
    assert layout.num_groups == 7 and layout.slots_per_block == 5
    assert len(set(layout.layer_slots)) == 34
    # one kind of layer: one group of all of them, windowed or not
    assert plan_kv_layout([4096] * 32) == ((4096,), tuple((0, i) for i in range(32)), 32)
    assert plan_kv_layout([None] * 3).group_windows == (None,)


def test_a_32k_sequence_of_gemma3_12b_holds_under_a_quarter_of_a_full_attention_cache():
    """The issue's goal, counted by the scheduler and block manager that run it: a 32K-token
    prompt in 8K chunks, then decoding, with Gemma 3 12B's layers (blocks of 16 tokens)."""
    layout = plan_kv_layout([None if (i + 1) % 6 == 0 else 1024 for i in range(48)])
    bm = BlockManager(8000, 16, group_windows=layout.group_windows)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=8192)
    seq = Sequence("long", list(range(32768)), SamplingParams(max_tokens=64))
    sched.add(seq)
    for _ in range(80):
        for s, n in sched.schedule().scheduled:
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.append_token(7)
    assert seq.num_computed_tokens > 32768 + 32
    held = bm.num_held_blocks(seq) * layout.slots_per_block  # layer-blocks
    full = -(-seq.num_computed_tokens // 16) * 48  # the same sequence, every layer global
    assert held / full <= 0.25  # (while an 8K chunk computes, its window spans the chunk too)
