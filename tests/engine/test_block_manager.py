"""BlockManager: hashing and reuse, token-equality check, LRU eviction, ref counts, no leaks."""

from __future__ import annotations

from nvray.engine.block_manager import BlockManager
from nvray.engine.sequence import Sequence
from nvray.sampling_params import SamplingParams


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams())


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` the way the scheduler does and mark its whole prompt computed."""
    cached = bm.find_cached_prefix(seq)
    bm.allocate_prefix(seq, cached)
    bm.append_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_identical_prefix_is_reused_and_counted():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of(list(range(10)))  # 2 full blocks + 2 tokens
    run_prefill(bm, a)
    b = seq_of(list(range(8)) + [99, 98, 97])
    run_prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_hit_rate == 8 / (10 + 11)


def test_chained_hash_does_not_match_a_block_with_a_different_prefix():
    bm = BlockManager(num_blocks=10, block_size=4)
    run_prefill(bm, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = seq_of([0, 0, 0, 0, 5, 6, 7, 8, 9])  # same second block, different first
    assert bm.find_cached_prefix(other) == []


def test_a_block_is_found_only_after_the_prefix_it_was_computed_after():
    """Two sequences share their second block's tokens after different first blocks; a third
    that starts like the second must get the second's KV for both blocks, never the first's
    (whose KV was computed after another prefix)."""
    bm = BlockManager(num_blocks=10, block_size=4)
    first = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prefill(bm, first)
    second = seq_of([0, 0, 0, 0, 5, 6, 7, 8, 9])
    run_prefill(bm, second)
    assert second.num_cached_tokens == 0  # its first block differs: nothing reused
    assert bm.find_cached_prefix(seq_of([0, 0, 0, 0, 5, 6, 7, 8, 10])) == second.block_table[:2]


def test_a_cached_block_is_not_reused_after_a_different_cached_prefix():
    bm = BlockManager(num_blocks=10, block_size=4)
    run_prefill(bm, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = seq_of([0, 0, 0, 0, 9])
    run_prefill(bm, other)  # [0, 0, 0, 0] is cached too, as a first block
    assert bm.find_cached_prefix(seq_of([0, 0, 0, 0, 5, 6, 7, 8, 9])) == other.block_table[:1]


def test_token_equality_guards_against_hash_collisions():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = (9, 9, 9, 9)  # simulate a colliding hash holding other tokens
    assert bm.find_cached_prefix(seq_of([1, 2, 3, 4, 5])) == []


def test_full_prompt_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4)
    run_prefill(bm, seq_of(list(range(8))))
    again = seq_of(list(range(8)))
    assert len(bm.find_cached_prefix(again)) == 1  # 2 full blocks cached, only 1 reused


def test_freed_blocks_stay_cached_and_are_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = seq_of([1, 2, 3]), seq_of([7, 8, 9])
    run_prefill(bm, old)
    run_prefill(bm, new)
    bm.free(old)  # freed first -> evicted first
    bm.free(new)
    assert bm.num_free_blocks == 4
    hog = seq_of([50, 51, 52])  # needs 2 blocks: the 2 uncached partial blocks go first
    run_prefill(bm, hog)
    assert bm.find_cached_prefix(seq_of([1, 2, 3])) and bm.find_cached_prefix(seq_of([7, 8, 9]))
    run_prefill(bm, seq_of([60, 61]))  # 1 block: evicts old's cached block, freed earlier
    assert bm.find_cached_prefix(seq_of([1, 2, 3])) == []
    assert bm.find_cached_prefix(seq_of([7, 8, 9])) != []


def test_reused_block_drops_its_stale_hash():
    bm = BlockManager(num_blocks=1, block_size=2)
    a = seq_of([1, 2])
    run_prefill(bm, a)  # block 0 is full: cached as (1, 2)
    bm.free(a)
    b = seq_of([5, 6])
    run_prefill(bm, b)
    assert bm.find_cached_prefix(seq_of([1, 2, 9])) == []
    assert bm.find_cached_prefix(seq_of([5, 6, 9])) == [b.block_table[0]]


def test_no_block_leaks_after_every_sequence_is_freed():
    bm = BlockManager(num_blocks=40, block_size=4)
    seqs = [seq_of([i % 3] * 4 + list(range(i, i + 7))) for i in range(5)]
    for s in seqs:
        run_prefill(bm, s)
    for s in seqs:
        for _ in range(6):  # decode a few tokens
            s.append_token(1)
            bm.append_slots(s, 1)
            s.num_computed_tokens += 1
            bm.cache_full_blocks(s)
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 40
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq_of([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    bm.free(a)
    b = seq_of([1, 2, 3, 4, 5, 6, 7])
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    assert bm.can_allocate(cached, 6)  # 2 revived + 1 new = 3 free
    assert not bm.can_allocate(cached, 8)
