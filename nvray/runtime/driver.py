"""EngineDriver: the Ray actor that owns one engine's control plane.

It holds the tokenizer, Scheduler, BlockManager and step loop (LLMEngine in an EngineLoop
thread) and the RayExecutor of the rank actors. Its methods are the one API that the offline
LLM, the Serve deployment and batch jobs call:

- ``generate_stream(prompt, sampling_params, request_id, priority)``: an async generator of
  RequestOutputs — deltas while running, then the final output (call it with
  ``num_returns="streaming"``); cancelling the call aborts the request;
- ``generate(...)``: the final RequestOutput only;
- ``abort``, ``stats``, ``check_health``, ``shutdown``.

``prompt`` is a string, a list of token ids, or a list of chat messages (dicts with ``role``
and ``content``, formatted with the model's chat template). ``sampling_params`` is a dict or a
SamplingParams. Invalid requests raise ValueError; an engine that lost a rank raises
EngineDeadError for every in-flight and new request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from ray.util.placement_group import PlacementGroup

from nvray.bootstrap import create_engine
from nvray.config import EngineConfig
from nvray.outputs import RequestOutput
from nvray.runtime.engine_loop import EngineLoop, RequestStream
from nvray.runtime.errors import EngineDeadError
from nvray.runtime.ray_executor import RayExecutor
from nvray.sampling_params import SamplingParams


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


class EngineDriver:
    def __init__(self, config: EngineConfig, pg: PlacementGroup) -> None:
        self.config = config
        self.pg = pg
        self.loop: EngineLoop | None = None
        self.started_at = time.time()

    async def start(self) -> dict[str, Any]:
        """Start the ranks and the step loop; returns model facts. Errors surface here."""
        # starting the ranks blocks on ray.get: keep it off the actor's event loop
        engine = await asyncio.to_thread(
            create_engine, self.config, lambda cfg, path: RayExecutor(cfg, path, self.pg))
        self.engine = engine
        self.loop = EngineLoop(engine)
        lim = engine.limits
        return {"max_model_len": lim.max_model_len, "vocab_size": lim.vocab_size,
                "num_kvcache_blocks": lim.num_kvcache_blocks, "block_size": lim.block_size}

    # ---------------------------------------------------------------- requests
    def prepare_prompt(self, prompt: Any) -> str | list[int]:
        if not is_chat(prompt):
            return prompt
        for i, m in enumerate(prompt):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must have string 'role' and 'content'")
        text = self.engine.tokenizer.apply_chat_template(prompt, tokenize=False,
                                                         add_generation_prompt=True)
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    async def _open(self, prompt: Any, sampling_params: Any, request_id: str | None,
                    priority: int, stream: bool) -> tuple[str, RequestStream]:
        assert self.loop is not None, "start() first"
        if self.loop.dead:
            raise EngineDeadError(self.loop.dead)
        params = SamplingParams.coerce(sampling_params)
        request_id = request_id or uuid.uuid4().hex
        sink = await self.loop.add(request_id, self.prepare_prompt(prompt), params, priority, stream)
        return request_id, sink

    async def _outputs(self, request_id: str, sink: RequestStream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await sink.queue.get()
                if out.finish_reason == "error":
                    raise EngineDeadError(out.error or "engine failed")
                finished = out.finished
                yield out
        finally:
            if not finished and self.loop is not None and not self.loop.dead:
                self.loop.abort(request_id)  # caller went away: free the request's blocks

    async def generate_stream(self, prompt: Any, sampling_params: Any = None,
                              request_id: str | None = None,
                              priority: int = 0) -> AsyncIterator[RequestOutput]:
        request_id, sink = await self._open(prompt, sampling_params, request_id, priority, True)
        async for out in self._outputs(request_id, sink):
            yield out

    async def generate(self, prompt: Any, sampling_params: Any = None,
                       request_id: str | None = None, priority: int = 0) -> RequestOutput:
        request_id, sink = await self._open(prompt, sampling_params, request_id, priority, False)
        async for out in self._outputs(request_id, sink):
            if out.finished:
                return out
        raise EngineDeadError("request ended without a final output")

    async def abort(self, request_id: str) -> None:
        if self.loop is not None and not self.loop.dead:
            await asyncio.wrap_future(self.loop.abort(request_id))

    # ------------------------------------------------------------------ status
    async def stats(self) -> dict[str, Any]:
        assert self.loop is not None, "start() first"
        if self.loop.dead:
            return {"healthy": False, "error": self.loop.dead}
        stats = await asyncio.wrap_future(self.loop.call(self.engine.stats))
        times = sorted(self.loop.step_times)
        stats["step_time_ms_median"] = 1e3 * times[len(times) // 2] if times else 0.0
        return {"healthy": True, **stats}

    async def check_health(self) -> None:
        """Raise EngineDeadError unless the step loop and every rank are alive."""
        assert self.loop is not None, "start() first"
        if self.loop.dead:
            raise EngineDeadError(self.loop.dead)
        try:
            await asyncio.to_thread(self.engine.executor.check_health)
        except EngineDeadError as e:
            self.loop.call(lambda: self.loop.fail(str(e)))  # type: ignore[union-attr]
            raise

    def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.stop()
            self.engine.executor.shutdown()
