"""RayExecutor: the engine's tensor-parallel rank actors, driven one step at a time.

Start-up: ``start_rank_actors`` places one RankWorker per rank in its placement-group bundle
(``start_engine`` calls it beside the driver actor, so the rank processes start and import
while the driver's does); the executor then runs the torch.distributed rendezvous at rank 0's
node IP and a free port; every rank loads its shard and reports how many KV blocks fit; all
allocate the minimum. Per step, the same StepInput goes to every rank and rank 0's
sampled tokens come back. By default the step travels through a Ray compiled graph (shared
memory channels, no per-call task submission), which keeps Ray's per-call overhead off the
critical path; ``ray_dispatch="actor_calls"`` uses plain actor calls instead.

While a compiled graph exists, each rank's loop polls its input channel for the next step and
keeps a core busy. So an idle engine (``idle()``: nothing in flight, nothing waiting) tears the
graph down; the steps after it go through plain actor calls while a new graph compiles in the
background, and the graph takes over once it is ready (between two steps).

With ``overlap_scheduling`` the ranks run ``execute_overlapped``: a call hands them step N+1
and answers with step N's ids, which the ranks read only after queueing N+1 on the device, so
the round trip through Ray and the driver's work happen while the device computes.

With pipeline stages (``pipeline_parallel_size`` P > 1) every rank gets every step and the last
stage's first rank answers; ``submit`` hands the ranks a step without waiting and ``collect``
returns the oldest one's answer, so the engine keeps a step per stage in flight. With
``overlap_scheduling`` the ranks still run ``execute_overlapped`` (the engine sends no
placeholders then): a step's answer comes back with the next call, so the last stage queues
the next step before it waits for the one before, and ``collect`` makes a call with nothing new
(None) when no later step was submitted. A compiled
graph runs each rank's calls one at a time, in order; plain actor calls may not (an actor runs
two at once), so through them a step is handed over only once the one before answered.

A rank that dies or hangs makes ``execute`` raise ``EngineDeadError``; the executor then kills
the remaining ranks so nothing is left blocked in a collective.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import ray
from ray.experimental.compiled_dag_ref import CompiledDAGRef
from ray.util.placement_group import PlacementGroup

from nvray.config import EngineConfig
from nvray.step_protocol import StepInput, StepOutput
from nvray.gc_freeze import release_frozen_objects
from nvray.runtime.errors import EngineDeadError
from nvray.runtime.placement import in_bundle, rank_resources
from nvray.runtime.rank_worker import RankWorker, node_gpu_lists
from nvray.startup_phases import StartupPhases

logger = logging.getLogger(__name__)
_PING_TIMEOUT_S = 10.0


def start_rank_actors(config: EngineConfig, pg: PlacementGroup) -> list:
    """One RankWorker per rank, rank r in bundle r of ``pg``; returns at once (the actors
    start in the background)."""
    res = rank_resources(config, config.device == "cuda")
    actor = ray.remote(RankWorker)
    return [actor.options(num_cpus=res["CPU"], num_gpus=res.get("GPU", 0), max_concurrency=2,
                          max_restarts=0, scheduling_strategy=in_bundle(pg, rank)
                          ).remote(config, rank)
            for rank in range(config.world_size)]


class RayExecutor:
    def __init__(self, config: EngineConfig, model_path: str, workers: list) -> None:
        """``workers``: the engine's rank actors (``start_rank_actors``), perhaps still starting."""
        self.config = config
        self.timeout = config.step_timeout_s
        # the ranks answer a step at the next call: overlapped steps, and pipeline stages (whose
        # engine keeps steps in flight its own way); but a step to answer_now (speculation) at once
        self.overlap = config.overlap_scheduling
        self.pipeline_depth = config.pipeline_parallel_size  # steps in flight at most
        self.output_rank = config.world_size - config.tensor_parallel_size  # last stage's first
        self.pending: collections.deque = collections.deque()  # handed over, answers unread
        self.dead: str | None = None
        self.workers = workers
        phases = StartupPhases()
        with phases.phase("rank_actors"):  # what their start leaves to wait for
            host, port = ray.get(self.workers[0].rendezvous_address.remote())
            gpus = node_gpu_lists(ray.get([w.gpu_placement.remote() for w in self.workers]))
            ray.get([w.init_distributed.remote(host, port, g) for w, g in zip(self.workers, gpus)])
        start = time.perf_counter()
        self._setup(model_path)
        rank0 = ray.get(self.workers[0].startup_phases.remote())  # the ranks' own phases
        phases.add_within(rank0, time.perf_counter() - start, "rank_calls")  # and the calls' cost
        self.compiled = config.ray_dispatch == "compiled"
        with phases.phase("compiled_graph"):
            self.dag = self._compile() if self.compiled else None
        self.startup_phases = phases.seconds
        self.next_dag: concurrent.futures.Future | None = None  # compiling after an idle spell

    def _setup(self, model_path: str) -> None:
        blocks = ray.get([w.load.remote(model_path) for w in self.workers])
        self.num_blocks = min(blocks)  # every rank must hold the same block count
        ray.get([w.allocate_kv_cache.remote(self.num_blocks) for w in self.workers])
        self.facts = ray.get(self.workers[0].model_facts.remote())

    def _compile(self):  # noqa: ANN202 - ray.dag types are experimental
        from ray.dag import InputNode, MultiOutputNode  # noqa: PLC0415

        with InputNode() as step:
            dag = MultiOutputNode([self._method(w).bind(step) for w in self.workers])
        return dag.experimental_compile(_max_inflight_executions=max(10, self.pipeline_depth + 1))

    def _method(self, worker):  # noqa: ANN001, ANN202 - the rank method every step calls
        return worker.execute_overlapped if self.overlap else worker.execute

    # ------------------------------------------------------------------ steps
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step to completion."""
        if not self.overlap:
            return self._call(step)
        assert self._call(step) is None, "execute() while an overlapped step is in flight"
        return self._call(None)

    def execute_overlapped(self, step: StepInput | None) -> StepOutput | None:
        """Hand the ranks ``step``; returns the ids of the step handed to them before."""
        assert self.overlap, "the ranks were set up without overlap_scheduling"
        return self._call(step)

    def submit(self, step: StepInput) -> None:
        """Hand the ranks ``step`` without waiting for its answer (``collect`` reads it)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        if self.compiled and self.dag is None:
            self._answer_pending()  # the dispatch may change: what actor calls began ends first
            self._take_compiled_graph()
        try:
            if self.dag is not None:
                self.pending.append(self.dag.execute(step))
            else:
                self._answer_pending()  # an actor may run two calls at once: one step at a time
                self.pending.append([self._method(w).remote(step) for w in self.workers])
        except Exception as e:  # noqa: BLE001 - a lost rank
            self._fail(e)

    def collect(self) -> StepOutput:
        """The answer of the oldest step handed over and not yet collected (pipeline stages)."""
        while True:
            if not self.pending:  # overlapped ranks: the call that brings the answer back
                self.submit(None)  # type: ignore[arg-type]
            answer = self._answer(self.pending.popleft())
            if answer is not None or not self.overlap:  # None: the ranks had nothing before
                return answer  # type: ignore[return-value]

    def _answer_pending(self) -> None:
        self.pending = collections.deque(self._answer(item) if _unanswered(item) else item
                                         for item in self.pending)

    def _answer(self, item: Any) -> StepOutput | None:  # noqa: ANN401 - a ref, refs or an answer
        if not _unanswered(item):
            return item
        try:
            return ray.get(item, timeout=self.timeout)[self.output_rank]
        except Exception as e:  # noqa: BLE001 - any failure here means a lost or hung rank
            self._fail(e)

    def _fail(self, e: Exception) -> NoReturn:
        self.pending.clear()
        self._die(f"a rank failed: {type(e).__name__}: {_first_line(e)}")
        raise EngineDeadError(self.dead) from None

    def discard_in_flight(self) -> None:
        """Read and drop the ids of the steps still in flight (nothing to do once dead)."""
        while self.pending and not self.dead:
            try:
                self._answer(self.pending.popleft())
            except EngineDeadError:
                return  # the ranks are gone: nothing is in flight any more
        if self.overlap and not self.dead:
            try:
                self._call(None)
            except EngineDeadError:
                pass  # the ranks are gone: nothing is in flight any more

    @property
    def dispatch(self) -> str:
        """How steps reach the ranks now: ``compiled_graph`` or ``actor_calls`` (configured so,
        or after an idle spell until the new graph is ready)."""
        return "compiled_graph" if self.dag is not None else "actor_calls"

    def idle(self) -> None:
        """Stop the ranks' graph loops (and their polling) until the next step."""
        if self.dag is None or self.dead:
            return
        dag, self.dag = self.dag, None
        try:
            with _quiet_graph_teardown():
                dag.teardown()
        except Exception as e:  # noqa: BLE001 - a rank lost while idle fails the next step
            logger.warning("tearing the idle compiled graph down failed: %s", _first_line(e))

    def _take_compiled_graph(self) -> None:
        """After an idle spell: start compiling a graph, or take it once it is ready."""
        if self.next_dag is None:
            self.next_dag = concurrent.futures.Future()
            threading.Thread(target=self._compile_into, args=(self.next_dag,),
                             name="nvray-compile-graph", daemon=True).start()
        elif self.next_dag.done():
            future, self.next_dag = self.next_dag, None
            try:
                self.dag = future.result()
            except Exception as e:  # noqa: BLE001 - steps keep going through actor calls
                logger.warning("compiling the graph failed, steps stay actor calls: %s",
                               _first_line(e))
                self.compiled = False

    def _compile_into(self, future: concurrent.futures.Future) -> None:
        try:
            future.set_result(self._compile())
        except BaseException as e:  # noqa: BLE001 - handed to the step loop
            future.set_exception(e)

    def _call(self, step: StepInput | None) -> StepOutput | None:
        """One call to the ranks, and what it answers."""
        self.submit(step)  # type: ignore[arg-type] - overlapped steps hand over None too
        return self._answer(self.pending.popleft())

    def expert_load(self) -> list[list[int]]:
        """Each rank's pairs per local expert (expert parallel; empty lists otherwise); none
        at all where a rank does not answer (the health check tells that)."""
        if self.dead:
            return []
        try:
            return ray.get([w.expert_load.remote() for w in self.workers],
                           timeout=_PING_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - stats go on without the load
            logger.warning("expert load unavailable: %s", _first_line(e))
            return []

    def check_health(self) -> None:
        """Raise EngineDeadError unless every rank answers a ping."""
        if self.dead:
            raise EngineDeadError(self.dead)
        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=_PING_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            self._die(f"a rank is gone: {type(e).__name__}: {_first_line(e)}")
            raise EngineDeadError(self.dead) from None

    def _die(self, reason: str) -> None:
        self.dead = reason
        logger.error("engine failed: %s", reason)
        self._kill_workers()

    def _kill_workers(self) -> None:
        if self.next_dag is not None:  # a graph compiling after an idle spell: wait, drop it
            future, self.next_dag = self.next_dag, None
            try:
                self.dag = self.dag or future.result(timeout=_PING_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - best effort: the actors are killed below anyway
                pass
        if self.dag is not None:
            try:
                with _quiet_graph_teardown():
                    self.dag.teardown(kill_actors=True)
            except Exception:  # noqa: BLE001 - best effort: the actors are killed below anyway
                pass
            self.dag = None
        for w in self.workers:
            ray.kill(w, no_restart=True)

    def shutdown(self) -> None:
        self._kill_workers()
        release_frozen_objects()
        self.dead = self.dead or "the engine was shut down"


@contextlib.contextmanager
def _quiet_graph_teardown() -> Iterator[None]:
    """Without the five INFO lines Ray logs per compiled-graph teardown ("Tearing down compiled
    DAG" ... "Teardown complete"): the driver's console shows them after every idle spell and
    at every shutdown (each LLM script's end, each app's stop); its warnings still show."""
    ray_dag_log = logging.getLogger("ray.dag.compiled_dag_node")
    level = ray_dag_log.level
    ray_dag_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        ray_dag_log.setLevel(level)


def _unanswered(item: Any) -> bool:  # noqa: ANN401
    """A compiled graph's ref or a list of actor calls' refs, not an answer yet."""
    return isinstance(item, (list, CompiledDAGRef))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""
