"""HeldChunks: a rank's account of the verified chunks whose recurrent state waits for the
engine's count (``nvray/worker/held_chunks.py``): the count a sequence's next chunk implies, a
hold kept across steps the sequence skips, dropped on release, on a new slot or on a recompute
from position 0; start-up's made-up drafting chunks (no slot) never held."""

from __future__ import annotations

from nvray.step_protocol import SeqStep, StepInput
from nvray.worker.held_chunks import HeldChunks

R = 4


def _seq(seq_id: int, start: int, n: int, slot: int, drafts: int = 0) -> SeqStep:
    return SeqStep(seq_id, [1] * n, start, [0], None, state_slot=slot, num_drafts=drafts)


def test_the_next_chunk_gives_the_count_and_skipped_steps_keep_the_hold():
    held = HeldChunks(R)
    step = StepInput([_seq(1, 40, 4, slot=2, drafts=3), _seq(2, 10, 1, slot=5),
                      _seq(3, 20, 3, slot=6, drafts=2)])
    assert held.commits(step) == []
    held.record(step)
    # seq 1 kept its newest token and two drafts; seq 3 sits this step out; seq 2 held nothing
    next_step = StepInput([_seq(1, 43, 2, slot=2, drafts=1), _seq(2, 11, 1, slot=5)])
    assert held.commits(next_step) == [(2, 40, 3)]
    assert held.commits(StepInput([_seq(3, 21, 1, slot=6)])) == [(6, 20, 1)]
    assert held.commits(StepInput([_seq(3, 22, 1, slot=6)])) == []  # applied once


def test_a_release_a_new_slot_or_a_recompute_drops_the_hold():
    held = HeldChunks(R)
    held.record(StepInput([_seq(1, 40, 4, slot=2, drafts=3), _seq(2, 30, 2, slot=3, drafts=1),
                           _seq(3, 50, 3, slot=4, drafts=2)]))
    step = StepInput([_seq(1, 42, 1, slot=2), _seq(2, 0, 16, slot=7), _seq(3, 0, 16, slot=4)],
                     released=[1])
    assert held.commits(step) == []  # released; another slot; recomputed from position 0
    assert held.held == {}


def test_made_up_drafting_steps_hold_nothing():
    held = HeldChunks(R)
    held.record(StepInput([_seq(-1, 0, 64, slot=-1, drafts=40)]))
    assert held.held == {}
