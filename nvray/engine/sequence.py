"""Sequence: one request's tokens, KV block table and progress through prefill and decode.

``num_computed_tokens`` counts the tokens whose KV is in the cache or being written by a launched
step; it advances chunk by chunk, so prefill can be split over steps and resumed after preemption.

``token_ids`` holds the tokens known on the host. With overlapped steps a sequence also has
``num_pending`` tokens (0, 1 or 2) that launched steps are sampling on the device: they count in
``num_tokens`` (the scheduler plans with them) but not in ``token_ids``; ``pending_row`` is the
row of the newest one among its step's sampled ids, which the next step reads on the device.
A sequence ``fork_of`` another (a request's choice after the first) takes that one's prompt
KV blocks instead of prefilling them itself.
A sequence that ``waits_for_tokens`` (what it samples next depends on its newest token on the
host, e.g. multi-token bad words) is not scheduled while a token is pending.

Beside it, the engine's state of the same sequence: its ``SeqPlan`` (what shapes its steps,
fixed at admission, with the ``FixedSampling`` values every ``SampleSpec`` repeats; read by
``step_builder.py``), and the ``RequestState`` of the request's choice it is (its text,
detokenizer and outputs so far; ``output_processor.py``).
"""

from __future__ import annotations

import enum
import itertools
from array import array
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from nvray.engine.detokenizer import IncrementalDetokenizer
from nvray.outputs import TokenLogprobs
from nvray.sampling_params import SamplingParams
from nvray.structured_outputs import GrammarSpec


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = ("seq_id", "request_id", "token_ids", "num_prompt_tokens", "params",
                 "status", "block_table", "num_computed_tokens", "num_cached_tokens",
                 "arrival_time", "first_scheduled", "priority", "finish_reason", "num_preemptions",
                 "index", "fork_of", "shares_blocks", "history", "num_pending", "pending_row", "waits_for_tokens",
                 "ranks_table_len", "state_slot", "state_save_at", "drafts", "draft_pace",
                 "draft_len", "draft_feed", "num_draft_tokens", "num_accepted_drafts", "lora", "lora_slot")

    _counter = itertools.count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float = 0.0, priority: int = 0) -> None:
        assert prompt_token_ids, "a sequence needs at least one prompt token"
        self.seq_id = next(Sequence._counter)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.ranks_table_len = 0  # leading block_table entries the ranks hold (step_protocol.py)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.arrival_time = arrival_time
        self.first_scheduled: float | None = None  # when it first ran (the scheduler's clock)
        self.priority = priority
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.index = 0  # the choice's index among its request's n
        self.fork_of: Sequence | None = None  # shares that sequence's prompt KV (see Scheduler)
        self.shares_blocks = False  # forked, or forked from: may write into a shared block
        self.history: array | None = None  # token ids as int32 (penalized requests: see Penalties)
        self.num_pending = 0
        self.pending_row = -1
        self.waits_for_tokens = False
        self.state_slot = -1  # recurrent-state slot while it holds blocks (BlockManager)
        self.state_save_at = -1  # where its state is kept for prefix caching (BlockManager)
        self.drafts: list[int] = []  # speculation: tokens proposed to follow (nvray/speculative.py)
        self.draft_pace: Any = None  # speculation: its DraftPace (nvray/engine/speculation.py)
        # a draft model on the ranks (nvray/engine/speculation.py): the draft cache holds its
        # tokens before draft_len; the next step feeds it draft_feed tokens from there
        self.draft_len = 0
        self.draft_feed = 0
        self.num_draft_tokens = 0  # speculation: drafts verified for it, and of them accepted
        self.num_accepted_drafts = 0
        self.lora: Any = None  # multi-LoRA: its LoRAAdapter (nvray/lora), None: the base model
        self.lora_slot = -1  # ... and the GPU slot it holds while running (LoRASlots)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus those being sampled (what the scheduler plans with)."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known on the host."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


class FixedSampling(NamedTuple):
    """The sampling values of a sequence that every one of its ``SampleSpec``s repeats."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None

    @classmethod
    def of(cls, params: SamplingParams) -> "FixedSampling":
        return cls(params.temperature, params.top_p, params.top_k, params.min_p, params.seed)


@dataclass
class SeqPlan:
    """What shapes a sequence's steps, fixed at admission (the parts of its SampleSpecs that
    never change are computed once), except ``num_scored``: prompt positions whose scoring was
    launched."""

    stop_ids: tuple[int, ...]  # EOS (unless ignore_eos) and stop_token_ids
    fixed: FixedSampling
    bad_words: tuple[tuple[int, ...], ...] = ()  # token ids of each bad word
    num_scored: int = 0
    min_tokens: int = 0
    logprobs: int = -1
    adjusts_logits: bool = False
    grammar: GrammarSpec | None = None  # structured outputs: the ranks keep a matcher
    grammar_sent: bool = False  # the ranks got the grammar with an earlier sample

    @classmethod
    def of(cls, params: SamplingParams, stop_ids: tuple[int, ...],
           bad_words: tuple[tuple[int, ...], ...] = ()) -> "SeqPlan":
        return cls(stop_ids, FixedSampling.of(params), bad_words, min_tokens=params.min_tokens,
                   logprobs=-1 if params.logprobs is None else params.logprobs,
                   adjusts_logits=params.adjusts_logits)


@dataclass
class RequestState:
    """One choice of a request, from intake to its final output."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    plan: SeqPlan
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool = False  # emit an output every step, not only the final one
    text: str = ""
    num_text_tokens: int = 0  # output tokens given to the detokenizer
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop_token_ids id that ended it
    error: str | None = None
    timestamps: list[float] = field(default_factory=list)  # one per generated token
    logprobs: list[TokenLogprobs] | None = None  # one per output token, if asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (first: None)
    pooled: list[float] | None = None  # a pooling request's row (SamplingParams.pool)
