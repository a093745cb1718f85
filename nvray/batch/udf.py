"""GenerateBatch: the Ray Data callable class of ``python -m nvray.batch``; one engine per actor.

Contract:

- Each pool actor starts one whole nvray engine with ``start_engine(config)`` — an
  EngineDriver and its rank actors in their own placement group — and owns its EngineClient.
  The actor itself asks Ray Data for no CPU, so it never competes with its engine's bundles.
- ``__call__`` takes a pyarrow batch of input rows (``id``, ``prompt``, ``messages``,
  ``response_format``: the row's own structured output in place of the job's), sends all
  its requests to the driver at once (so the engine batches them; their final outputs come back
  over the client's output channel, one message per engine step), and returns one output row
  per input row, in order: ``id``, ``text``, ``finish_reason``, ``prompt_tokens``,
  ``completion_tokens``, ``error``; for an embedding job (its sampling parameters pool):
  ``id``, ``embedding``, ``prompt_tokens``, ``error``.
- A request the engine rejects (``ValueError``: prompt too long, empty, ...) or that fails in
  any other way gives a row with a short ``error`` and null text/token counts; the job goes
  on. If the engine itself dies (a rank or the driver lost), the actor starts a new engine — at
  most ``max_engine_restarts`` times — and retries the failed rows once on it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pyarrow as pa
import ray

from nvray.batch.io import output_schema, row_constraint
from nvray.config import EngineConfig
from nvray.lora.request import LoRARequest
from nvray.models.tiny import TINY_NAME, tiny_model_path
from nvray.pooling import PoolingTask, to_embedding
from nvray.runtime import EngineDeadError, start_engine
from nvray.sampling_params import SamplingParams

_MAX_ERROR_CHARS = 300


def row_prompt(row: dict[str, Any]) -> str | list[dict[str, str]]:
    """The driver prompt of an input row: its string, or its chat messages without nulls."""
    if row.get("prompt") is not None:
        return row["prompt"]
    return [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]


def short_error(exc: BaseException) -> str:
    """``Type: message`` of the original exception (unwrapping Ray's), first line, capped."""
    cause = getattr(exc, "cause", None)  # RayTaskError keeps the exception raised remotely
    exc = cause if isinstance(cause, BaseException) else exc
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS - 3] + "..."


def is_engine_failure(exc: BaseException) -> bool:
    """True when the engine (not the request) failed: retrying on a new engine may help."""
    return isinstance(exc, (EngineDeadError, ray.exceptions.RayActorError))


def result_row(row_id: Any, result: Any) -> dict[str, Any]:
    """An output row from a RequestOutput or the exception its request raised."""
    if isinstance(result, BaseException):
        return {"id": row_id, "text": None, "finish_reason": None, "prompt_tokens": None,
                "completion_tokens": None, "error": short_error(result)}
    usage = result.usage
    return {"id": row_id, "text": result.text, "finish_reason": result.finish_reason,
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"], "error": None}


def embedding_row(row_id: Any, result: Any, dimensions: int | None,
                  normalize: bool = True) -> dict[str, Any]:
    """An embedding job's output row from a RequestOutput or its request's exception
    (``normalize``: the checkpoint's, ``PoolingTask``)."""
    if not isinstance(result, BaseException):
        try:
            return {"id": row_id, "embedding": to_embedding(result.pooled or [], dimensions,
                                                            normalize),
                    "prompt_tokens": len(result.prompt_token_ids), "error": None}
        except ValueError as e:  # --dimensions wider than the model's hidden size
            result = e
    return {"id": row_id, "embedding": None, "prompt_tokens": None,
            "error": short_error(result)}


def _local_model_path(model: str) -> str:
    """The checkpoint's path as this actor reads it (the tiny model's own; a path as given,
    which ``PoolingTask.of`` reads where it is there)."""
    return tiny_model_path() if model == TINY_NAME else model


class GenerateBatch:
    """Ray Data callable class: one nvray engine per actor of the pool."""

    def __init__(self, engine_kwargs: dict[str, Any], sampling_params: dict[str, Any],
                 max_engine_restarts: int = 1,
                 engine_factory: Callable[[EngineConfig], Any] = start_engine,
                 dimensions: int | None = None, loras: dict[str, str] | None = None,
                 default_lora: str | None = None) -> None:
        self.config = EngineConfig.from_kwargs(**engine_kwargs)
        checked = SamplingParams.coerce(sampling_params)
        if checked.n != 1:
            raise ValueError("batch inference writes one output row per input row: n must be 1")
        self.embeds = checked.pool is not None
        self.dimensions = dimensions
        # as the checkpoint's sentence-transformers modules say (/v1/embeddings and LLM.embed)
        self.normalize = PoolingTask.of(_local_model_path(self.config.model)).normalize
        self.sampling_params = sampling_params
        self.restarts_left = max_engine_restarts
        self.engine_factory = engine_factory
        self.loras = {name: LoRARequest(name, 0, path) for name, path in (loras or {}).items()}
        self.default_lora = default_lora
        self.lock = threading.Lock()  # Ray Data may run two batches at once in this actor
        self.client: Any = engine_factory(self.config)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        prompts = [row_prompt(r) for r in rows]
        results = self.generate(prompts, [self.row_params(r) for r in rows],
                                [self.row_lora(r) for r in rows])
        if self.embeds:
            out = [embedding_row(r["id"], res, self.dimensions, self.normalize)
                   for r, res in zip(rows, results, strict=True)]
        else:
            out = [result_row(r["id"], res) for r, res in zip(rows, results, strict=True)]
        schema = output_schema(batch.schema.field("id").type, "embed" if self.embeds else "generate")
        return pa.Table.from_pylist(out, schema=schema)

    def row_params(self, row: dict[str, Any]) -> Any:
        """The job's sampling parameters, with the row's ``response_format`` (if it has one) in
        place of the job's structured output; a malformed one is the row's error."""
        if row.get("response_format") is None:
            return self.sampling_params
        try:
            constraint = row_constraint(row["response_format"])
        except ValueError as e:
            return e
        params = {k: v for k, v in self.sampling_params.items() if k != "structured_outputs"}
        return SamplingParams.from_dict({**params, "structured_outputs": constraint})

    def row_lora(self, row: dict[str, Any]) -> LoRARequest | None:
        """The row's adapter (its ``lora``, else the job's ``--lora``; checked before the job
        started), None for the base model."""
        name = row.get("lora") or self.default_lora
        return self.loras[name] if name else None

    def generate(self, prompts: list[Any], params: list[Any] | None = None,
                 loras: list[LoRARequest | None] | None = None) -> list[Any]:
        """One RequestOutput or exception per prompt (``params``: one per prompt, the job's if
        None; an exception there is that row's result; ``loras``: each prompt's adapter);
        engine failures retried on a new engine."""
        params = params or [self.sampling_params] * len(prompts)
        loras = loras or [None] * len(prompts)
        results: list[Any] = [p if isinstance(p, BaseException) else None for p in params]
        client = self.client
        self._run(client, prompts, params, loras, results,
                  [i for i, r in enumerate(results) if r is None])
        failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)
                  and is_engine_failure(r)]
        if failed and self._replace_engine(client):
            self._run(self.client, prompts, params, loras, results, failed)
        return results

    @staticmethod
    def _run(client: Any, prompts: list[Any], params: list[Any], loras: list[Any],
             results: list[Any], which: list[int]) -> None:
        """Rows ``which`` go to the engine at once; their finals (over its output channel)
        land in ``results``."""
        try:
            outs = client.generate_many([prompts[i] for i in which], [params[i] for i in which],
                                        [loras[i] for i in which])
        except Exception as e:  # noqa: BLE001 - the engine failed as a whole: every row's error
            outs = [e] * len(which)
        for i, out in zip(which, outs, strict=True):
            results[i] = out

    def _replace_engine(self, failed: Any) -> bool:
        """Start a new engine in place of ``failed`` (once, whichever thread gets here first)."""
        with self.lock:
            if self.client is not failed:
                return True  # another batch of this actor already replaced it
            if self.restarts_left <= 0:
                return False
            self.restarts_left -= 1
            _shutdown_quietly(failed)
            try:
                self.client = self.engine_factory(self.config)
            except Exception:  # noqa: BLE001 - the rows keep their engine-failure errors
                return False
            return True

    def __del__(self) -> None:
        _shutdown_quietly(getattr(self, "client", None))


def _shutdown_quietly(client: Any) -> None:
    if client is None:
        return
    try:
        client.shutdown()
    except Exception:  # noqa: BLE001 - shutting down a dead engine may fail; nothing to do
        pass
