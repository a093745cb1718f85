"""HeldChunks: which sequences' recurrent state waits for the engine to say how many of a
verified chunk's tokens it kept (speculative decoding on models with linear-attention layers,
``nvray/layers/gated_deltanet.py``).

A recurrent layer's state holds a sequence's whole past in one tensor, so it cannot be rolled
back to a rejected draft. In a step with drafts every drafting sequence's chunk (its newest
token and its drafts) is *held*: the layers compute its rows from the slot's state but keep
the rows' inputs instead of writing the final state. The rank learns how many rows the engine
kept from the sequence's next chunk, which starts right after them (``SeqStep.start_pos``):
before that step's forward, ``commits`` gives each such slot's ``(slot, start, count)`` and the
layers apply those rows (``GatedDeltaNet.commit_held``). A sequence released meanwhile
(finished, aborted, preempted) drops its held rows; so does one whose slot changed or whose
next chunk does not start within them (a recompute from position 0). Every rank keeps its own
copy from the same steps, so they agree without a message.
"""

from __future__ import annotations

from typing import NamedTuple

from nvray.step_protocol import SeqStep, StepInput


def is_held(s: SeqStep, held_rows: int) -> bool:
    """Whether ``s``'s chunk is held: a drafting sequence's newest token and drafts, in a state
    slot (start-up's made-up steps draft over whole prompts in no slot: not held)."""
    return bool(s.num_drafts) and s.state_slot >= 0 and len(s.token_ids) <= held_rows


class HeldChunk(NamedTuple):
    slot: int
    start: int  # the position of the chunk's first token
    rows: int  # its tokens


class HeldChunks:
    def __init__(self, held_rows: int) -> None:
        self.held_rows = held_rows
        self.held: dict[int, HeldChunk] = {}  # seq_id -> its held chunk

    def commits(self, step: StepInput) -> list[tuple[int, int, int]]:
        """``(slot, start, count)`` for each sequence of ``step`` whose held chunk's first
        ``count`` rows were kept (its chunk now starts ``count`` past the held one's)."""
        for seq_id in step.released:
            self.held.pop(seq_id, None)
        commits = []
        for s in step.seqs:
            chunk = self.held.pop(s.seq_id, None)
            if chunk is None:
                continue
            count = s.start_pos - chunk.start
            if chunk.slot == s.state_slot and 0 < count <= chunk.rows:
                commits.append((chunk.slot, chunk.start, count))
        return commits

    def record(self, step: StepInput) -> None:
        """The drafting sequences of ``step``, launched now: their chunks are held."""
        for s in step.seqs:
            if is_held(s, self.held_rows):
                self.held[s.seq_id] = HeldChunk(s.state_slot, s.start_pos, len(s.token_ids))

    def clear(self) -> None:
        self.held.clear()
