"""EngineDriver: the Ray actor that owns one engine's control plane.

It holds the tokenizer, Scheduler, BlockManager and step loop (LLMEngine in an EngineLoop
thread) and the RayExecutor of the rank actors. Its methods are the one API that the offline
LLM, the Serve deployment, batch jobs and EngineClients call.

Outputs reach a consumer (a process with many requests in flight) through ONE long-lived
channel per consumer, one message per engine step whatever the number of its requests:

- ``open_channel(consumer_id)``, then ``subscribe(consumer_id)`` (call it with
  ``num_returns="streaming"``): each item is one step's (or, for a consumer that fell behind,
  several steps') outputs of that consumer's requests, in wire form (``nvray.outputs``);
- ``add_requests(consumer_id, requests)``: queue requests whose outputs go to that channel;
  returns, per request, its number of prompt tokens or the ValueError that rejected it;
- ``close_channel(consumer_id)``: end the stream and abort the consumer's requests (also done
  when the subscription is cancelled).

``nvray.runtime.output_router`` is the consumer side. Also ``abort``, ``stats``,
``check_health``, ``shutdown``.

A request is an ``EngineRequest`` (``nvray/request.py``), named by the consumer's output router:
``prompt`` is a string, a list of token ids, or a chat prompt (a list of messages, dicts with
``role`` and ``content``, or a ``nvray.chat_template.ChatPrompt`` that also carries
``chat_template_kwargs``), formatted here with the model's chat template; ``params`` is a
SamplingParams, a dict of its fields or None (the defaults), or a BeamSearchParams; ``priority`` orders it under the ``priority`` scheduling policy; ``stream``
asks for an output every step (else only the final one). An engine that lost a rank raises
EngineDeadError for every in-flight and new request.

``tokenize(prompt)`` and ``detokenize(token_ids)`` expose the engine's own tokenizer, so that
token counts and ids a client sees are the ones the engine runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any, AsyncIterator

from nvray.bootstrap import create_engine
from nvray.chat_template import is_chat, render_chat
from nvray.config import EngineConfig
from nvray.outputs import WireOutput
from nvray.request import EngineRequest
from nvray.runtime.consumer_channel import ConsumerChannel, OutputSink
from nvray.runtime.engine_loop import EngineLoop
from nvray.runtime.errors import EngineDeadError
from nvray.runtime.ray_executor import RayExecutor
from nvray.startup_phases import StartupPhases
from nvray.sampling_params import BeamSearchParams, SamplingParams



class EngineDriver:
    def __init__(self, config: EngineConfig, workers: list) -> None:
        """``workers``: the engine's rank actors, started beside this one (``start_engine``)."""
        # Ray warns at the first ray.get in any thread of an async actor; this one calls it
        # only from its own threads (start-up, the step loop), never on the event loop
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")  # Ray's own switch
        self.config = config
        self.workers = workers
        self.loop: EngineLoop | None = None
        self.channels: dict[str, ConsumerChannel] = {}
        self.num_add_calls = 0  # add_requests calls taken (a consumer batches its adds)
        self.created_at = time.time()  # the process is up and has imported this module

    async def start(self, launch_phases: dict[str, float] | None = None,
                    launched_at: float | None = None) -> dict[str, Any]:
        """Set the ranks up and start the step loop; returns model facts. Errors surface here.
        ``launch_phases``: the caller's start-up seconds before it made this actor (Ray, the
        placement group), and ``launched_at`` (``time.time()``) when it made it: the start-up
        report then covers the whole start, this actor's process start and imports included."""
        phases = StartupPhases()
        phases.add(launch_phases or {})
        if launched_at is not None:
            phases.add({"driver_actor": max(0.0, self.created_at - launched_at)})
        start = time.perf_counter() - sum(phases.seconds.values())
        # setting the ranks up blocks on ray.get: keep it off the actor's event loop
        engine = await asyncio.to_thread(
            create_engine, self.config, lambda cfg, path: RayExecutor(cfg, path, self.workers),
            phases, start)
        self.engine = engine
        self.loop = EngineLoop(engine)
        lim, cfg = engine.limits, self.config
        return {**lim.as_info(), "num_kvcache_blocks": lim.num_kvcache_blocks,
                "block_size": lim.block_size,
                "device": cfg.device, "tensor_parallel_size": cfg.tensor_parallel_size,
                "pipeline_parallel_size": cfg.pipeline_parallel_size,
                "cuda_graphs": cfg.device == "cuda" and not cfg.enforce_eager,
                "max_lora_rank": cfg.max_lora_rank,
                "startup_s": engine.counters.startup.get("total_s") if engine.counters.startup else None}

    # ---------------------------------------------------------------- requests
    def prepare_prompt(self, prompt: Any) -> str | list[int]:
        """A chat prompt becomes its template's token ids; other prompts pass unchanged."""
        return render_chat(self.engine.tokenizer, prompt) if is_chat(prompt) else prompt

    async def tokenize(self, prompt: Any) -> list[int]:
        """The token ids the engine would run for ``prompt`` (a string or a chat prompt)."""
        if prompt == "":
            return []
        prepared = self.prepare_prompt(prompt)
        return prepared if isinstance(prepared, list) else self.engine.intake.tokenize(prepared)

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included (the inverse of ``tokenize``)."""
        vocab_size = self.engine.limits.vocab_size
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _live_loop(self) -> EngineLoop:
        assert self.loop is not None, "start() first"
        if self.loop.dead:
            raise EngineDeadError(self.loop.dead)
        return self.loop

    def _prepare(self, request: EngineRequest) -> EngineRequest:
        """The request as the engine takes it: chat rendered, parameters validated."""
        assert request.request_id is not None, "the output router names every request"
        params = request.params
        if not isinstance(params, BeamSearchParams):
            params = SamplingParams.coerce(params)
        return dataclasses.replace(request, prompt=self.prepare_prompt(request.prompt),
                                   params=params)

    async def _add(self, requests: list[EngineRequest], sink: OutputSink
                   ) -> list[int | ValueError]:
        loop = self._live_loop()
        results: list[int | ValueError] = [0] * len(requests)
        accepted, where = [], []
        for i, request in enumerate(requests):
            try:
                accepted.append(self._prepare(request))
                where.append(i)
            except ValueError as e:  # bad sampling values or chat messages: this request only
                results[i] = e
        await self._compile_grammars(accepted, where, results)
        ready = [(i, r) for i, r in zip(where, accepted) if not isinstance(results[i], ValueError)]
        added = await asyncio.wrap_future(loop.add([r for _, r in ready], sink))
        for (i, _), result in zip(ready, added):
            results[i] = result
        return results

    async def _compile_grammars(self, requests: list[EngineRequest], where: list[int],
                                results: list[int | ValueError]) -> None:
        """Structured outputs: compile each request's grammar here, off the step loop, while
        the ranks start compiling it with the next step; a request whose grammar fails gets
        its ValueError. The engine then finds the grammar compiled (``intake.compile_grammar``)."""
        constrained = [(i, r.params) for i, r in zip(where, requests)
                       if isinstance(r.params, SamplingParams) and r.params.structured_outputs]
        if not constrained:
            return
        engine = self.engine

        def compile_one(params: SamplingParams) -> None:
            constraint = params.structured_outputs
            spec = constraint.spec()  # type: ignore[union-attr]
            self.loop.call(lambda: engine.prefetch_grammar(spec))  # type: ignore[union-attr]
            engine.intake.grammars.compile(spec, constraint.origin)  # type: ignore[union-attr]

        outcomes = await asyncio.gather(*(asyncio.to_thread(compile_one, params)
                                          for _, params in constrained), return_exceptions=True)
        for (i, _), outcome in zip(constrained, outcomes):
            if isinstance(outcome, ValueError):
                results[i] = outcome
            elif isinstance(outcome, BaseException):
                raise outcome

    async def add_requests(self, consumer_id: str, requests: list[EngineRequest]
                           ) -> list[int | ValueError]:
        """Queue requests for the consumer's channel; per request its number of prompt tokens,
        or the ValueError that rejected it."""
        channel = self.channels.get(consumer_id)
        if channel is None or channel.closed:
            raise ValueError(f"no open output channel {consumer_id!r}: call open_channel first")
        self.num_add_calls += 1
        return await self._add(list(requests), channel)

    # ---------------------------------------------------------------- channels
    async def open_channel(self, consumer_id: str) -> None:
        self._live_loop()
        self.channels.setdefault(consumer_id, ConsumerChannel())

    async def subscribe(self, consumer_id: str) -> AsyncIterator[list[WireOutput]]:
        """The consumer's outputs, one message per step (or per several, if it fell behind)."""
        channel = self.channels.get(consumer_id)
        if channel is None:
            raise ValueError(f"no output channel {consumer_id!r}: call open_channel first")
        try:
            async for message in channel.messages():
                yield message
        finally:
            self._drop_channel(consumer_id)

    async def close_channel(self, consumer_id: str) -> None:
        channel = self.channels.get(consumer_id)
        if channel is not None:
            channel.close()
            self._drop_channel(consumer_id)

    def _drop_channel(self, consumer_id: str) -> None:
        channel = self.channels.pop(consumer_id, None)
        if channel is not None and self.loop is not None and not self.loop.dead:
            self.loop.abort_sink(channel)

    async def abort(self, request_id: str | list[str]) -> None:
        if self.loop is not None and not self.loop.dead:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            await asyncio.wrap_future(self.loop.abort(ids))

    # ------------------------------------------------------------------ status
    async def stats(self) -> dict[str, Any]:
        assert self.loop is not None, "start() first"
        if self.loop.dead:
            return {"healthy": False, "error": self.loop.dead}
        stats = await asyncio.wrap_future(self.loop.call(self.engine.stats))
        times = sorted(self.loop.step_times)
        stats["step_time_ms_median"] = 1e3 * times[len(times) // 2] if times else 0.0
        stats["num_steps"] = self.loop.num_steps
        stats["num_output_channels"] = len(self.channels)
        stats["add_requests_calls"] = self.num_add_calls
        stats["output_messages"] = sum(c.num_messages for c in self.channels.values())
        stats["driver_resident_memory_bytes"] = resident_memory_bytes()
        stats["step_dispatch"] = getattr(self.engine.executor, "dispatch", "in_process")
        return {"healthy": True, **stats}

    async def check_health(self) -> None:
        """Raise EngineDeadError unless the step loop and every rank are alive."""
        assert self.loop is not None, "start() first"
        if self.loop.dead:
            raise EngineDeadError(self.loop.dead)
        try:
            await asyncio.to_thread(self.engine.executor.check_health)
        except EngineDeadError as e:
            reason = str(e)  # ``e`` is unbound once the except clause ends: the loop runs later
            self.loop.call(lambda: self.loop.fail(reason))  # type: ignore[union-attr]
            raise

    def shutdown(self) -> None:
        for channel in self.channels.values():
            channel.close()
        if self.loop is not None:
            self.loop.stop()
            self.engine.executor.shutdown()


def resident_memory_bytes() -> int:
    """This process's resident memory (Linux: /proc; elsewhere its peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource  # noqa: PLC0415

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
