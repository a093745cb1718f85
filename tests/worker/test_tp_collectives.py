"""The tensor-parallel collectives (``nvray/layers/tp.py``) in a real two-process gloo group:
they combine the ranks' values, and inside ``collectives_off()`` they leave each rank's own
(what lets each rank rehearse its start-up alone, ``worker/compile_ahead.py``)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, results) -> None:
    from nvray.layers import tp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=__import__("datetime").timedelta(seconds=30))
    try:
        mine = torch.tensor([float(rank + 1)])
        with tp.collectives_off():
            off = (tp.all_reduce(mine.clone()).item(), tp.broadcast_from_first(mine.clone()).item())
            alone = tp.gather_last_dim(mine.clone())  # rank 0: its own slice, then whatever
        on = (tp.all_reduce(mine.clone()).item(), tp.broadcast_from_first(mine.clone()).item())
        gathered = tp.gather_last_dim(mine.clone())
        results[rank] = (off, on, None if gathered is None else gathered.tolist(),
                         None if alone is None else alone[:1].tolist())
    finally:
        dist.destroy_process_group()


def test_collectives_combine_ranks_and_do_nothing_when_off():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(_free_port(), results), nprocs=2, join=True)
        got = dict(results)
    assert got[0] == ((1.0, 1.0), (3.0, 1.0), [1.0, 2.0], [1.0])
    assert got[1] == ((2.0, 2.0), (3.0, 1.0), None, None)


def _rank_in_two_groups(rank: int, port: int, results) -> None:
    from nvray.layers import tp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4, timeout=__import__("datetime").timedelta(seconds=30))
    try:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes each
        tp.set_tp_group(groups[rank // 2])
        mine = torch.tensor([float(rank + 1)])
        summed = tp.all_reduce(mine.clone()).item()
        first = tp.broadcast_from_first(mine.clone()).item()
        gathered = tp.gather_last_dim(mine.clone())
        results[rank] = (tp.tp_rank(), tp.tp_size(), summed, first,
                         None if gathered is None else gathered.tolist())
    finally:
        tp.set_tp_group(None)
        dist.destroy_process_group()


def test_collectives_stay_inside_the_tensor_parallel_group():
    """Four ranks as two tensor-parallel groups of two (as pipeline stages would be): each
    group's sums, broadcasts and gathers are its own ranks' only."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_in_two_groups, args=(_free_port(), results), nprocs=4, join=True)
        got = dict(results)
    assert got[0] == (0, 2, 3.0, 1.0, [1.0, 2.0])
    assert got[1] == (1, 2, 3.0, 1.0, None)
    assert got[2] == (0, 2, 7.0, 3.0, [3.0, 4.0])
    assert got[3] == (1, 2, 7.0, 3.0, None)
