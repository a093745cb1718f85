"""Pooling (``LLM.embed``, ``LLM.score``) against transformers' own model classes: a random
Qwen3 embedding checkpoint saved as Qwen3-Embedding's are (a bare ``Qwen3Model`` with
sentence-transformers' last-token Pooling and Normalize modules) embeds to transformers' last
hidden state of the prompt's last token, L2-normalised (and truncated, with ``dimensions``),
also beside generation in one batch and from the prefix cache; a random Qwen3 causal LM whose
tokenizer spells "yes" and "no" as one token each scores documents as the reranker recipe does:
the softmax of those two logits at the prompt's end."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from nvray import LLM, SamplingParams
from nvray.models.tiny import resolve_model
from nvray.pooling import PoolingTask, reranker_prompt

SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 1024, "tie_word_embeddings": False}
TEXTS = ["What is the capital of France?", "Paris is the capital of France, " * 6, "Hi"]


def _tokenizer_files(path: str) -> None:
    tiny = resolve_model("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(tiny, name)):
            shutil.copy(os.path.join(tiny, name), os.path.join(path, name))


def _randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    from transformers import Qwen3Config, Qwen3Model

    path = str(tmp_path_factory.mktemp("qwen3-embedding"))
    config = Qwen3Config(vocab_size=512, **SHAPE)
    model = _randomized(Qwen3Model(config), seed=3)
    model.save_pretrained(path)  # as AutoModel saves it: "Qwen3Model", no LM head, no "model."
    _tokenizer_files(path)
    _end_with_eos(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], f)
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True,
                   "pooling_mode_mean_tokens": False}, f)
    return path, model


def _end_with_eos(tokenizer_json: str) -> None:
    """The tokenizer appends <|endoftext|> to a text, as Qwen3-Embedding's does."""
    with open(tokenizer_json) as f:
        spec = json.load(f)
    eos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, eos],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                 eos],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                             "tokens": ["<|endoftext|>"]}}}
    with open(tokenizer_json, "w") as f:
        json.dump(spec, f)


def _hf_embedding(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        last = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return last


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
        hf = _hf_embedding(model, ids)
        torch.testing.assert_close(torch.tensor(out.embedding), hf / hf.norm(),
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(cut.embedding), hf[:8] / hf[:8].norm(),
                                   atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(again[0].embedding), torch.tensor(ours[1].embedding),
                               atol=2e-5, rtol=1e-4)
    hf0 = _hf_embedding(model, ours[0].prompt_token_ids)
    torch.testing.assert_close(torch.tensor(mixed[0].pooled), hf0, atol=2e-5, rtol=1e-4)
    assert mixed[0].token_ids == [] and mixed[1].token_ids == alone[0].token_ids


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    path = str(tmp_path_factory.mktemp("qwen3-reranker"))
    _tokenizer_files(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["yes", "no"])  # Qwen's vocabulary has each as one token
    tok.save_pretrained(path)
    config = Qwen3Config(vocab_size=len(tok), **SHAPE)
    config.architectures = ["Qwen3ForCausalLM"]
    model = _randomized(Qwen3ForCausalLM(config), seed=5)
    model.save_pretrained(path)
    return path, model


def test_reranker_scores_equal_the_yes_no_softmax_of_transformers(reranker):
    from transformers import AutoTokenizer

    path, model = reranker
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
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        expected = torch.softmax(logits[[yes, no]], dim=0)[0].item()
        assert out.score == pytest.approx(expected, abs=1e-5)
    assert len({round(s.score, 6) for s in scores}) == len(docs)  # the documents differ
