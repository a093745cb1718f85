"""RequestOutput: what a request gives back, as a streaming delta or a final result.

Plain data (picklable, no torch) so it crosses Ray actor boundaries unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class RequestOutput:
    """A request's result, or one streaming step of it.

    ``delta_text``/``delta_token_ids`` are what this step added. ``text``/``token_ids`` (all
    the generated text and tokens) are filled in the final output (``finished``), and left empty
    in intermediate streaming outputs so a step never copies whole sequences; the deltas of all
    outputs of a request concatenate to its final ``text``/``token_ids``.
    ``finish_reason`` is None until ``finished``.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    prompt: str | None = None

    @property
    def usage(self) -> dict[str, int]:
        prompt_tokens = len(self.prompt_token_ids)
        completion_tokens = len(self.token_ids)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}
