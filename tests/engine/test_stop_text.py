"""A stop token ends the text before it: the token stays in ``token_ids`` and its text is not
in ``text`` (vLLM's semantics), whether the text is decoded at the end or token by token."""

from __future__ import annotations

import pytest

from nvray import SamplingParams
from tiny_engines import tiny_inprocess

PROMPT = "Scoring the engine's prompt"


@pytest.fixture(scope="module")
def llm():
    llm = tiny_inprocess()
    yield llm
    llm.shutdown()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def first_whole_new_token(llm, ids: list[int]) -> int:
    """The first output position after two whose token is new and adds whole characters."""
    texts = [llm.tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    return next(k for k in range(2, len(ids)) if ids[k] not in ids[:k]
                and texts[k + 1].startswith(texts[k]) and len(texts[k + 1]) > len(texts[k])
                and "\ufffd" not in texts[k + 1][len(texts[k]):])


# an unmatched stop string makes the engine decode the text token by token
@pytest.mark.parametrize("stop", [(), ("never in the output",)], ids=["at-the-end", "per-token"])
def test_a_stop_token_ids_text_is_not_in_the_output_text(llm, stop):
    ids = llm.generate(PROMPT, greedy(16, ignore_eos=True), use_tqdm=False)[0].token_ids
    k = first_whole_new_token(llm, ids)
    before = llm.generate(PROMPT, greedy(k, ignore_eos=True), use_tqdm=False)[0]
    out = llm.generate(PROMPT, greedy(16, stop_token_ids=[ids[k]], stop=list(stop)),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[:k + 1]
    assert out.text == before.text
    assert not out.text.endswith(llm.tokenizer.decode([ids[k]]))
