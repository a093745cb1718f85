"""The pooling routes over HTTP, transformers as the oracle (``pooling_checkpoints.py``): an app
of a random Qwen3 embedding checkpoint (its task found from the checkpoint) answers the openai
client's ``embeddings.create`` (base64, as the SDK asks by default, and float; text and
token-id inputs; ``dimensions``; ``usage``) with transformers' normalised last-token states;
an app of a reranker (``task=score``) answers Cohere-style ``/v1/rerank`` (best first,
``top_n``) and ``/v1/score`` with the yes/no softmax; each refuses the other tasks' routes with
a 400 naming its task, and the generation app refuses ``/v1/embeddings``."""

from __future__ import annotations

import openai
import pytest
import requests
import torch
from pooling_checkpoints import hf_last_state, hf_yes_probability, write_embedder, write_reranker
from ray import serve

from deployments import build_app
from nvray.pooling import reranker_prompt

TEXTS = ["What is the capital of France?", "Paris is the capital of France."]
CLOSE = {"atol": 1e-4, "rtol": 1e-3}


@pytest.fixture(scope="module")
def pooling_apps(serve_http, tmp_path_factory):
    embed_path = str(tmp_path_factory.mktemp("embedder"))
    rerank_path = str(tmp_path_factory.mktemp("reranker"))
    models = {"embed": write_embedder(embed_path), "score": write_reranker(rerank_path)}
    serve.run(build_app({"model": embed_path, "served_model_name": "embedder",
                         "dtype": "float32", "max_model_len": 512}),
              name="embedder", route_prefix="/embedder")
    serve.run(build_app({"model": rerank_path, "served_model_name": "reranker", "task": "score",
                         "dtype": "float32", "max_model_len": 512}),
              name="reranker", route_prefix="/reranker")
    yield {"embed": f"{serve_http}/embedder", "score": f"{serve_http}/reranker",
           "paths": {"embed": embed_path, "score": rerank_path}, "models": models}
    serve.delete("embedder")
    serve.delete("reranker")


def test_embeddings_with_the_openai_client(pooling_apps):
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{pooling_apps['embed']}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    model = pooling_apps["models"]["embed"]
    tok = AutoTokenizer.from_pretrained(pooling_apps["paths"]["embed"])
    ids = [tok(text)["input_ids"] for text in TEXTS]
    default = client.embeddings.create(model="embedder", input=TEXTS)  # base64 on the wire
    floats = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    short = client.embeddings.create(model="embedder", input=TEXTS[0], dimensions=8)
    by_ids = client.embeddings.create(model="embedder", input=ids[1])
    for i, token_ids in enumerate(ids):
        hf = hf_last_state(model, token_ids)
        for answer in (default, floats):
            assert answer.data[i].index == i
            torch.testing.assert_close(torch.tensor(answer.data[i].embedding), hf / hf.norm(),
                                       **CLOSE)
    hf0 = hf_last_state(model, ids[0])[:8]
    torch.testing.assert_close(torch.tensor(short.data[0].embedding), hf0 / hf0.norm(), **CLOSE)
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding),
                               torch.tensor(default.data[1].embedding), **CLOSE)
    assert default.usage.prompt_tokens == sum(map(len, ids)) == default.usage.total_tokens
    with pytest.raises(openai.BadRequestError) as too_wide:
        client.embeddings.create(model="embedder", input=TEXTS[0], dimensions=65)
    assert too_wide.value.body["param"] == "dimensions"


def test_rerank_and_score_with_the_yes_no_softmax(pooling_apps):
    from transformers import AutoTokenizer

    url, model = pooling_apps["score"], pooling_apps["models"]["score"]
    tok = AutoTokenizer.from_pretrained(pooling_apps["paths"]["score"])
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    query, docs = "capital of France", ["Paris is in France.", "Bananas are yellow.", "x"]
    expected = [hf_yes_probability(model, tok(reranker_prompt(query, d))["input_ids"], yes, no)
                for d in docs]
    ranked = requests.post(f"{url}/v1/rerank", json={"model": "reranker", "query": query,
                                                     "documents": docs, "top_n": 2}, timeout=60)
    assert ranked.status_code == 200, ranked.text
    results = ranked.json()["results"]
    best = sorted(range(len(docs)), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in results] == best
    for r in results:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
        assert r["document"]["text"] == docs[r["index"]]
    scored = requests.post(f"{url}/v1/score", json={"model": "reranker", "text_1": query,
                                                    "text_2": docs}, timeout=60)
    assert scored.status_code == 200, scored.text
    assert [d["score"] for d in scored.json()["data"]] == pytest.approx(expected, abs=1e-4)


def test_score_lists_pair_by_position_and_lists_of_two_lengths_are_a_400(pooling_apps):
    """``text_1`` and ``text_2`` lists of one length score pairwise (each pair as the one-text
    form scores it); lists of two lengths are refused naming both counts, not paired short."""
    url = pooling_apps["score"]
    firsts, seconds = ["capital of France", "a yellow fruit"], ["Paris is in France.", "Bananas."]
    pairwise = requests.post(f"{url}/v1/score", json={"model": "reranker", "text_1": firsts,
                                                      "text_2": seconds}, timeout=60)
    assert pairwise.status_code == 200, pairwise.text
    for (first, second), got in zip(zip(firsts, seconds), pairwise.json()["data"]):
        alone = requests.post(f"{url}/v1/score", json={"model": "reranker", "text_1": first,
                                                       "text_2": [second]}, timeout=60)
        assert got["score"] == pytest.approx(alone.json()["data"][0]["score"], abs=1e-5)
    for longer in (seconds + ["Grass is green."], seconds[:1]):
        refused = requests.post(f"{url}/v1/score", json={"model": "reranker", "text_1": firsts,
                                                         "text_2": longer}, timeout=60)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "text_2"
        assert f"text_1 has 2 texts and text_2 {len(longer)}" in error["message"]


def test_a_route_of_another_task_is_a_400_naming_the_models_task(pooling_apps, base_url):
    chat = {"model": "embedder", "messages": [{"role": "user", "content": "Hi"}]}
    refused = requests.post(f"{pooling_apps['embed']}/v1/chat/completions", json=chat, timeout=60)
    assert refused.status_code == 400 and "'embed'" in refused.json()["error"]["message"]
    embed = {"model": "reranker", "input": "Hi"}
    refused = requests.post(f"{pooling_apps['score']}/v1/embeddings", json=embed, timeout=60)
    assert refused.status_code == 400 and "'score'" in refused.json()["error"]["message"]
    refused = requests.post(f"{base_url}/v1/embeddings", json={"input": "Hi"}, timeout=60)
    assert refused.status_code == 400 and "'generate'" in refused.json()["error"]["message"]
    refused = requests.post(f"{pooling_apps['embed']}/v1/rerank",
                            json={"query": "a", "documents": ["b"]}, timeout=60)
    assert refused.status_code == 400 and "'embed'" in refused.json()["error"]["message"]
