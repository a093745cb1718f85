"""HeldCommit's graphs (``nvray/worker/held_commit.py``) on CUDA: commit lists of growing and
shrinking lengths replayed through the graph that holds each (a shorter list through the same
graph as a longer one before it: the entry left in the static list must keep nothing), and one
longer than the largest graph run eagerly; after each, every layer's states equal the torch
reference's."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, R, NK, NV, DK, DV, KERNEL = 12, 3, 2, 4, 16, 8, 4


class _Layer:
    """A recurrent layer's state and held rows, committed by the kernel (or the reference)."""

    def __init__(self, gen: torch.Generator, fn) -> None:  # noqa: ANN001
        conv_dim = 2 * NK * DK + NV * DV

        def rand(*shape):  # noqa: ANN202
            return torch.randn(*shape, generator=gen).cuda()

        self.fn = fn
        self.held_mixed, self.held_conv = rand(ROWS * R, conv_dim), rand(ROWS * R, conv_dim)
        self.held_g = -rand(ROWS * R, NV).abs()
        self.held_beta = torch.sigmoid(rand(ROWS * R, NV))
        self.conv_state, self.ssm_state = rand(ROWS, conv_dim, KERNEL - 1), rand(ROWS, NV, DK, DV)

    def commit_held(self, slots, starts, counts) -> None:  # noqa: ANN001
        self.fn(self.held_mixed, self.held_conv, self.held_g, self.held_beta, self.conv_state,
                self.ssm_state, slots, starts, counts, R, NK, DK, DV)


def test_commit_graphs_apply_each_steps_entries_and_nothing_left_from_the_last():
    import kernels
    from nvray.layers.gated_delta_rule import commit_reference
    from nvray.worker.held_commit import HeldCommit

    ours = [_Layer(torch.Generator().manual_seed(i), kernels.gdn_commit) for i in range(2)]
    refs = [_Layer(torch.Generator().manual_seed(i), commit_reference) for i in range(2)]
    commit = HeldCommit(ours, (1, 2, 4), torch.device("cuda"))
    commit.warm()
    commit.capture()
    steps = [[(3, 5, 2), (0, 0, 3), (7, 9, 1)],  # the graph of 4
             [(2, 5, 2), (4, 3, 1), (6, 8, 3), (8, 1, 2)],  # of 4, every entry
             [(1, 4, 3), (3, 7, 2), (5, 2, 1)],  # of 4: the 4th entry before keeps nothing
             [(5, 2, 1)],  # of 1
             [(1, 4, 3), (3, 7, 2)],  # of 2
             [(s, 6, 1 + s % R) for s in range(6)]]  # more than 4: eagerly
    for entries in steps:
        commit.apply(entries)
        slots, starts, counts = (torch.tensor(c, dtype=torch.int32, device="cuda")
                                 for c in zip(*entries))
        for ref in refs:
            ref.commit_held(slots, starts, counts)
        torch.cuda.synchronize()
        for a, b in zip(ours, refs):
            torch.testing.assert_close(a.conv_state, b.conv_state, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(a.ssm_state, b.ssm_state, atol=1e-4, rtol=1e-4)
    assert commit.num_replays == 5
