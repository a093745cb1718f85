"""The pooling routes' requests and answers: ``POST /v1/embeddings`` (OpenAI's shape),
``POST /v1/rerank`` (Cohere's and Jina's shape; also ``/rerank`` and ``/v2/rerank``) and
``POST /v1/score`` (vLLM's; also ``/score``).

- **Embeddings**: ``input`` one text, a list of texts, token ids or a list of token-id lists
  (each a prompt of its own); ``dimensions`` keeps the first values of each vector
  (Matryoshka), normalised again; ``encoding_format`` ``float`` (lists) or ``base64`` (the
  little-endian float32 bytes, what the openai SDK asks for by default); ``usage`` counts the
  prompt tokens. The vectors are ``nvray/pooling.py``'s (last-token pooling, L2-normalised
  when the checkpoint normalises).
- **Rerank**: ``query`` against ``documents`` (texts, or objects with ``text``), each scored by
  the reranker (``nvray/pooling.py``: the probability of "yes"); ``results`` best first, the
  top ``top_n``, each with its ``index`` in ``documents``, its ``relevance_score`` and, unless
  ``return_documents`` is false, the document; ``instruction`` (nvray's) replaces the
  reranker's default task.
- **Score**: ``text_1`` against ``text_2``: one against many, or pairwise lists of one length;
  ``data`` one score per pair, in order.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any, Literal

from pydantic import Field, StrictInt

from deployments.apis.openai_api import StrictModel, UnsupportedParameter
from nvray.outputs import RequestOutput
from nvray.pooling import to_embedding, to_score

TokenIds = list[StrictInt]


class EmbeddingRequest(StrictModel):
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    priority: StrictInt = 0

    def prompts(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]  # type: ignore[list-item]
        if not value or any(len(p) == 0 for p in value):  # type: ignore[arg-type]
            raise UnsupportedParameter("input", "input is empty (give at least one non-empty "
                                                "text or token list)")
        return list(value)  # type: ignore[arg-type]


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embeddings_body(model: str, request: EmbeddingRequest, outputs: list[RequestOutput],
                    normalize: bool) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i,
             "embedding": _encoded(to_embedding(o.pooled or [], request.dimensions, normalize),
                                   request.encoding_format)}
            for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class Document(StrictModel):
    text: str


class RerankRequest(StrictModel):
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | Document] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    instruction: str | None = None
    priority: StrictInt = 0

    def texts(self) -> list[str]:
        texts = [d if isinstance(d, str) else d.text for d in self.documents]
        for i, text in enumerate(texts):
            if not text:
                raise UnsupportedParameter(f"documents.{i}", f"documents.{i} is empty")
        return texts


def rerank_body(model: str, request: RerankRequest, outputs: list[RequestOutput]
                ) -> dict[str, Any]:
    texts = request.texts()
    ranked = sorted(range(len(outputs)), key=lambda i: -to_score(outputs[i].pooled or [0, 0]))
    results = []
    for i in ranked[:request.top_n or len(ranked)]:
        result: dict[str, Any] = {"index": i,
                                  "relevance_score": to_score(outputs[i].pooled or [0, 0])}
        if request.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
            "usage": {"total_tokens": tokens}}


class ScoreRequest(StrictModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None
    priority: StrictInt = 0

    def pairs(self) -> list[tuple[str, str]]:
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not firsts or not seconds:
            raise UnsupportedParameter("text_1" if not firsts else "text_2", "no text to score")
        if len(firsts) == 1:
            return [(firsts[0], s) for s in seconds]
        if len(firsts) != len(seconds):
            raise UnsupportedParameter("text_2", f"text_1 has {len(firsts)} texts and text_2 "
                                       f"{len(seconds)}: give one text_1, or lists of one length")
        return list(zip(firsts, seconds))


def score_body(model: str, outputs: list[RequestOutput]) -> dict[str, Any]:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model,
            "data": [{"index": i, "object": "score", "score": to_score(o.pooled or [0, 0])}
                     for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                      "completion_tokens": 0}}
