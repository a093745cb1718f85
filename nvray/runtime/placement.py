"""Placement of one engine: a placement group with one bundle per rank (rank r in bundle r;
``tensor_parallel_size`` ranks per pipeline stage, stage by stage), the driver sharing bundle 0
with rank 0, so Ray places or refuses the engine whole. Every strategy works on any number of
nodes that can hold the bundles: ``STRICT_SPREAD`` puts each rank on its own node (TP=2, or
PP=2, over two nodes), ``STRICT_PACK`` all of them on one, ``PACK`` as few nodes as hold them
(stages spill onto a second node only when one is full)."""

from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nvray.config import EngineConfig

logger = logging.getLogger(__name__)
DRIVER_CPUS = 0.1  # the driver mostly waits on the ranks
# resources that no live placement group holds come back within seconds once their group is
# removed (an app's replicas, just stopped): how long a start waits for them before failing
RELEASE_WAIT_S = 30.0
_READY_TIMEOUT_S = 120.0


def rank_resources(config: EngineConfig, use_gpu: bool) -> dict[str, float]:
    if use_gpu:
        return {"CPU": 1.0, "GPU": config.num_gpus_per_rank}
    return {"CPU": config.num_cpus_per_rank}


def engine_bundles(config: EngineConfig, use_gpu: bool) -> list[dict[str, float]]:
    bundles = [rank_resources(config, use_gpu) for _ in range(config.world_size)]
    bundles[0] = {**bundles[0], "CPU": round(bundles[0]["CPU"] + DRIVER_CPUS, 6)}
    return bundles


def check_engines_fit(config: EngineConfig, use_gpu: bool, count: int = 1,
                      bundles: list[dict[str, float]] | None = None,
                      free_now: bool = False, release_wait_s: float = RELEASE_WAIT_S) -> None:
    """ValueError at once if the cluster's total resources can never hold ``count`` engines
    (instead of waiting for a placement that cannot happen); with ``free_now``, also if what is
    free now cannot. Resources that no live placement group holds are being given back (an app
    just stopped: its replicas' groups are removed a moment before their resources return) or
    held by tasks and actors outside any group: for those it waits up to ``release_wait_s``,
    saying so, then fails. Resources that live placement groups hold (a running Serve app, an
    engine) fail it at once."""
    need: dict[str, float] = {}
    for bundle in bundles or engine_bundles(config, use_gpu):
        for name, amount in bundle.items():
            need[name] = round(need.get(name, 0.0) + amount * count, 6)
    what = (f"{count} engine(s) with tensor_parallel_size={config.tensor_parallel_size}"
            + (f" and pipeline_parallel_size={config.pipeline_parallel_size}"
               if config.pipeline_parallel_size > 1 else ""))
    total = _amounts(ray.cluster_resources(), need)
    if not _covers(total, need):
        raise ValueError(f"{what} need {need} but the whole cluster has only {total}")
    if not free_now or _covers(_amounts(ray.available_resources(), need), need):
        return
    held = live_group_resources(need)
    unheld = {k: round(total[k] - held[k], 6) for k in need}
    if _covers(unheld, need):
        logger.warning("%s need %s; waiting up to %.0f s for resources being given back (free "
                       "now: %s)", what, need, release_wait_s,
                       _amounts(ray.available_resources(), need))
        if _wait_until_free(need, release_wait_s):
            return
    free = _amounts(ray.available_resources(), need)
    holders = (f"live placement groups hold {held}, e.g. a running Serve app or engine"
               if any(held.values()) else f"nothing gave them back within {release_wait_s:.0f} s")
    raise ValueError(f"{what} need {need} but only {free} of the cluster's {total} are free "
                     f"now ({holders})")


def live_group_resources(names: dict[str, float]) -> dict[str, float]:
    """What the placement groups that are not removed hold of ``names`` (their bundles)."""
    from ray.util.placement_group import placement_group_table  # noqa: PLC0415

    held = dict.fromkeys(names, 0.0)
    for group in placement_group_table().values():
        if group.get("state") == "REMOVED":
            continue
        for bundle in group.get("bundles", {}).values():
            for name in names:
                held[name] = round(held[name] + bundle.get(name, 0.0), 6)
    return held


def _wait_until_free(need: dict[str, float], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _covers(_amounts(ray.available_resources(), need), need):
            return True
        time.sleep(0.25)
    return _covers(_amounts(ray.available_resources(), need), need)


def _amounts(resources: dict[str, float], names: dict[str, float]) -> dict[str, float]:
    return {k: round(resources.get(k, 0.0), 6) for k in names}


def _covers(have: dict[str, float], need: dict[str, float]) -> bool:
    return all(have[k] + 1e-9 >= v for k, v in need.items())


def create_engine_placement_group(config: EngineConfig, use_gpu: bool) -> PlacementGroup:
    """The engine's group, once the cluster has room for it now: what it lacks fails at once
    (``check_engines_fit`` with ``free_now``), not after a silent wait for a placement."""
    check_engines_fit(config, use_gpu, free_now=True)
    bundles = engine_bundles(config, use_gpu)
    pg = placement_group(bundles, strategy=config.placement_strategy, name="")
    ready, _ = ray.wait([pg.ready()], timeout=_READY_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        need = {name: 0.0 for bundle in bundles for name in bundle}
        raise RuntimeError(f"the cluster cannot place this engine within {_READY_TIMEOUT_S:.0f} s: it "
                           f"needs bundles {bundles} ({config.placement_strategy}); the cluster has "
                           f"{_amounts(ray.cluster_resources(), need)}, "
                           f"{_amounts(ray.available_resources(), need)} of them free")
    return pg


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=False)
