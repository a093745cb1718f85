"""The Responses API's edges that a user's client sits on: a page of input items that ends
exactly at the last item says there is no more (``has_more`` false), one item short says there
is; the response store holds exactly ``capacity`` records, dropping the least recently used
(a read counts as use) only past it."""

from __future__ import annotations

import pytest

from deployments.apis.response_store import ResponseStore
from deployments.apis.responses_format import input_items_page

ITEMS = [{"id": f"msg_{i}", "type": "message"} for i in range(4)]


@pytest.mark.parametrize("order,limit,after,ids,more", [
    ("asc", 4, None, ["msg_0", "msg_1", "msg_2", "msg_3"], False),  # ends at the last item
    ("asc", 3, None, ["msg_0", "msg_1", "msg_2"], True),
    ("desc", 4, None, ["msg_3", "msg_2", "msg_1", "msg_0"], False),
    ("asc", 2, "msg_1", ["msg_2", "msg_3"], False),  # after an id, ending at the last
    ("asc", 1, "msg_1", ["msg_2"], True),
    ("desc", 2, "msg_3", ["msg_2", "msg_1"], True),
    ("asc", 5, "msg_3", [], False),
])
def test_a_page_says_whether_items_remain_past_it(order, limit, after, ids, more):
    page = input_items_page(ITEMS, limit, order, after)
    assert [item["id"] for item in page["data"]] == ids
    assert page["has_more"] is more
    assert page["first_id"] == (ids[0] if ids else None)
    assert page["last_id"] == (ids[-1] if ids else None)


def test_the_store_holds_exactly_its_capacity_least_recently_used_out(ray_cluster):
    store = ResponseStore.remote(2)
    ray_cluster.get([store.put.remote("a", {"n": 1}), store.put.remote("b", {"n": 2})])
    assert ray_cluster.get(store.get.remote("a")) == {"n": 1}  # at capacity: both kept
    assert ray_cluster.get(store.get.remote("b")) == {"n": 2}
    assert ray_cluster.get(store.get.remote("a")) == {"n": 1}  # read: "b" is now the oldest
    ray_cluster.get(store.put.remote("c", {"n": 3}))
    assert ray_cluster.get(store.get.remote("b")) is None
    assert ray_cluster.get(store.get.remote("a")) == {"n": 1}
    assert ray_cluster.get(store.get.remote("c")) == {"n": 3}
    assert ray_cluster.get(store.delete.remote("a")) is True
    assert ray_cluster.get(store.delete.remote("a")) is False
    ray_cluster.kill(store)
