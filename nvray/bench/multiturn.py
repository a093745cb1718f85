"""``python -m nvray.bench serve --workload multiturn``: multi-turn chat against one or two apps.

``--conversations`` chats of ``--turns`` turns each, at most ``--parallel`` conversations at
once; every turn resends the conversation's whole history (a shared system prompt of
``--system-len`` words, then its own first question, the answers and the follow-ups, each
user message ``--prompt-len`` random words) and streams ``--output-len`` tokens. Conversations
start spread over the first second, so that the first turns are in flight together.

Per app: prefix-cache hit rate (cached prompt tokens / prompt tokens, from each answer's
``usage``), TTFT p50/p90/p99 of all turns and of the later turns (those that could reuse the
history's KV), requests and output tokens per second, errors, and the ingress's routing
decisions (``nvray_router_requests_total``) when it has a prefix-aware router.

Without ``--url`` it starts the same app on this machine's Ray cluster with
``prefix_routing=true``, runs the conversations, deletes it, and does the same with
``prefix_routing=false`` (Serve's default router): the two routers side by side, on the same
conversations, in one run.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from typing import Any

from nvray.bench.http_load import (WORDS, LoadSpec, RequestRecord, auth_headers, percentiles,
                                   send, start_app)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(session: Any, spec: LoadSpec, index: int, turns: int, system: str,
                       rng: random.Random, records: list[tuple[int, RequestRecord]]) -> None:
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        history.append({"role": "user",
                        "content": f"Conversation {index}, turn {turn}: {words(rng, spec.prompt_len)}"})
        body: dict[str, Any] = {"model": spec.model, "messages": history, "stream": True,
                                "max_tokens": spec.output_len, "temperature": 0,
                                "ignore_eos": True, "stream_options": {"include_usage": True}}
        rec = await send(session, spec, "/v1/chat/completions", body)
        records.append((turn, rec))
        if not rec.ok:
            return
        history.append({"role": "assistant", "content": rec.text})


async def routing_decisions(session: Any, spec: LoadSpec) -> dict[str, float] | None:
    async with session.get(spec.url + "/metrics", headers=auth_headers(spec)) as resp:
        text = await resp.text()
    found = re.findall(r'^nvray_router_requests_total\{[^}]*by="(\w+)"[^}]*\} (\S+)$', text, re.M)
    return {by: float(v) for by, v in found} or None


async def run_conversations(spec: LoadSpec, conversations: int, turns: int, concurrency: int,
                            system_len: int, seed: int) -> dict[str, Any]:
    import aiohttp  # noqa: PLC0415 - Ray Serve's own dependency

    rng = random.Random(seed)
    system = f"You are a careful assistant. {words(rng, system_len)}"
    seeds = [rng.randrange(2**31) for _ in range(conversations)]
    records: list[tuple[int, RequestRecord]] = []
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        async with session.get(spec.url + "/v1/models", headers=auth_headers(spec)) as resp:
            spec.model = spec.model or (await resp.json())["data"][0]["id"]
        before = await routing_decisions(session, spec)

        async def one(i: int) -> None:
            await asyncio.sleep(i / max(conversations, 1))  # starts spread over one second
            async with gate:
                await conversation(session, spec, i, turns, system, random.Random(seeds[i]),
                                   records)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(conversations)))
        wall = time.perf_counter() - start
        after = await routing_decisions(session, spec)
    routed = None if after is None else {k: v - (before or {}).get(k, 0.0) for k, v in after.items()}
    return summarize(records, wall, routed)


def summarize(records: list[tuple[int, RequestRecord]], wall: float,
              routed: dict[str, float] | None) -> dict[str, Any]:
    ok = [(turn, r) for turn, r in records if r.ok]
    prompt = sum(r.prompt_tokens for _, r in ok)
    cached = sum(r.cached_tokens for _, r in ok)
    errors = [r.error for _, r in records if not r.ok]
    return {
        "requests": len(records), "completed": len(ok), "errors": len(errors),
        "error_samples": sorted(set(e for e in errors if e))[:3], "wall_s": round(wall, 3),
        "prefix_cache_hit_rate": round(cached / prompt, 4) if prompt else None,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "ttft_ms": percentiles([r.ttft_s for _, r in ok if r.ttft_s is not None]),
        "ttft_ms_later_turns": percentiles([r.ttft_s for t, r in ok
                                            if t > 0 and r.ttft_s is not None]),
        "requests_per_s": round(len(ok) / wall, 2) if wall else 0.0,
        "output_tok_per_s": round(sum(r.output_tokens for _, r in ok) / wall, 1) if wall else 0.0,
        "routed": routed,
        "by_turn": [_turn_summary(t, [r for turn, r in ok if turn == t])
                    for t in sorted({turn for turn, _ in ok})],
    }


def _turn_summary(turn: int, records: list[RequestRecord]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in records)
    return {"turn": turn, "requests": len(records),
            "prompt_tokens_mean": round(prompt / len(records), 1),
            "prefix_cache_hit_rate": round(sum(r.cached_tokens for r in records) / prompt, 4)
            if prompt else None,
            "ttft_ms_p50": percentiles([r.ttft_s for r in records if r.ttft_s is not None])["p50"]}


def run(args: Any, app_args: dict[str, Any]) -> dict[str, Any]:
    """One app (``--url``), or the same app with and without prefix routing, one after the
    other (each deleted before the next starts, so both get the whole machine)."""
    result: dict[str, Any] = {
        "benchmark": "serve-multiturn", "conversations": args.conversations,
        "turns": args.turns, "parallel": args.parallel, "system_len": args.system_len,
        "prompt_len": args.prompt_len, "output_len": args.output_len,
        "app_args": None if args.url else app_args}
    if args.url:
        result["given"] = _run_against(args, args.url.rstrip("/"))
        return result
    from ray import serve  # noqa: PLC0415

    for name, on in (("prefix_router", True), ("default_router", False)):
        url = start_app({**app_args, "prefix_routing": on}, args.port, name)
        try:
            result[name] = _run_against(args, url)
        finally:
            serve.delete(name)
        print(json.dumps({name: result[name]}), flush=True)
    return result


def _run_against(args: Any, url: str) -> dict[str, Any]:
    spec = LoadSpec(url, args.model, "chat", args.prompt_len, args.output_len, args.api_key)
    return asyncio.run(run_conversations(spec, args.conversations, args.turns, args.parallel,
                                         args.system_len, args.seed))
