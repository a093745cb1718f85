"""The step protocol: THE contract between the control plane and the model ranks.

Both sides import this module and nothing of each other: the engine (``nvray/engine``) builds a
``StepInput`` per step and hands it to an ``Executor``; the ranks (``nvray/worker``, behind
``nvray/runtime`` on Ray) run it and answer with a ``StepOutput``. The types are plain and
picklable: a ``StepInput`` pickles as plain tuples and lists, which is how it crosses to the Ray
ranks every step.

For each scheduled sequence: the tokens whose KV is computed this step, where they start,
its block table, and — when the step reaches the end of the sequence — how to sample its next
token.

A block table is flat: with windowed layers (``nvray/kv_layout.py``) it holds one entry per
block-table group for each logical block, entry ``b * num_groups + g``; -1 is a block a
windowed group gave back (never read; the ranks are not told, their stale entry is never read
either). Block tables travel as changes: the ranks keep each sequence's table from step to
step, and a ``SeqStep`` carries the entries from ``table_start`` on (0: the whole table; a
running sequence sends nothing most steps, new entries every ``block_size`` tokens). A step's ``released`` seq
ids are sequences whose blocks were freed (finished, preempted): the ranks drop their tables
first.

The ranks answer with one sampled token id per sequence that has a ``SampleSpec``, in order.

Speculative decoding (``nvray/speculative.py``): a ``SeqStep`` whose last ``num_drafts`` tokens
are drafts is sampled at each of its last ``num_drafts + 1`` positions, the j-th with the
sequence's ``SampleSpec`` at ``step_index + j``: it answers ``num_drafts + 1`` ids, in
position order (the engine keeps those its drafts confirm). With a draft model on the ranks
(``speculative_config`` method ``draft_model``: ``nvray/worker/drafter.py``) the drafts are
placeholders ``-1 - row``: ``row`` counts the step's model drafts in order (each drafting
sequence's, one after another), the drafter fills them on the device before the forward, and
the answer's ``drafts`` lists them all, by row, so the engine learns what was verified. The
drafter keeps its own cache (over the same blocks) and computes only what a ``SeqStep``'s
``draft_tokens`` give it, from position ``draft_start``: the tokens it lacks up to the newest
for a sequence with model drafts (then its last row proposes the first draft), or a chunk of
them for a sequence catching up before it drafts. A step the engine will draft from
(``answer_now``) is answered by the very call that hands it over, even to ranks that overlap
steps (the engine hands it over with nothing in flight): the next step's drafts follow the
tokens it keeps.

With overlapped steps a sequence's newest token may still be sampled by the step before this
one when this one is built: its id is then a placeholder ``-1 - row``, where ``row`` is the
sequence's row among that step's sampled ids; the ranks fill it in on the device (and count it
among the output tokens that penalties look at: ``Penalties.pending_row``).

Structured outputs: a constrained sequence's first ``SampleSpec`` carries its ``GrammarSpec``
(``grammar``, ``nvray/structured_outputs.py``); rank 0 keeps a matcher for it from then on
(``nvray/worker/grammar_masks.py``) and masks its row at every sample, until a step lists the
sequence in ``grammars_done``. A step's ``grammars`` are the grammars of requests just accepted,
for the ranks to start compiling; ``constrained`` says that some row has a matcher.

Log-probabilities: a ``SampleSpec`` with ``logprobs >= 0`` asks for the sampled token's
log-probability and the top ``logprobs``; a ``PromptScore`` asks for those of prompt tokens:
the first ``len(targets)`` rows of the sequence's chunk from ``offset`` on, each scored against
the prompt token that follows it. The ranks answer with a ``StepOutput``: the sampled ids, then
``logprobs`` rows — first one per sampling row that asked, in row order, then the score rows
of each sequence in step order.

Pooling: a ``SeqStep`` whose ``pool`` is not None is the chunk that ends its prompt; the ranks
answer with the final hidden state of its last row (``pool == ()``) or the logits of the
``pool`` token ids there, one ``StepOutput.pooled`` row per such sequence, in step order.

Recurrent state (models with linear-attention layers, ``nvray/layers/gated_deltanet.py``): a
running sequence holds one state slot (``SeqStep.state_slot``, from the engine's
``BlockManager``); a chunk that starts at position 0 starts from zero state, a later chunk
resumes from its slot. A step's ``state_copies`` (src, dst) copy whole slots before it runs (a
beam forked from another takes its parent's state).

Multi-LoRA (``nvray/lora``): a ``SeqStep``'s ``lora_slot`` is the GPU slot of the adapter its
tokens run through (-1: the base model); a step's ``lora_loads`` (slot, ``LoRAAdapter``) put
adapters into slots before it runs. A slot no running sequence uses may be reloaded while a step
that used it is still in flight: the ranks queue the load on the step's stream, after it.

``Executor`` is what runs steps for the engine: the in-process runner
(``nvray/worker/executor.py``) or the Ray rank group (``nvray/runtime/ray_executor.py``).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from nvray.model_facts import ModelFacts
from nvray.outputs import TokenLogprobs
from nvray.structured_outputs import GrammarSpec


class Penalties(NamedTuple):
    """What presence/frequency/repetition penalties need: the tokens seen so far, as the bytes
    of an int32 array (prompt, then the output tokens known on the host): one buffer per
    sequence, cheap to send and to gather on the rank."""

    presence: float
    frequency: float
    repetition: float
    tokens: bytes
    num_prompt_tokens: int
    pending_row: int  # >= 0: one more output token, that row of the previous step's ids


class SampleSpec(NamedTuple):
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    step_index: int  # number of output tokens before this one: seeds the per-token noise
    banned_token_ids: tuple[int, ...] = ()  # EOS/stop ids before min_tokens; bad words
    logprobs: int = -1  # >= 0: report the sampled token's log-probability and this many top
    penalties: Penalties | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    grammar: GrammarSpec | None = None  # the sequence's first sample only (see above)


class PromptScore(NamedTuple):
    """Score prompt tokens: rows ``offset .. offset + len(targets) - 1`` of the chunk."""

    num_logprobs: int
    offset: int
    targets: list[int]


class SeqStep(NamedTuple):
    seq_id: int
    token_ids: list[int]  # tokens computed this step (a negative id: see the module docstring)
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_table: list[int]  # the table's entries from table_start on
    sample: SampleSpec | None
    score: PromptScore | None = None
    table_start: int = 0  # 0: block_table is the whole table, else the ranks hold those before
    state_slot: int = -1  # models with recurrent layers: the sequence's state slot (-1: none)
    pool: tuple[int, ...] | None = None  # pool the chunk's last row (see the module docstring)
    num_drafts: int = 0  # speculation: the last this many token_ids are drafts (see above)
    lora_slot: int = -1  # multi-LoRA: its adapter's slot (see above)
    draft_start: int = -1  # model drafts: the drafter computes draft_tokens from here on
    draft_tokens: tuple[int, ...] = ()  # (see above)


@dataclass(frozen=True)
class StepInput:
    seqs: list[SeqStep] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy first
    released: list[int] = field(default_factory=list)  # seq ids whose tables the ranks drop first
    # whether some SampleSpec adjusts logits / asks for log-probabilities (build_step_input
    # sets them, so the ranks need not scan every spec each step; a hand-built step that uses
    # either must set them too)
    adjusts_logits: bool = False
    samples_logprobs: bool = False
    constrained: bool = False  # some sampling row follows a grammar
    grammars: list[GrammarSpec] = field(default_factory=list)  # of new requests: compile ahead
    grammars_done: list[int] = field(default_factory=list)  # seq ids whose matchers go
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) slots: first
    answer_now: bool = False  # speculation: its ids come back from this call (see above)
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)  # (slot, LoRAAdapter): first

    @property
    def num_samples(self) -> int:
        """Sampled rows: one per sequence with a ``SampleSpec``, one more per draft."""
        return sum(1 + s.num_drafts for s in self.seqs if s.sample is not None)

    def __reduce__(self) -> tuple:
        """Pickled as plain tuples and lists. Ray pickles with cloudpickle, whose per-object
        hook runs in Python for every NamedTuple (two per sequence: ~1 ms for 256 sequences,
        on the critical path of every step); plain tuples and lists take pickle's C fast path
        (~0.1 ms), and the rank rebuilds the NamedTuples without running their Python code."""
        seqs = [(s.seq_id, s.token_ids, s.start_pos, s.block_table,
                 None if s.sample is None else tuple(s.sample),
                 None if s.score is None else tuple(s.score), s.table_start, s.state_slot,
                 s.pool, s.num_drafts, s.lora_slot, s.draft_start, s.draft_tokens)
                for s in self.seqs]
        return _step_input_from_plain, (seqs, self.block_copies, self.released,
                                        self.adjusts_logits, self.samples_logprobs,
                                        self.constrained, self.grammars, self.grammars_done,
                                        self.state_copies, self.answer_now, self.lora_loads)


_namedtuple_of = tuple.__new__  # _namedtuple_of(Cls, plain_tuple): a Cls, built in C


def _step_input_from_plain(seqs: list[tuple], block_copies: list[tuple[int, int]],
                           released: list[int], adjusts_logits: bool,
                           samples_logprobs: bool, constrained: bool = False,
                           grammars: list[GrammarSpec] | None = None,
                           grammars_done: list[int] | None = None,
                           state_copies: list[tuple[int, int]] | None = None,
                           answer_now: bool = False,
                           lora_loads: list[tuple[int, Any]] | None = None) -> StepInput:
    """What ``StepInput.__reduce__`` pickled, back as a StepInput of NamedTuples."""
    steps = []
    for (seq_id, token_ids, start, table, sample, score, table_start, state_slot, pool, drafts,
         lora_slot, draft_start, draft_tokens) in seqs:
        if sample is not None:
            sample = _namedtuple_of(SampleSpec, sample)
        if score is not None:
            score = _namedtuple_of(PromptScore, score)
        steps.append(_namedtuple_of(SeqStep, (seq_id, token_ids, start, table, sample, score,
                                              table_start, state_slot, pool, drafts,
                                              lora_slot, draft_start, draft_tokens)))
    return StepInput(steps, block_copies, released, adjusts_logits, samples_logprobs,
                     constrained, grammars or [], grammars_done or [], state_copies or [],
                     answer_now, lora_loads or [])


class StepOutput(NamedTuple):
    """What rank 0 answers for a step (other ranks: empty)."""

    ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # see the module docstring for the order
    pooled: list[list[float]] | None = None  # one row per pooled sequence, in step order
    drafts: list[int] | None = None  # model drafts, by placeholder row (see the docstring)


def sample_specs(step: StepInput, model_drafts: list[int] | None = None) -> list[SampleSpec]:
    """The ``SampleSpec`` of each sampled row, in row order (a speculating sequence's j-th draft
    position at ``step_index + j``, its penalties counting drafts 1..j as output: a token kept
    there follows them; ``model_drafts``: the ranks' drafter's ids, which draft placeholders
    name)."""
    specs = []
    for s in step.seqs:
        if s.sample is None:
            continue
        specs.append(s.sample)
        penalties = s.sample.penalties
        for j in range(1, s.num_drafts + 1):
            spec = s.sample._replace(step_index=s.sample.step_index + j)
            if penalties is not None:
                drafts = s.token_ids[len(s.token_ids) - s.num_drafts:][:j]
                if drafts[0] < 0:  # placeholders: the drafter's
                    assert model_drafts is not None, "model drafts without the drafter's ids"
                    drafts = [model_drafts[placeholder_row(d)] for d in drafts]
                spec = spec._replace(penalties=penalties._replace(
                    tokens=penalties.tokens + array("i", drafts).tobytes()))
            specs.append(spec)
    return specs


def placeholder_id(row: int) -> int:
    """The id standing for the token sampled at ``row`` of the previous step."""
    return -1 - row


def placeholder_row(token_id: int) -> int:
    return -1 - token_id


class Executor(Protocol):
    """Runs steps on the model ranks; what ``LLMEngine`` and ``bootstrap`` rely on."""

    num_blocks: int  # KV cache blocks every rank holds (the minimum over the ranks)
    facts: ModelFacts  # what the loaded model is, as rank 0 found it (``nvray/model_facts.py``)

    def execute(self, step: StepInput) -> StepOutput:
        """Run ``step`` to completion; rank 0's answer."""

    def execute_overlapped(self, step: StepInput | None) -> StepOutput | None:
        """Launch ``step`` (None: nothing new); return the answer of the step launched before
        (None if there was none), or ``step``'s own if it is to ``answer_now``."""

    def submit(self, step: StepInput) -> None:
        """Pipeline stages (the Ray executor): hand the ranks ``step`` without waiting."""

    def collect(self) -> StepOutput:
        """Pipeline stages: the answer of the oldest step submitted and not yet collected."""

    def discard_in_flight(self) -> None:
        """Forget launched steps whose answers were not read (the engine failed its requests)."""

    def check_health(self) -> None:
        """Raise if the ranks can no longer run steps."""

    def expert_load(self) -> list[list[int]]:
        """Per rank, the (token, expert) pairs each of its experts computed since start-up
        (expert parallel; empty lists otherwise); an empty list where the ranks cannot say."""

    def idle(self) -> None:
        """Nothing is in flight and nothing waits: the ranks may stop polling for steps (the
        next step wakes them)."""

    def shutdown(self) -> None:
        """Stop the ranks and free their memory; the executor is unusable after."""
