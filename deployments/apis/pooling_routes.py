"""Pooling routes, a route group of NvrayServer (``deployments/ingress/server.py``): OpenAI's
``/v1/embeddings``, Cohere's and Jina's rerank, vLLM's score. Prefill only, batched with whatever
else the engine runs; request and answer shapes in ``deployments/apis/pooling_api.py``, the
engine's side in ``nvray/pooling.py``.

A mixin: it uses the server's plumbing (``_authorize``, ``_check_model``, ``_require``,
``_finals``, ``_spelling``) and its ``model_name`` and ``normalize``.

No ``from __future__ import annotations`` (FastAPI reads the route annotations)."""

from fastapi import Request
from fastapi.responses import JSONResponse

from deployments.ingress.http_app import api
from deployments.apis.pooling_api import (EmbeddingRequest, RerankRequest, ScoreRequest,
                                     embeddings_body, rerank_body, score_body)
from nvray.outputs import RequestOutput
from nvray.pooling import (RERANK_TOKENS, embed_params, rerank_token_ids, reranker_prompt,
                           score_params)


class PoolingRoutes:
    @api.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest, request: Request) -> JSONResponse:
        """OpenAI's embeddings (``deployments/apis/pooling_api.py``): prefill only, batched with
        whatever else the engine runs."""
        self._authorize(request)
        self._check_model(body.model)
        self._require("embed", request)
        outputs = await self._finals(body.prompts(), embed_params(), body.priority)
        return JSONResponse(embeddings_body(self.model_name, body, outputs, self.normalize))

    @api.post("/v1/rerank")
    @api.post("/v2/rerank")
    @api.post("/rerank")
    async def rerank(self, body: RerankRequest, request: Request) -> JSONResponse:
        """Cohere's and Jina's rerank: each document judged against the query."""
        prompts = [reranker_prompt(body.query, text, body.instruction) for text in body.texts()]
        outputs = await self._scores(body.model, request, prompts, body.priority)
        return JSONResponse(rerank_body(self.model_name, body, outputs))

    @api.post("/v1/score")
    @api.post("/score")
    async def score(self, body: ScoreRequest, request: Request) -> JSONResponse:
        """vLLM's score: each (text_1, text_2) pair judged as (query, document)."""
        prompts = [reranker_prompt(q, d, body.instruction) for q, d in body.pairs()]
        outputs = await self._scores(body.model, request, prompts, body.priority)
        return JSONResponse(score_body(self.model_name, outputs))

    async def _scores(self, model: str | None, request: Request, prompts: list[str],
                      priority: int) -> list[RequestOutput]:
        self._authorize(request)
        self._check_model(model)
        self._require("score", request)
        yes_no = rerank_token_ids([await self._spelling(word) for word in RERANK_TOKENS])
        return await self._finals(prompts, score_params(*yes_no), priority)
