"""``python -m nvray.bench serve``: a load generator for a running nvray app (or one it starts).

For each concurrency level (default 1, 8, 64, 256) it sends a bounded number of requests to
``/v1/completions`` (``--api chat``: ``/v1/chat/completions``; ``messages``: Anthropic's
``/v1/messages``; ``responses``: OpenAI's ``/v1/responses``), streaming and not, keeping at most
``concurrency`` in flight; with ``--rate`` arrivals are Poisson at that many requests/s.
Prompts are random token ids (the other APIs: one user message of random words), different for
every request, level and API, so the prefix cache plays no part; ``ignore_eos`` makes every
request run to ``--output-len`` tokens (Messages and Responses have no ``ignore_eos``: greedy, they
stop where chat would without it). Several APIs (``--api chat,messages,responses``) run side by
side against the same app, each level of each in turn, and ``side_by_side`` gives each API's
median TTFT and output tok/s at each level as a ratio to the first API's.

Per level: time to first token (TTFT), inter-token latency (ITL: the gap between two chunks
spread over the tokens of the later one, one sample per token, so a chunk carrying k tokens
counts k times its gap / k), time per output token after the first (TPOT), end-to-end latency
(p50/p90/p99), output tokens/s (all output tokens / the level's wall time), tokens per chunk,
errors, and the engine's median step time while the batch was full (from ``/metrics``). Tokens
per chunk come from ``stream_options.continuous_usage_stats``; a server that ignores it is
counted as one token per chunk. The floor of the path is a bare ``GET /v1/models`` round trip.
Each level also gives the engines' own mean TTFT (arrival at the engine to its first token, from
``/metrics``: the rest of the client's TTFT is the HTTP path), and the cores that Serve's proxy, the replicas, the engine drivers and ranks on
this machine, and the load generator itself, used while it ran (``cores``, from ``/proc``);
``--clients N`` sends the load from N processes, so that one Python process parsing every
stream's chunks is not what limits streamed throughput.

``--workload multiturn`` runs multi-turn chats instead (``nvray/bench/multiturn.py``): prefix-
cache hit rate and TTFT with and without prefix-aware routing; ``--workload lora-mix`` an even
and a skewed mix of LoRA adapters over two replicas, with and without adapter-aware routing
(``nvray/bench/lora_mix.py``).

``--out results.json`` writes the figures, and a PNG chart next to it (throughput and latency
against concurrency) when matplotlib is installed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
from dataclasses import replace
from typing import Any

from nvray.bench import lora_mix, multiturn
from nvray.bench.http_load import (APIS, LoadSpec, RequestRecord, auth_headers, percentiles,
                                   read_model_card, request_body, send, start_app)
from nvray.bench.proc_cpu import SERVING_PROCESSES, cores_by_role, process_cpu_seconds


async def engine_step_sampler(session: Any, spec: LoadSpec, full_batch: int,
                              samples: list[float]) -> None:
    """Sample the engine's median step time while (nearly) ``full_batch`` requests run."""
    while True:
        await asyncio.sleep(0.5)
        try:
            async with session.get(spec.url + "/metrics") as resp:
                text = await resp.text()
        except Exception:  # noqa: BLE001 - metrics are optional (another server)
            return
        values = dict(line.split("{")[0:1] + [line.rsplit(" ", 1)[-1]] for line in text.splitlines()
                      if line.startswith("nvray_") and "{" in line and "_bucket" not in line)
        if "nvray_step_time_ms_median" not in values:
            return
        if float(values.get("nvray_num_requests_running", 0)) >= 0.9 * full_batch:
            samples.append(float(values["nvray_step_time_ms_median"]))


async def engine_ttft_totals(session: Any, spec: LoadSpec) -> tuple[float, int]:
    """The engines' time-to-first-token sum (s) and count so far, from ``/metrics``: the
    engine's own TTFT (arrival at the engine to first token), beside the client's."""
    try:
        async with session.get(spec.url + "/metrics") as resp:
            text = await resp.text()
    except Exception:  # noqa: BLE001 - metrics are optional (another server)
        return 0.0, 0
    total, count = 0.0, 0
    for line in text.splitlines():
        if line.startswith("nvray_time_to_first_token_seconds_sum"):
            total += float(line.rsplit(" ", 1)[-1])
        elif line.startswith("nvray_time_to_first_token_seconds_count"):
            count += int(float(line.rsplit(" ", 1)[-1]))
    return total, count


async def run_share(session: Any, spec: LoadSpec, bodies: list[tuple[str, dict[str, Any]]],
                    delays: list[float], concurrency: int) -> list[RequestRecord]:
    """Send ``bodies`` (each after its delay), at most ``concurrency`` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> RequestRecord:
        await asyncio.sleep(delays[i])
        async with gate:
            return await send(session, spec, *bodies[i])

    return await asyncio.gather(*(one(i) for i in range(len(bodies))))


def client_process_share(spec: LoadSpec, bodies: list[tuple[str, dict[str, Any]]],
                         delays: list[float], concurrency: int) -> tuple[list[RequestRecord], float]:
    """One client process's share of a level (``--clients``): its records and CPU seconds."""
    import aiohttp  # noqa: PLC0415

    async def main() -> list[RequestRecord]:
        timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout) as session:
            return await run_share(session, spec, bodies, delays, concurrency)

    cpu = time.process_time()
    records = asyncio.run(main())
    return records, time.process_time() - cpu


def split_level(num_items: int, concurrency: int, clients: int) -> list[tuple[list[int], int]]:
    """Request indices and concurrency of each client process: round-robin requests, the
    concurrency spread as evenly as it goes (no process without a slot)."""
    shares = min(clients, concurrency, num_items)
    return [(list(range(k, num_items, shares)), concurrency // shares + (k < concurrency % shares))
            for k in range(shares)]


async def run_level(session: Any, spec: LoadSpec, concurrency: int, num_requests: int,
                    stream: bool, rate: float | None, seed: int,
                    pool: Any = None, clients: int = 1) -> dict[str, Any]:
    """One level; with a process ``pool``, its requests are sent from ``clients`` processes."""
    rng = random.Random(f"{seed}/{spec.api}/{concurrency}/{stream}")  # no prompt seen before
    bodies = [request_body(spec, rng, stream) for _ in range(num_requests)]
    step_samples: list[float] = []
    sampler = asyncio.ensure_future(engine_step_sampler(session, spec, concurrency, step_samples))
    delays, t = [], 0.0
    for _ in range(num_requests):
        delays.append(t)
        t += rng.expovariate(rate) if rate else 0.0
    ttft_before = await engine_ttft_totals(session, spec)
    procs_before, start = process_cpu_seconds(SERVING_PROCESSES), time.perf_counter()
    client_cpu = time.process_time()
    if pool is None:
        records = await run_share(session, spec, bodies, delays, concurrency)
    else:
        loop, futures = asyncio.get_running_loop(), []
        for indices, share in split_level(num_requests, concurrency, clients):
            futures.append(loop.run_in_executor(
                pool, client_process_share, spec, [bodies[i] for i in indices],
                [delays[i] for i in indices], share))
        shares = await asyncio.gather(*futures)
        records = [r for recs, _ in shares for r in recs]
        client_cpu -= sum(cpu for _, cpu in shares)
    wall = time.perf_counter() - start
    cores = cores_by_role(procs_before, process_cpu_seconds(SERVING_PROCESSES), wall)
    cores["bench_clients"] = round((time.process_time() - client_cpu) / wall, 3)
    sampler.cancel()
    ttft_sum, ttft_count = (a - b for a, b in zip(await engine_ttft_totals(session, spec), ttft_before))
    engine_ttft = round(1e3 * ttft_sum / ttft_count, 3) if ttft_count else None
    return {"api": spec.api, **summarize(records, wall, concurrency, stream, rate, step_samples),
            "engine_ttft_ms_mean": engine_ttft, "cores": cores}


def summarize(records: list[RequestRecord], wall: float, concurrency: int, stream: bool,
              rate: float | None, step_samples: list[float]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.ttft_s is not None and r.output_tokens > 1]
    chunks = sum(r.num_chunks for r in ok)
    errors = [r.error for r in records if not r.ok]
    return {
        "concurrency": concurrency, "stream": stream, "rate_rps": rate, "requests": len(records),
        "completed": len(ok), "errors": len(errors), "error_samples": sorted(set(errors))[:3],
        "wall_s": round(wall, 3), "output_tokens": tokens,
        "output_tok_per_s": round(tokens / wall, 1) if wall else 0.0,
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": percentiles([g for r in ok for g in r.itl_s]),
        "tpot_ms": percentiles(tpot),
        "e2e_ms": percentiles([r.e2e_s for r in ok]),
        "tokens_per_chunk": round(tokens / chunks, 2) if stream and chunks else None,
        "engine_step_ms_at_full_batch": round(statistics.median(step_samples), 3) if step_samples else None,
    }


async def bare_route_floor(session: Any, spec: LoadSpec, n: int = 50) -> dict[str, Any]:
    headers = auth_headers(spec)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        async with session.get(spec.url + "/v1/models", headers=headers) as resp:
            await resp.read()
        times.append(time.perf_counter() - start)
    return {"route": "GET /v1/models", "round_trip_ms": percentiles(times)}


def client_pool(clients: int) -> Any:
    """Processes that send the load (``--clients`` > 1), started before the first level."""
    if clients <= 1:
        return None
    import multiprocessing  # noqa: PLC0415
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

    pool = ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn"))
    list(pool.map(split_level, [1] * clients, [1] * clients, [1] * clients))  # start them all
    return pool


def side_by_side(results: list[dict[str, Any]], apis: list[str]) -> list[dict[str, Any]]:
    """Each level's median TTFT and output tok/s per API, and their ratios to the first API's."""
    first = {(r["concurrency"], r["stream"]): r for r in results if r["api"] == apis[0]}
    ratio = lambda a, b: round(a / b, 3) if a and b else None  # noqa: E731
    rows = []
    for r in results:
        base = first[r["concurrency"], r["stream"]]
        rows.append({"api": r["api"], "concurrency": r["concurrency"], "stream": r["stream"],
                     "ttft_ms_p50": r["ttft_ms"]["p50"], "output_tok_per_s": r["output_tok_per_s"],
                     "output_tokens": r["output_tokens"], "errors": r["errors"],
                     f"ttft_vs_{apis[0]}": ratio(r["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
                     f"tok_per_s_vs_{apis[0]}": ratio(r["output_tok_per_s"],
                                                      base["output_tok_per_s"])})
    return rows


async def sweep(spec: LoadSpec, levels: list[int], streams: list[bool], num_requests: int | None,
                rate: float | None, seed: int = 0, rounds: float = 2.0,
                clients: int = 1, apis: list[str] | None = None) -> dict[str, Any]:
    """Each level of each API in turn (``apis``, default ``[spec.api]``), against one app."""
    import aiohttp  # noqa: PLC0415 - Ray Serve's own dependency

    apis = apis or [spec.api]
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        await read_model_card(session, spec)
        specs = {api: replace(spec, api=api) for api in apis}
        for one in specs.values():  # warm-up
            await send(session, one, *request_body(one, random.Random(-1), True))
        floor = await bare_route_floor(session, spec)
        results, pool = [], client_pool(clients)
        try:
            for concurrency in levels:
                n = num_requests or max(int(rounds * concurrency), 16)
                for stream in streams:
                    for api in apis:
                        results.append(await run_level(session, specs[api], concurrency, n, stream,
                                                       rate, seed, pool, clients))
                        print(json.dumps(results[-1]), flush=True)
        finally:
            if pool is not None:
                pool.shutdown()
    result = {"benchmark": "serve", "url": spec.url, "model": spec.model, "api": ",".join(apis),
              "prompt_len": spec.prompt_len, "output_len": spec.output_len, "clients": clients,
              "floor": floor, "levels": results}
    if len(apis) > 1:
        result["side_by_side"] = side_by_side(results, apis)
    return result


def table(result: dict[str, Any]) -> str:
    """The sweep's levels as a short text table (the JSON has every figure)."""
    def ms(figures: dict[str, Any], key: str) -> str:
        value = figures[key]
        return "-" if value is None else f"{value:.1f}"

    header = ("api", "conc", "stream", "ok/req", "tok/s", "TTFT p50", "TTFT p99", "ITL p50",
              "E2E p50")
    rows = [header] + [(
        r["api"], str(r["concurrency"]), "on" if r["stream"] else "off",
        f"{r['completed']}/{r['requests']}", f"{r['output_tok_per_s']:.1f}",
        ms(r["ttft_ms"], "p50"), ms(r["ttft_ms"], "p99"), ms(r["itl_ms"], "p50"),
        ms(r["e2e_ms"], "p50")) for r in result["levels"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:],
                      "(milliseconds; tok/s: output tokens per second of the level's wall time)"])


def save_chart(result: dict[str, Any], path: str) -> str | None:
    """Throughput and latency against concurrency, as a PNG (None without matplotlib)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(11, 4))
    apis = list(dict.fromkeys(r["api"] for r in result["levels"]))
    for api, stream in itertools.product(apis, (False, True)):
        rows = [r for r in result["levels"] if r["stream"] == stream and r["api"] == api]
        if not rows:
            continue
        label = "streaming" if stream else "non-streaming"
        label += f", {api}" if len(apis) > 1 else ""
        conc = [r["concurrency"] for r in rows]
        ax_tput.plot(conc, [r["output_tok_per_s"] for r in rows], marker="o", label=label)
        if stream:
            ax_lat.plot(conc, [r["ttft_ms"]["p50"] for r in rows], marker="o",
                        label=f"TTFT p50 ({label})")
            if rows[0]["itl_ms"]["p50"] is not None:  # Messages and Responses have none
                ax_lat.plot(conc, [r["itl_ms"]["p50"] for r in rows], marker="o",
                            label=f"ITL p50 ({label})")
        ax_lat.plot(conc, [(r["e2e_ms"]["p50"] or 0) / 10 for r in rows], marker="x",
                    linestyle=":", label=f"e2e p50 / 10 ({label})")
    for ax, title in ((ax_tput, "output tokens/s"), (ax_lat, "latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"nvray serve: {result['model']}, prompt {result['prompt_len']} / "
                 f"output {result['output_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def parse_app_args(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs as ``serve run deployments:build_app`` takes them."""
    args: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"app argument {item!r} is not key=value")
        args[key] = value
    return args


def run(args: Any) -> dict[str, Any]:
    if args.workload == "multiturn":
        return multiturn.run(args, parse_app_args(args.app_args or []))
    if args.workload == "lora-mix":
        return lora_mix.run(args, parse_app_args(args.app_args or []))
    apis = args.api.split(",")
    if any(api not in APIS for api in apis) or len(set(apis)) < len(apis):
        raise SystemExit(f"--api {args.api!r}: give one or more of {', '.join(APIS)}, "
                         "comma-separated, each once")
    url = args.url
    if url is None:
        url = start_app(parse_app_args(args.app_args or []), args.port)
    spec = LoadSpec(url.rstrip("/"), args.model, apis[0], args.prompt_len, args.output_len,
                    args.api_key)
    streams = {"both": [False, True], "on": [True], "off": [False]}[args.stream]
    levels = [int(c) for c in args.concurrency.split(",")]
    result = asyncio.run(sweep(spec, levels, streams, args.num_requests, args.rate, args.seed,
                               args.rounds, args.clients, apis))
    if args.out:
        result["chart"] = save_chart(result, args.out.rsplit(".", 1)[0] + ".png")
    return result


def add_arguments(p: Any) -> None:
    p.add_argument("--workload", choices=("sweep", "multiturn", "lora-mix"), default="sweep",
                   help="sweep: concurrency sweep (below); multiturn: chats resending their "
                        "history (nvray/bench/multiturn.py); lora-mix: an even and a skewed mix "
                        "of LoRA adapters over two replicas (nvray/bench/lora_mix.py); both "
                        "without --url against the app with and without prefix routing")
    p.add_argument("--url", help="base URL of a running app (default: start one here)")
    p.add_argument("--app-args", nargs="*", metavar="KEY=VALUE",
                   help="arguments of the app to start (as serve run deployments:build_app takes)")
    p.add_argument("--port", type=int, default=8000, help="port of the app this starts")
    p.add_argument("--model", help="model name to send (default: the app's)")
    p.add_argument("--api", default="completions",
                   help="comma-separated, run side by side against one app (ratios to the "
                        "first): completions, chat (completions), messages (Anthropic's), "
                        "responses (OpenAI's)")
    p.add_argument("--concurrency", default="1,8,64,256", help="comma-separated levels")
    p.add_argument("--rounds", type=float, default=2.0,
                   help="requests per level = rounds x concurrency (at least 16)")
    p.add_argument("--num-requests", type=int, help="requests per level, whatever the concurrency")
    p.add_argument("--rate", type=float, help="Poisson arrivals at this many requests/s (default: all at once)")
    p.add_argument("--stream", choices=("both", "on", "off"), default="both")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--api-key")
    p.add_argument("--clients", type=int, default=1,
                   help="processes that send the load, so that parsing the chunks of many streams "
                        "is not the limit (each level reports the cores they used)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=64, help="multiturn: conversations")
    p.add_argument("--turns", type=int, default=6, help="multiturn: turns per conversation")
    p.add_argument("--parallel", type=int, default=16,
                   help="multiturn: conversations in flight at once; lora-mix: requests")
    p.add_argument("--adapters", type=int, default=8, help="lora-mix: adapters")
    p.add_argument("--lora-rank", type=int, default=16, help="lora-mix: their rank")
    p.add_argument("--max-loras", type=int, default=4, help="lora-mix: GPU slots a replica")
    p.add_argument("--hot-share", type=float, default=0.5,
                   help="lora-mix: the hot adapter's share of the skewed mix's requests")
    p.add_argument("--system-len", type=int, default=200,
                   help="multiturn: words of the system prompt all conversations share")
