"""start_engine / EngineClient: place an engine on the Ray cluster and call its driver.

``start_engine`` makes the rank actors and the driver actor together, so their processes start
and import side by side; the caller owns both (they die with it), and the start-up report
(``stats()["startup"]``) counts from the caller's ``ray_init``.

An EngineClient is a small picklable handle (the driver and rank actors, the placement group),
so it can be passed to other Ray tasks and actors, which then call the same engine concurrently.
In each process it is used in, it opens one output channel to the driver on first use (a
SyncRouter): ``generate``, ``generate_many`` and ``stream`` all receive their outputs through
it, one message per engine step for all of that client's requests. ``close`` ends the channel
(what is still running is aborted); ``shutdown`` kills the driver and the rank actors and
removes the placement group.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Iterator, Sequence

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from nvray.config import EngineConfig
from nvray.models.tiny import TINY_NAME, resolve_model
from nvray.outputs import RequestOutput
from nvray.request import EngineRequest
from nvray.runtime.cluster import ensure_ray, resolve_device
from nvray.runtime.driver import EngineDriver
from nvray.runtime.placement import DRIVER_CPUS, create_engine_placement_group, in_bundle
from nvray.runtime.ray_executor import start_rank_actors
from nvray.runtime.sync_router import SyncRouter, SyncSink
from nvray.startup_phases import StartupPhases

_SHUTDOWN_TIMEOUT_S = 30.0
_DRIVER_MAX_CONCURRENCY = 10_000


def start_engine(config: EngineConfig, pg: PlacementGroup | None = None,
                 phases: StartupPhases | None = None) -> "EngineClient":
    """Start one engine (driver + ranks in one placement group) on the current Ray cluster.

    With ``pg`` (bundles laid out as ``placement.engine_bundles``: rank r in bundle r, the
    driver in bundle 0 beside rank 0), the engine lives in that placement group and its owner
    removes it — this is how a Serve replica hosts its engine in the replica's own placement
    group. ``phases``: a start-up the caller began timing (its imports).
    """
    phases = phases or StartupPhases()
    with phases.phase("ray_init"):
        ensure_ray()
    if config.model != TINY_NAME:
        resolve_model(config.model)  # fail fast, here, on a path that does not exist
    config = resolve_device(config)
    owns_pg = pg is None
    if pg is None:
        with phases.phase("placement_group"):
            pg = create_engine_placement_group(config, config.device == "cuda")
    launched_at = time.time()
    ranks = start_rank_actors(config, pg)  # their processes start beside the driver's
    driver = ray.remote(EngineDriver).options(
        num_cpus=DRIVER_CPUS, scheduling_strategy=in_bundle(pg, 0),
        max_concurrency=_DRIVER_MAX_CONCURRENCY, max_restarts=0).remote(config, ranks)
    client = EngineClient(driver, pg, owns_pg, ranks)
    try:
        client.info = ray.get(driver.start.remote(phases.seconds, launched_at))
    except BaseException:
        client.shutdown()
        raise
    return client


class EngineClient:
    def __init__(self, driver: Any, pg: PlacementGroup, owns_pg: bool = True,
                 ranks: Sequence[Any] = ()) -> None:
        self.driver = driver
        self.pg = pg
        self.owns_pg = owns_pg
        self.ranks = list(ranks)
        self.info: dict[str, Any] = {}
        self._router: SyncRouter | None = None
        self._router_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"driver": self.driver, "pg": self.pg, "owns_pg": self.owns_pg, "info": self.info,
                "ranks": self.ranks}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["driver"], state["pg"], state["owns_pg"], state["ranks"])  # type: ignore[misc]
        self.info = state["info"]

    @property
    def router(self) -> SyncRouter:
        """This process's output channel to the driver (opened on first use)."""
        with self._router_lock:
            if self._router is None:
                self._router = SyncRouter(self.driver)
                weakref.finalize(self, self._router.close)
            return self._router

    def submit(self, requests: Sequence[EngineRequest], stream: bool = False,
               all_or_nothing: bool = True) -> SyncSink:
        """Queue requests; read their outputs from the returned sink (see OutputRouter.add)."""
        return self.router.add(list(requests), stream, all_or_nothing)

    def generate(self, prompt: Any, sampling_params: Any = None, request_id: str | None = None,
                 priority: int = 0, lora_request: Any = None
                 ) -> RequestOutput | list[RequestOutput]:
        """The final output (with ``n > 1``: the list of the ``n`` choices' outputs);
        ``lora_request``: a ``LoRARequest`` (the engine must have ``enable_lora``)."""
        results = self.submit([EngineRequest(prompt, sampling_params, request_id, priority,
                                             lora_request=lora_request)]).results()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results[0] if len(results) == 1 else results  # type: ignore[return-value]

    def generate_many(self, prompts: Sequence[Any], sampling_params: Any = None,
                      lora_request: Any = None) -> list[RequestOutput | BaseException]:
        """Final outputs of many prompts, in order (``n`` consecutive ones per prompt with
        ``n > 1``); a rejected or failed one gives its error. ``sampling_params`` and
        ``lora_request``: one for all, or a list of one per prompt."""
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(lora_request, list):
            lora_request = [lora_request] * len(prompts)
        if len(sampling_params) != len(prompts) or len(lora_request) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params and {len(lora_request)} "
                             f"lora_request for {len(prompts)} prompts")
        sink = self.submit([EngineRequest(p, sp, lora_request=lora)
                            for p, sp, lora in zip(prompts, sampling_params, lora_request)],
                           all_or_nothing=False)
        return sink.results()

    def stream(self, prompt: Any, sampling_params: Any = None, request_id: str | None = None,
               priority: int = 0, lora_request: Any = None) -> Iterator[RequestOutput]:
        """Deltas as the engine makes them (coalesced if read slowly), the final output last.
        Stopping the iteration early aborts the request."""
        sink = self.submit([EngineRequest(prompt, sampling_params, request_id, priority,
                                          lora_request=lora_request)], stream=True)
        for _, out in sink.outputs():
            yield out

    def abort(self, request_id: str) -> None:
        ray.get(self.driver.abort.remote(request_id))

    def stats(self) -> dict[str, Any]:
        return ray.get(self.driver.stats.remote())

    def check_health(self) -> None:
        ray.get(self.driver.check_health.remote())

    def close(self) -> None:
        """Close this process's output channel (its running requests are aborted)."""
        with self._router_lock:
            router, self._router = self._router, None
        if router is not None:
            router.close()

    def shutdown(self) -> None:
        """Stop the engine: driver and rank actors killed, placement group removed."""
        self.close()
        try:
            ray.get(self.driver.shutdown.remote(), timeout=_SHUTDOWN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a dead driver is what shutdown wants anyway
            pass
        for actor in (self.driver, *self.ranks):  # the ranks too, should the driver have died
            ray.kill(actor, no_restart=True)
        if self.owns_pg:
            remove_placement_group(self.pg)
