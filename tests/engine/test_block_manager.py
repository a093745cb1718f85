"""BlockManager: hashing and reuse, token-equality check, LRU eviction, ref counts, no leaks."""

from __future__ import annotations

from nvray.engine.block_manager import BlockManager
from nvray.engine.prefix_cache import NO_PREFIX
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
    assert bm.pool.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_hit_rate == 8 / (10 + 11)


def test_a_hit_leaves_its_last_block_out_for_a_drafter_whose_rows_lag():
    """EAGLE-3 (``hits_skip_last_block``): the longest cached prefix is served less its last
    block, however long the prompt, on one group and on several (a window reaching past it)."""
    for windows in ((None,), (None, 64)):
        bm = BlockManager(num_blocks=20, block_size=4, group_windows=windows,
                          hits_skip_last_block=True)
        a = seq_of(list(range(14)))  # 3 full blocks cached after its prefill
        run_prefill(bm, a)
        b = seq_of(list(range(12)) + [99] * 9)  # 3 blocks match, 5 could be looked up
        run_prefill(bm, b)
        assert b.num_cached_tokens == 8, windows
        assert b.block_table[:2 * len(windows)] == a.block_table[:2 * len(windows)]
        assert b.block_table[2 * len(windows)] != a.block_table[2 * len(windows)]


def test_states_are_kept_where_hits_end_with_and_without_the_last_block_left_out():
    """A model with recurrent state keeps a prompt's state at its last block boundary before its
    last token, or where it leaves the cached KV (a shared system prompt); where hits leave
    their last block out (a head drafting), the prompt's own point is a block earlier, where a
    repeat's hit ends. A prompt too short for a hit keeps none."""
    for skip, last in ((False, 12), (True, 8)):
        bm = BlockManager(num_blocks=20, block_size=4, num_state_slots=6, num_live_states=2,
                          hits_skip_last_block=skip)
        prompt = seq_of(list(range(14)))  # 3 full blocks before its last token
        assert bm.state_save_point(prompt, 0) == last
        assert bm.state_save_point(prompt, 0, diverges_at=4) == 4  # then `last` after it
        assert bm.state_save_point(prompt, 4) == last
        assert bm.state_save_point(prompt, last) == -1
        assert bm.state_save_point(seq_of(list(range(5))), 0) == (-1 if skip else 4)


def test_chained_hash_does_not_match_a_block_with_a_different_prefix():
    bm = BlockManager(num_blocks=10, block_size=4)
    run_prefill(bm, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = seq_of([0, 0, 0, 0, 5, 6, 7, 8, 9])  # same second block, different first
    assert bm.find_cached_prefix(other).blocks == []


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
    assert bm.find_cached_prefix(seq_of([0, 0, 0, 0, 5, 6, 7, 8, 10])).blocks == second.block_table[:2]


def test_a_cached_block_is_not_reused_after_a_different_cached_prefix():
    bm = BlockManager(num_blocks=10, block_size=4)
    run_prefill(bm, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = seq_of([0, 0, 0, 0, 9])
    run_prefill(bm, other)  # [0, 0, 0, 0] is cached too, as a first block
    assert bm.find_cached_prefix(seq_of([0, 0, 0, 0, 5, 6, 7, 8, 9])).blocks == other.block_table[:1]


def test_token_equality_guards_against_hash_collisions():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    block = bm.pool.blocks[a.block_table[0]]
    block.token_ids = (9, 9, 9, 9)  # simulate a colliding hash holding other tokens
    assert bm.find_cached_prefix(seq_of([1, 2, 3, 4, 5])).blocks == []


def test_full_prompt_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4)
    run_prefill(bm, seq_of(list(range(8))))
    again = seq_of(list(range(8)))
    assert len(bm.find_cached_prefix(again).blocks) == 1  # 2 full blocks cached, only 1 reused


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
    assert bm.find_cached_prefix(seq_of([1, 2, 3])).blocks and bm.find_cached_prefix(seq_of([7, 8, 9])).blocks
    run_prefill(bm, seq_of([60, 61]))  # 1 block: evicts old's cached block, freed earlier
    assert bm.find_cached_prefix(seq_of([1, 2, 3])).blocks == []
    assert bm.find_cached_prefix(seq_of([7, 8, 9])).blocks != []


def test_reused_block_drops_its_stale_hash():
    bm = BlockManager(num_blocks=1, block_size=2)
    a = seq_of([1, 2])
    run_prefill(bm, a)  # block 0 is full: cached as (1, 2)
    bm.free(a)
    b = seq_of([5, 6])
    run_prefill(bm, b)
    assert bm.find_cached_prefix(seq_of([1, 2, 9])).blocks == []
    assert bm.find_cached_prefix(seq_of([5, 6, 9])).blocks == [b.block_table[0]]


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
    assert all(b.ref_count == 0 for b in bm.pool.blocks)


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq_of([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    bm.free(a)
    b = seq_of([1, 2, 3, 4, 5, 6, 7])
    cached = bm.find_cached_prefix(b)
    assert len(cached.blocks) == 2
    assert bm.can_allocate(cached, 6)  # 2 revived + 1 new = 3 free
    assert not bm.can_allocate(cached, 8)


def test_blocks_filled_by_decoding_are_found_by_a_later_prompt():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of([1, 2, 3, 4, 5])
    run_prefill(bm, a)  # one full block cached
    for token in (6, 7, 8, 9):  # decoding fills the second block
        a.append_token(token)
        bm.append_slots(a, 1)
        a.num_computed_tokens += 1
        bm.cache_full_blocks(a)
    b = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert bm.find_cached_prefix(b).blocks == a.block_table[:2]


def test_only_blocks_whose_kv_is_written_are_cached():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of(list(range(9)))
    bm.allocate_prefix(a, NO_PREFIX)
    bm.append_slots(a, 9)
    a.num_computed_tokens = 9  # launched, but only the first block's KV is written so far
    bm.cache_full_blocks(a, num_written=4)
    assert bm.find_cached_prefix(seq_of(list(range(10)))).blocks == a.block_table[:1]
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(seq_of(list(range(10)))).blocks == a.block_table[:2]


def test_content_computed_again_after_its_block_was_reused_is_cached_again():
    """(1, 2) is cached, its block reused for other tokens, then (1, 2) computed again in
    another block: a later prompt finds that one (the reused block's stale entry is gone)."""
    bm = BlockManager(num_blocks=3, block_size=2)
    first = seq_of([1, 2, 3])
    run_prefill(bm, first)
    old_block = first.block_table[0]
    bm.free(first)
    second = seq_of([5, 6, 7, 8, 9])
    run_prefill(bm, second)  # takes every block: (1, 2)'s among them
    bm.free(second)
    holder = seq_of([4, 4])
    run_prefill(bm, holder)
    assert holder.block_table == [old_block]  # (1, 2)'s old block now holds (4, 4)
    again = seq_of([1, 2, 9])
    run_prefill(bm, again)
    assert again.block_table[0] != old_block
    assert bm.find_cached_prefix(seq_of([1, 2, 3])).blocks == again.block_table[:1]


def test_hit_rate_counts_every_lookup():
    bm = BlockManager(num_blocks=10, block_size=4)
    for _ in range(3):
        run_prefill(bm, seq_of(list(range(9))))
    assert bm.prefix_hit_rate == (0 + 8 + 8) / (9 * 3)
    assert bm.usage == 1 - bm.num_free_blocks / 10


def test_a_new_manager_holds_nothing_to_copy_release_or_count():
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.take_copies() == [] and bm.take_released() == [] and bm.num_copied_blocks == 0
    assert bm.usage == 0.0 and bm.prefix_hit_rate == 0.0 and bm.num_free_blocks == 3


def test_freed_sequences_are_released_once_and_forget_their_hashes():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq_of(list(range(9))), seq_of([7])
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.take_released() == [a.seq_id, b.seq_id] and bm.take_released() == []
    assert not bm.prefix_cache.seq_block_hashes  # nothing kept for sequences that are gone
    assert a.block_table == [] and a.num_computed_tokens == 0 and a.ranks_table_len == 0


def test_new_and_rewritten_tables_go_to_the_ranks_whole():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of(list(range(9)))
    run_prefill(bm, a)
    a.ranks_table_len = len(a.block_table)  # the ranks got it
    b = seq_of(list(range(9)))
    bm.allocate_prefix(b, bm.find_cached_prefix(b))
    assert b.ranks_table_len == 0 and b.num_cached_tokens == 8


def test_block_needs_of_a_sequence_writing_more_tokens():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of(list(range(6)))
    run_prefill(bm, a)  # 2 blocks, 6 of 8 slots written
    assert not bm.needs_blocks(a, 2) and bm.num_new_blocks(a, 2) == 0
    assert bm.needs_blocks(a, 3) and bm.num_new_blocks(a, 3) == 1
    assert bm.num_new_blocks(a, 11) == 3 and bm.can_append_slots(a, 11)
    assert not bm.can_append_slots(a, 2 + 4 * 8 + 1)  # 9 more blocks; 8 are free


def test_writing_into_a_shared_block_needs_a_copy():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent, child = seq_of(list(range(7))), seq_of(list(range(7)))
    run_prefill(bm, parent)
    assert not bm.needs_blocks(parent, 1)  # not shared yet
    bm.fork(child, parent, 6)  # shares block 0 and the partly filled block 1
    assert child.block_table == parent.block_table and child.num_computed_tokens == 6
    assert [bm.pool.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    assert bm.needs_blocks(child, 1) and bm.num_new_blocks(child, 1) == 1
    assert bm.num_new_blocks(child, 3) == 2  # the copy and a third block
    bm.append_slots(child, 1)
    assert child.block_table[0] == parent.block_table[0]
    assert bm.take_copies() == [(parent.block_table[1], child.block_table[1])]
    assert [bm.pool.blocks[b].ref_count for b in parent.block_table] == [2, 1]
    assert not bm.needs_blocks(child, 1) and bm.num_copied_blocks == 1


def test_a_fork_fits_when_its_new_blocks_and_copy_are_free():
    bm = BlockManager(num_blocks=4, block_size=4)
    run_prefill(bm, seq_of(list(range(7))))  # 2 blocks used, 2 free
    assert bm.can_fork(6, 1)  # the copy of the partly filled block
    assert bm.can_fork(8, 8) and not bm.can_fork(8, 9)  # 2 new blocks fit, 3 don't
    assert bm.can_fork(6, 6) and not bm.can_fork(6, 7)  # the copy and 1 new, not 2


def test_blocks_of_one_slot_cache_every_token_but_the_last():
    bm = BlockManager(num_blocks=8, block_size=1)
    run_prefill(bm, seq_of([5, 6, 7]))
    again = seq_of([5, 6, 7])
    run_prefill(bm, again)
    assert again.num_cached_tokens == 2 and bm.num_free_blocks == 8 - 4


def drafted_through(bm: BlockManager, seq: Sequence, draft_len: int) -> None:
    """``seq``'s drafter fed up to ``draft_len``, as a drafting step's answer leaves it."""
    seq.draft_len = draft_len
    bm.mark_drafted(seq)


def test_a_hit_counts_the_leading_blocks_fed_to_the_drafter_until_they_are_reused():
    """A sequence with ``draft_len`` 8 (a head's rows before position 7 final: the row at 7,
    its second block's last, waits for token 8) marks its first block of four tokens, so a
    prompt hitting three of its blocks starts with one drafted; once that prompt's drafter
    reaches 10 the second block is marked too, and the next hit starts with two. Blocks reused
    for other tokens lose the mark, so a hit on what they hold then counts none."""
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq_of(list(range(14)))
    run_prefill(bm, a)
    drafted_through(bm, a, 8)
    bm.free(a)
    early = seq_of(list(range(13)) + [98])
    run_prefill(bm, early)
    assert early.num_cached_tokens == 12 and early.draft_len == 4
    drafted_through(bm, early, 10)
    bm.free(early)
    hit = seq_of(list(range(13)) + [99])
    run_prefill(bm, hit)
    assert hit.num_cached_tokens == 12 and hit.draft_len == 8
    bm.free(hit)
    other = seq_of([50 + i for i in range(16)])  # takes every block: the marked ones too
    run_prefill(bm, other)
    assert not any(bm.draft_marks.drafted[block] for block in other.block_table)
    bm.free(other)
    again = seq_of([50 + i for i in range(12)] + [7])
    run_prefill(bm, again)
    assert again.num_cached_tokens == 12 and again.draft_len == 0


def test_a_heads_hit_counts_a_block_only_where_the_token_after_it_is_the_sequences():
    """A head's row at a block's last position was fed the token after the block. X = P + A...
    drafts through its blocks; Y = P + B... hits X's first block (its last one left out) and
    drafts through blocks of its own, P's second among them, whose hash keeps leading to X's
    copy; Y's next turn hits X's two blocks of P (Y's third left out): the draft cache counts
    only the first (X's copy of P's second block ends in a row fed token A, Y's turn goes on
    with B), and that copy loses its mark, as the turn feeds its last row again."""
    bm = BlockManager(num_blocks=12, block_size=4, hits_skip_last_block=True)
    p = [1, 2, 3, 4, 5, 6, 7, 8]
    x = seq_of(p + [20, 21, 22, 23, 24])
    run_prefill(bm, x)
    drafted_through(bm, x, 13)
    y = seq_of(p + [30, 31, 32, 33, 34])
    run_prefill(bm, y)
    assert y.num_cached_tokens == 4 and y.draft_len == 4
    drafted_through(bm, y, 13)
    turn = seq_of(y.token_ids + [35, 36, 37, 38, 39])
    run_prefill(bm, turn)
    assert turn.block_table[:2] == x.block_table[:2]  # (Y's third block is its hit's last)
    assert turn.num_cached_tokens == 8 and turn.draft_len == 4
    assert not bm.draft_marks.drafted[x.block_table[1]]
