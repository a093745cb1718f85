"""Pooling (``LLM.embed``, ``LLM.score``) against transformers' own model classes
(``pooling_checkpoints.py``): a random Qwen3 embedding checkpoint saved as Qwen3-Embedding's
are embeds to transformers' last hidden state of the prompt's last token (its tokenizer's EOS
included), L2-normalised (and truncated, with ``dimensions``), also beside generation in one
batch and from the prefix cache; a random Qwen3 causal LM whose tokenizer spells "yes" and "no"
as one token each scores documents as the reranker recipe does: the softmax of those two
logits at the prompt's end."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from pooling_checkpoints import hf_last_state, hf_yes_probability, write_embedder, write_reranker

from nvray import LLM, SamplingParams
from nvray.pooling import PoolingTask, reranker_prompt

TEXTS = ["What is the capital of France?", "Paris is the capital of France, " * 6, "Hi"]
CLOSE = {"atol": 2e-5, "rtol": 1e-4}


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("qwen3-embedding"))
    return path, write_embedder(path)


def test_embeddings_equal_transformers_last_token_states_normalised(embedder):
    from transformers import AutoTokenizer

    path, model = embedder
    assert PoolingTask.of(path) == PoolingTask("embed", normalize=True)
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, runtime="inprocess", dtype="float32", max_model_len=512)
    try:
        ours = llm.embed(TEXTS)
        short = llm.embed(TEXTS, dimensions=8)
        again = llm.embed(TEXTS[1])  # its blocks from the prefix cache this time
        # beside generation, in one batch: the same vector, the same tokens
        mixed = llm.generate([TEXTS[0], TEXTS[1]], [SamplingParams(max_tokens=0, pool=()),
                                                     SamplingParams(max_tokens=8, temperature=0)])
        alone = llm.generate([TEXTS[1]], SamplingParams(max_tokens=8, temperature=0))
    finally:
        llm.shutdown()
    for text, out, cut in zip(TEXTS, ours, short):
        ids = tok(text)["input_ids"]
        assert out.prompt_token_ids == ids and ids[-1] == 0  # ends with <|endoftext|>
        hf = hf_last_state(model, ids)
        torch.testing.assert_close(torch.tensor(out.embedding), hf / hf.norm(), **CLOSE)
        torch.testing.assert_close(torch.tensor(cut.embedding), hf[:8] / hf[:8].norm(), **CLOSE)
    torch.testing.assert_close(torch.tensor(again[0].embedding), torch.tensor(ours[1].embedding),
                               **CLOSE)
    hf0 = hf_last_state(model, ours[0].prompt_token_ids)
    torch.testing.assert_close(torch.tensor(mixed[0].pooled), hf0, **CLOSE)
    assert mixed[0].token_ids == [] and mixed[1].token_ids == alone[0].token_ids


def test_a_checkpoint_without_a_normalize_module_embeds_unnormalised(embedder, tmp_path):
    """modules.json without sentence-transformers' Normalize: the vectors are the last token's
    states as they are (what SentenceTransformer itself gives for such a checkpoint)."""
    from transformers import AutoTokenizer

    path, model = embedder
    plain = shutil.copytree(path, tmp_path / "unnormalised")
    with open(plain / "modules.json") as f:
        modules = [m for m in json.load(f) if not m["type"].endswith(".Normalize")]
    with open(plain / "modules.json", "w") as f:
        json.dump(modules, f)
    llm = LLM(str(plain), runtime="inprocess", dtype="float32", max_model_len=512)
    try:
        ours = llm.embed(TEXTS[:2])
    finally:
        llm.shutdown()
    tok = AutoTokenizer.from_pretrained(path)
    for text, out in zip(TEXTS, ours):
        hf = hf_last_state(model, tok(text)["input_ids"])
        assert abs(float(hf.norm()) - 1.0) > 0.1  # a norm a normalised vector would not have
        torch.testing.assert_close(torch.tensor(out.embedding), hf, **CLOSE)


def test_reranker_scores_equal_the_yes_no_softmax_of_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = str(tmp_path / "qwen3-reranker")
    model = write_reranker(path)
    assert PoolingTask.of(path).task == "generate"  # a causal LM: served as a reranker by choice
    tok = AutoTokenizer.from_pretrained(path)
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    query, docs = "capital of France", ["Paris is in France.", "Bananas are yellow.", "x"]
    llm = LLM(path, runtime="inprocess", dtype="float32", max_model_len=512)
    try:
        scores = llm.score(query, docs, instruction="Find the capital")
    finally:
        llm.shutdown()
    for doc, out in zip(docs, scores):
        ids = tok(reranker_prompt(query, doc, "Find the capital"))["input_ids"]
        assert out.prompt_token_ids == ids
        assert out.score == pytest.approx(hf_yes_probability(model, ids, yes, no), abs=1e-5)
    assert len({round(s.score, 6) for s in scores}) == len(docs)  # the documents differ
