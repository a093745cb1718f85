"""The prefix-aware router's pure parts: routing keys, block hashes and the holders table."""

from __future__ import annotations

from deployments.routing.prefix_router import routing_key
from deployments.routing.prefix_table import PrefixTable, prefix_hashes
from nvray.chat_template import ChatPrompt


def test_a_conversations_next_turn_extends_its_key():
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi " * 40}]
    later = turn + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More"}]
    assert routing_key(later).startswith(routing_key(turn))
    assert routing_key(ChatPrompt(later)) == routing_key(later)  # as the ingress passes it
    first, second = prefix_hashes(routing_key(turn)), prefix_hashes(routing_key(later))
    assert first and second[:len(first)] == first
    other = [{"role": "system", "content": "Be long."}] + turn[1:]
    assert prefix_hashes(routing_key(other))[0] != first[0]


def test_token_id_prompts_and_text_have_keys():
    assert routing_key("plain text") == "plain text"
    assert routing_key([1, 22, 333]) == "1,22,333"
    assert prefix_hashes("x" * 63) == [] and len(prefix_hashes("x" * 128)) == 2


def test_the_longest_prefix_wins_and_shared_blocks_have_every_holder():
    table = PrefixTable(capacity=100)
    shared = prefix_hashes("s" * 128)
    a, b = prefix_hashes("s" * 128 + "a" * 64), prefix_hashes("s" * 128 + "b" * 64)
    table.record(a, "A")
    table.record(b, "B")
    assert table.longest_holders(a, {"A", "B"}) == ["A"]
    assert table.longest_holders(b, {"A", "B"}) == ["B"]
    assert sorted(table.longest_holders(shared, {"A", "B"})) == ["A", "B"]
    assert table.longest_holders(a, {"B"}) == ["B"]  # A gone: the shared part, held by B
    assert table.longest_holders(prefix_hashes("z" * 64), {"A", "B"}) == []


def test_the_table_forgets_the_least_recently_used_blocks():
    table = PrefixTable(capacity=2)
    old, new = prefix_hashes("o" * 128), prefix_hashes("n" * 128)
    table.record(old, "A")
    table.longest_holders(old, {"A"})  # a lookup does not refresh: only routing does
    table.record(new, "B")
    assert len(table.holders) == 2
    assert table.longest_holders(old, {"A"}) == []
    assert table.longest_holders(new, {"B"}) == ["B"]
    table.record(old, "A")  # routed again: remembered again, the other one forgotten
    assert table.longest_holders(old, {"A"}) == ["A"]
    assert table.longest_holders(new, {"B"}) == []


def test_a_block_routed_again_outlives_a_newer_one_never_routed_again():
    """LRU, not first in first out: the block recorded first but routed again since survives;
    the one recorded after it and never routed again is the one forgotten."""
    table = PrefixTable(capacity=2)
    first, second, third = (prefix_hashes(c * 64) for c in "fst")
    table.record(first, "A")
    table.record(second, "B")
    table.record(first, "A")  # first is routed again (same replica): the most recent now
    table.record(third, "D")  # one block too many: the least recently routed one goes
    assert table.longest_holders(first, {"A"}) == ["A"]
    assert table.longest_holders(second, {"B"}) == []
    assert table.longest_holders(third, {"D"}) == ["D"]


def test_a_key_with_a_lone_surrogate_is_hashed_not_refused():
    """A routing key from JSON may hold an unpaired surrogate (``"\\ud800"`` is valid JSON):
    it is hashed by its code units like any other text, so such a request is routed too."""
    first, other = prefix_hashes("\ud800" + "x" * 63), prefix_hashes("\ud801" + "x" * 63)
    assert len(first) == 1 and first != other
    assert prefix_hashes("\ud800" + "x" * 127)[0] == first[0]
