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

A rank that dies or hangs makes ``execute`` raise ``EngineDeadError``; the executor then kills
the remaining ranks so nothing is left blocked in a collective.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import ray
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
            for rank in range(config.tensor_parallel_size)]


class RayExecutor:
    def __init__(self, config: EngineConfig, model_path: str, workers: list) -> None:
        """``workers``: the engine's rank actors (``start_rank_actors``), perhaps still starting."""
        self.config = config
        self.timeout = config.step_timeout_s
        self.overlap = config.overlap_scheduling
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
        facts = ray.get(self.workers[0].model_facts.remote())
        self.max_model_len, self.vocab_size = facts["max_model_len"], facts["vocab_size"]
        self.dtypes = facts["dtypes"]
        self.kv_group_windows = tuple(facts["kv_group_windows"])
        self.parallelism = facts["parallelism"]

    def _compile(self):  # noqa: ANN202 - ray.dag types are experimental
        from ray.dag import InputNode, MultiOutputNode  # noqa: PLC0415

        with InputNode() as step:
            dag = MultiOutputNode([self._method(w).bind(step) for w in self.workers])
        return dag.experimental_compile()

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

    def discard_in_flight(self) -> None:
        """Read and drop the ids of a step still in flight (nothing to do once dead)."""
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
        if self.dead:
            raise EngineDeadError(self.dead)
        if self.compiled and self.dag is None:
            self._take_compiled_graph()
        try:
            if self.dag is not None:
                results = ray.get(self.dag.execute(step), timeout=self.timeout)
            else:
                refs = [self._method(w).remote(step) for w in self.workers]
                results = ray.get(refs, timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - any failure here means a lost or hung rank
            self._die(f"a tensor-parallel rank failed: {type(e).__name__}: {_first_line(e)}")
            raise EngineDeadError(self.dead) from None
        return results[0]

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
            self._die(f"a tensor-parallel rank is gone: {type(e).__name__}: {_first_line(e)}")
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""
