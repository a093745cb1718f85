"""``python -m nvray.bench soak``: a bounded soak of the HTTP app under streaming load.

For ``--minutes``, ``--concurrency`` clients each send one streamed completion after another
(random prompts, ``max_tokens`` uniform in [16, ``--output-len``]); with probability
``--disconnect`` a client stops reading after a random number of chunks and closes the
connection. Every other stream must end with its final chunk and ``[DONE]``, without an error
event: anything else is an unexpected error. Every ``--sample-s`` seconds it records the
engine's KV cache usage, running requests and its driver process's resident memory (all from
``/metrics``). At the
end it waits for the engine to drain and reports the counts, the memory first / last / max and
the usage after draining (0 when nothing leaked).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from nvray.bench.http_load import (LoadSpec, auth_headers, metric_value, request_body,
                                   start_app)


async def metric(session: Any, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    value = metric_value(text, name)
    return float("nan") if value is None else value


async def one_stream(session: Any, spec: LoadSpec, rng: random.Random, disconnect: float,
                     counts: dict[str, int]) -> None:
    path, body = request_body(spec, rng, stream=True)
    body["max_tokens"] = rng.randint(16, spec.output_len)
    cut_after = rng.randrange(0, 8) if rng.random() < disconnect else None
    try:
        async with session.post(spec.url + path, json=body, headers=auth_headers(spec)) as resp:
            if resp.status != 200:
                counts["unexpected"] += 1
                return
            chunks, done, error = 0, False, False
            async for line in resp.content:
                if cut_after is not None and chunks >= cut_after:
                    counts["disconnected"] += 1
                    return  # leaving the block closes the connection mid-stream
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    chunks += 1
                    error = error or "error" in json.loads(line[6:])
            ok = done and not error
            counts["completed" if ok else "unexpected"] += 1
    except Exception:  # noqa: BLE001 - counted
        counts["unexpected"] += 1


async def client_loop(session: Any, spec: LoadSpec, seed: int, deadline: float,
                      disconnect: float, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        await one_stream(session, spec, rng, disconnect, counts)


async def soak(spec: LoadSpec, minutes: float, concurrency: int, disconnect: float,
               sample_s: float) -> dict[str, Any]:
    import aiohttp  # noqa: PLC0415 - Ray Serve's own dependency

    counts = {"completed": 0, "disconnected": 0, "unexpected": 0}
    samples: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60 * minutes
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        clients = [asyncio.create_task(client_loop(session, spec, i, deadline, disconnect, counts))
                   for i in range(concurrency)]
        start = time.monotonic()
        while time.monotonic() < deadline:
            await asyncio.sleep(sample_s)
            samples.append({"t_s": round(time.monotonic() - start),
                            "kv_cache_usage": await metric(session, spec.url, "nvray_kv_cache_usage_ratio"),
                            "running": await metric(session, spec.url, "nvray_num_requests_running"),
                            "driver_rss_mib": round(await metric(
                                session, spec.url, "nvray_driver_resident_memory_bytes") / 2**20, 1),
                            **counts})
            print(json.dumps(samples[-1]), flush=True)
        await asyncio.gather(*clients)
        drained_in = None
        for i in range(300):  # the engine must drain: nothing running, every block free
            if (await metric(session, spec.url, "nvray_num_requests_running") == 0
                    and await metric(session, spec.url, "nvray_kv_cache_usage_ratio") == 0.0):
                drained_in = round(i * 0.1, 1)
                break
            await asyncio.sleep(0.1)
    rss = [s["driver_rss_mib"] for s in samples if s["driver_rss_mib"] == s["driver_rss_mib"]]
    return {"benchmark": "soak", "minutes": minutes, "concurrency": concurrency,
            "disconnect_probability": disconnect, **counts,
            "drained_within_s": drained_in,
            "driver_rss_mib": {"first": rss[0], "last": rss[-1], "max": max(rss)} if rss else None,
            "max_kv_cache_usage": max(s["kv_cache_usage"] for s in samples) if samples else None,
            "samples": samples}


def run(args: Any) -> dict[str, Any]:
    engine_options = {"num_kvcache_blocks": args.kv_blocks} if args.kv_blocks else {}
    url = args.url or start_app({"max_model_len": 512, "engine_options": engine_options}, args.port)
    spec = LoadSpec(url.rstrip("/"), prompt_len=args.prompt_len, output_len=args.output_len,
                    api_key=args.api_key, max_token_id=400)
    return asyncio.run(soak(spec, args.minutes, args.concurrency, args.disconnect, args.sample_s))


def add_arguments(p: Any) -> None:
    p.add_argument("--url", help="base URL of a running app (default: start the tiny app here)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--disconnect", type=float, default=0.3, help="probability a client leaves early")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--api-key")
    p.add_argument("--kv-blocks", type=int,
                   help="KV blocks of the app this starts (few: the prefix cache fills and recycles "
                        "within the soak, so memory must level off)")
