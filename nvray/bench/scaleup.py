"""``python -m nvray.bench scaleup``: a burst that makes Serve add an engine replica.

The bench starts the app autoscaled from one engine replica to two (``min_replicas=1
max_replicas=2``, one ingress replica, ``upscale_delay_s`` 0 unless given), sends one request to
warm it, then ``--concurrency`` clients each send streamed completions back to back. It
watches the app's ``/metrics`` (each engine's generated tokens and start-up seconds) and Serve's
status, and reports, from the burst:
- when Serve had a second engine replica running, and when the new engine gave its first
  token (the new replica's first answer);
- the new engine's own start-up seconds, and the goal: start-up + 5 s;
- the requests' TTFT and end-to-end latency, those sent before the new engine answered and
  those after.
It stops ``--after-s`` seconds after the new engine's first token, or at ``--timeout-s``.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from typing import Any

from nvray.bench.http_load import (LoadSpec, RequestRecord, percentiles, read_model_card,
                                   request_body, send, start_app)
from nvray.bench.serve import parse_app_args

_ENGINE_SAMPLE = re.compile(r'^nvray_(generation_tokens_total|startup_total_seconds)\{([^}]*)\} (\S+)$',
                            re.M)


async def engines_seen(session: Any, url: str) -> dict[str, dict[str, float]]:
    """Per engine label in ``/metrics``: its generated tokens and start-up seconds."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    seen: dict[str, dict[str, float]] = {}
    for name, labels, value in _ENGINE_SAMPLE.findall(text):
        engine = re.search(r'engine="([^"]*)"', labels)
        key = engine.group(1) if engine else "replica"
        seen.setdefault(key, {})[name] = float(value)
    return seen


def engine_replicas_running(app_name: str) -> int:
    """Engine replicas Serve reports RUNNING (the NvrayEngine deployment, else NvrayServer)."""
    from ray import serve  # noqa: PLC0415

    deployments = serve.status().applications[app_name].deployments
    name = "NvrayEngine" if "NvrayEngine" in deployments else "NvrayServer"
    return deployments[name].replica_states.get("RUNNING", 0)


class Watch:
    """What the watcher saw, in seconds from the burst."""

    def __init__(self) -> None:
        self.second_replica_running_s: float | None = None
        self.new_engine_first_token_s: float | None = None
        self.new_engine_startup_s: float | None = None
        self.answered = asyncio.Event()


async def watch(session: Any, url: str, app_name: str | None, first: set[str], burst: float,
                seen_by: Watch, period_s: float = 0.25) -> None:
    while True:
        now = time.perf_counter() - burst
        for engine, sample in (await engines_seen(session, url)).items():
            if engine not in first and sample.get("generation_tokens_total", 0) > 0 \
                    and seen_by.new_engine_first_token_s is None:
                seen_by.new_engine_first_token_s = now
                seen_by.new_engine_startup_s = sample.get("startup_total_seconds")
                seen_by.answered.set()
        if app_name and seen_by.second_replica_running_s is None:
            if await asyncio.to_thread(engine_replicas_running, app_name) >= 2:
                seen_by.second_replica_running_s = time.perf_counter() - burst
        await asyncio.sleep(period_s)


async def client(session: Any, spec: LoadSpec, rng: random.Random, burst: float,
                 records: list[tuple[float, RequestRecord]]) -> None:
    while True:
        sent = time.perf_counter() - burst
        record = await send(session, spec, *request_body(spec, rng, True))
        records.append((sent, record))
        if not record.ok:
            await asyncio.sleep(0.5)  # counted; no retry storm


def latency(records: list[tuple[float, RequestRecord]]) -> dict[str, Any]:
    ok = [r for _, r in records if r.ok]
    return {"requests": len(records), "errors": len(records) - len(ok),
            "error_samples": sorted({r.error for _, r in records if not r.ok})[:3],
            "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "e2e_ms": percentiles([r.e2e_s for r in ok])}


async def burst_run(spec: LoadSpec, app_name: str | None, concurrency: int, after_s: float,
                    timeout_s: float) -> dict[str, Any]:
    import aiohttp  # noqa: PLC0415 - Ray Serve's own dependency

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await read_model_card(session, spec)
        await send(session, spec, *request_body(spec, random.Random(-1), True))  # warm-up
        first = set(await engines_seen(session, spec.url))
        burst, seen_by, records = time.perf_counter(), Watch(), []
        tasks = [asyncio.ensure_future(client(session, spec, random.Random(i), burst, records))
                 for i in range(concurrency)]
        watcher = asyncio.ensure_future(watch(session, spec.url, app_name, first, burst, seen_by))
        try:
            await asyncio.wait_for(seen_by.answered.wait(), timeout_s)
            await asyncio.sleep(after_s)
        except TimeoutError:
            pass
        finally:
            for task in [*tasks, watcher]:
                task.cancel()
            await asyncio.gather(*tasks, watcher, return_exceptions=True)
    answered = seen_by.new_engine_first_token_s
    done = [(t, r) for t, r in records if r.ok or r.error]
    return {
        "benchmark": "scaleup", "concurrency": concurrency, "first_engines": sorted(first),
        "burst_to_second_replica_running_s": _round(seen_by.second_replica_running_s),
        "burst_to_new_engine_first_token_s": _round(answered),
        "new_engine_startup_s": seen_by.new_engine_startup_s,
        "goal_s": _round(seen_by.new_engine_startup_s + 5.0) if seen_by.new_engine_startup_s else None,
        "before_new_engine": latency([(t, r) for t, r in done if answered is None or t < answered]),
        "after_new_engine": latency([(t, r) for t, r in done if answered is not None and t >= answered]),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def run(args: Any) -> dict[str, Any]:
    app_args = {"min_replicas": 1, "max_replicas": 2, "ingress_replicas": 1,
                "upscale_delay_s": 0, "target_ongoing_requests": max(1, args.concurrency // 4),
                **parse_app_args(args.app_args or [])}
    name = "nvray-scaleup"
    url = start_app(app_args, args.port, name)
    spec = LoadSpec(url, None, "completions", args.prompt_len, args.output_len)
    result = asyncio.run(burst_run(spec, name, args.concurrency, args.after_s, args.timeout_s))
    return {**result, "app_args": app_args}


def add_arguments(p: Any) -> None:
    p.add_argument("--app-args", nargs="*", metavar="KEY=VALUE",
                   help="app arguments (as serve run deployments:build_app takes them) on top "
                        "of min_replicas=1 max_replicas=2 ingress_replicas=1 upscale_delay_s=0 "
                        "target_ongoing_requests=concurrency/4")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--concurrency", type=int, default=32, help="clients sending back to back")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--after-s", type=float, default=5.0,
                   help="keep the load this long after the new engine's first token")
    p.add_argument("--timeout-s", type=float, default=180.0,
                   help="give up waiting for a second engine after this long")
