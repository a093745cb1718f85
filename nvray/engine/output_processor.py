"""Output processing: what a sampled token does to its request, and what the user sees.

``append_token`` adds a choice's new token, applies the stop rules (stop ids after
``min_tokens``, stop strings, ``max_tokens``, ``max_model_len``) and sets ``finish_reason``
(and ``stop_reason``: the stop string, or the request's stop token id, that ended it);
``make_output`` builds the ``RequestOutput`` to send: the deltas since the last output (a
streaming step) or the whole result (the final one).

Text: a request that streams or has stop strings is detokenized token by token; any other is
detokenized once, when it finishes (the per-token cost only where someone reads it). A
streaming output holds back the last ``max_stop_len - 1`` characters, which a stop string
completed later may still cut.

A choice's state is its ``RequestState`` (``sequence.py``).
"""

from __future__ import annotations

from nvray.engine.sequence import RequestState
from nvray.outputs import RequestOutput


def append_token(state: RequestState, token: int, now: float, max_model_len: int) -> None:
    """Add a sampled token to the choice; set ``finish_reason`` if a stop rule ends it."""
    seq, params = state.seq, state.seq.params
    seq.token_ids.append(token)
    if seq.history is not None:
        seq.history.append(token)
    state.timestamps.append(now)
    num_tokens = len(seq.token_ids)
    num_output = num_tokens - seq.num_prompt_tokens
    can_stop = num_output >= params.min_tokens
    if can_stop and token in state.plan.stop_ids:
        state.finish_reason = "stop"  # the stop token stays in token_ids, not in text
        if token in params.stop_token_ids:  # the request's own (EOS: None, as vLLM)
            state.stop_reason = token
        complete_text(state, num_output - 1, flush=True)
        return
    if state.stream or params.stop:  # someone reads the text before the end: as it comes
        prev_len = len(state.text)
        complete_text(state, num_output, flush=False)
        if can_stop and params.stop and _apply_stop_strings(state, prev_len):
            state.finish_reason = "stop"
            return  # text is cut at the stop string: nothing held back matters
    if num_output >= params.max_tokens or num_tokens >= max_model_len:
        state.finish_reason = "length"
        complete_text(state, num_output, flush=True)


def complete_text(state: RequestState, num_tokens: int, flush: bool) -> None:
    """Detokenize the first ``num_tokens`` output tokens (those not yet done); ``flush``:
    also what the detokenizer holds back (the request is finishing)."""
    seq = state.seq
    if num_tokens > state.num_text_tokens:
        start = seq.num_prompt_tokens
        state.text += state.detokenizer.add_tokens(
            seq.token_ids[start + state.num_text_tokens:start + num_tokens])
        state.num_text_tokens = num_tokens
    if flush:
        state.text += state.detokenizer.flush()


def _apply_stop_strings(state: RequestState, prev_len: int) -> bool:
    """Cut ``state.text`` at the first stop string that the new text completed."""
    params = state.seq.params
    start = max(0, prev_len - params.max_stop_len + 1)
    hits = [(at, stop) for stop in params.stop if (at := state.text.find(stop, start)) >= 0]
    if not hits:
        return False
    at, stop = min(hits)
    state.stop_reason = stop
    state.text = state.text[:at + len(stop) if params.include_stop_str_in_output else at]
    return True


def make_output(state: RequestState) -> RequestOutput:
    """The choice's next output: everything if it finished, else the deltas since the last."""
    seq = state.seq
    finished = state.finish_reason is not None
    hold = 0 if finished else max(0, seq.params.max_stop_len - 1)
    visible = max(state.num_emitted_chars, len(state.text) - hold)
    num_tokens = seq.num_output_tokens
    delta_text = state.text[state.num_emitted_chars:visible]
    delta_token_ids = seq.token_ids[seq.num_prompt_tokens + state.num_emitted_tokens:]
    if finished:
        out = RequestOutput(
            request_id=seq.request_id, index=seq.index, prompt_token_ids=state.prompt_token_ids,
            text=state.text, token_ids=seq.output_token_ids, delta_text=delta_text,
            delta_token_ids=delta_token_ids, finished=True, finish_reason=state.finish_reason,
            stop_reason=state.stop_reason, error=state.error,
            num_cached_tokens=seq.num_cached_tokens, prompt=state.prompt, logprobs=state.logprobs,
            prompt_logprobs=state.prompt_logprobs, pooled=state.pooled,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_draft_tokens=seq.num_accepted_drafts)
    else:  # a streaming step: the deltas only
        out = RequestOutput(seq.request_id, [], delta_text=delta_text,
                            delta_token_ids=delta_token_ids, index=seq.index)
        if state.num_emitted_tokens == 0 and state.prompt_logprobs is not None:
            out.prompt_logprobs = state.prompt_logprobs  # the first output: the prompt's
            out.prompt_token_ids = state.prompt_token_ids
    if state.logprobs is not None:
        out.delta_logprobs = state.logprobs[state.num_emitted_tokens:num_tokens]
    state.num_emitted_chars = visible
    state.num_emitted_tokens = num_tokens
    return out
