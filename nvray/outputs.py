"""RequestOutput: what a request gives back, as a streaming delta or a final result.

Plain data (picklable, no torch) so it crosses Ray actor boundaries unchanged. Between the
engine's driver and its consumers a step's outputs travel in a compact wire form
(``to_wire``/``from_wire``): an unfinished request's delta is a small tuple, a finished
request's output the whole RequestOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Union

FINISH_REASONS = ("stop", "length", "abort", "error")


class TokenLogprobs(NamedTuple):
    """One token's log-probability, and the most likely tokens' at its position."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RequestOutput:
    """A request's result, or one streaming step of it.

    ``delta_text``/``delta_token_ids`` are what this output added. The final output
    (``finished``) also carries everything: ``text``/``token_ids`` (all the generated text and
    tokens), ``prompt_token_ids`` and ``prompt``. Intermediate streaming outputs carry only the
    deltas (the other fields stay empty), so a step never copies whole sequences; the deltas of
    all outputs of a request concatenate to its final ``text``/``token_ids``.
    ``finish_reason`` is None until ``finished``.

    Log-probabilities (when the request asked, see ``SamplingParams``): ``logprobs`` has one
    ``TokenLogprobs`` (the token's log-probability and the top ones at its position: ids and
    log-probabilities) per token of ``token_ids``, ``delta_logprobs`` one per delta token;
    ``prompt_logprobs`` one per prompt token, None for the first (in the final output, and in
    a stream's first output). ``index`` is the choice's index among a request's ``n``.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    # what stopped it, as vLLM reports: the stop string matched or the stop_token_ids id
    # sampled (None: EOS, a length limit, or not finished)
    stop_reason: str | int | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    prompt: str | None = None
    index: int = 0
    logprobs: list[TokenLogprobs] | None = None
    delta_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cumulative_logprob: float | None = None  # a beam search's result: its beam's score basis
    # a pooling request's (SamplingParams.pool): the last prompt token's final hidden state,
    # or the pooled token ids' logits there (nvray/pooling.py turns it into an embedding/score)
    pooled: list[float] | None = None
    # speculative decoding (the final output): drafts verified for this choice, and of them
    # accepted (nvray/speculative.py); the OpenAI usage's accepted/rejected_prediction_tokens
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def usage(self) -> dict[str, int]:
        prompt_tokens = len(self.prompt_token_ids)
        completion_tokens = len(self.token_ids)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}


# (request_id, delta_token_ids, delta_text): an unfinished request's step on the wire
WireDelta = tuple[str, list[int], str]
WireOutput = Union[WireDelta, RequestOutput]


def to_wire(out: RequestOutput) -> WireOutput:
    """The compact form of ``out`` for one step's message (a tuple unless it is final or
    carries more than tokens and text)."""
    if out.finished or out.delta_logprobs or out.prompt_logprobs or out.index:
        return out
    return (out.request_id, out.delta_token_ids, out.delta_text)


def from_wire(item: WireOutput) -> RequestOutput:
    if isinstance(item, RequestOutput):
        return item
    request_id, token_ids, text = item
    return RequestOutput(request_id, [], delta_text=text, delta_token_ids=token_ids)


def coalesce(outputs: list[RequestOutput]) -> RequestOutput:
    """One output standing for consecutive outputs of one request: deltas concatenated, the
    rest (final text, finish reason, ...) from the last. A reader that fell behind gets one."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    merged = RequestOutput(**{**last.__dict__})
    merged.delta_text = "".join(o.delta_text for o in outputs)
    merged.delta_token_ids = [t for o in outputs for t in o.delta_token_ids]
    if any(o.delta_logprobs for o in outputs):
        merged.delta_logprobs = [lp for o in outputs for lp in o.delta_logprobs or ()]
    with_prompt = next((o for o in outputs if o.prompt_logprobs), None)
    if with_prompt is not None:  # the first output of a stream: the prompt's ids and scores
        merged.prompt_logprobs = with_prompt.prompt_logprobs
        merged.prompt_token_ids = merged.prompt_token_ids or with_prompt.prompt_token_ids
    return merged
