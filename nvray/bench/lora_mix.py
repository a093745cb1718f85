"""``python -m nvray.bench serve --workload lora-mix``: multi-LoRA traffic over two replicas.

``--adapters`` random rank-``--lora-rank`` adapters (``lora_adapters.py``, for the projections
of the app's checkpoint, from its ``config.json``) are declared in the app (``lora_modules``),
which runs two engine replicas with ``--max-loras`` slots each. ``--num-requests`` streamed
completions of ``--prompt-len`` random token ids (different for every request, so only the
adapter is shared) and ``--output-len`` tokens, at most ``--parallel`` in flight, each naming an
adapter drawn from one of two mixes, on the same seed:

- ``even``: every adapter equally likely;
- ``skewed``: one adapter takes ``--hot-share`` of the requests (half by default), the others
  share the rest evenly.

Without ``--url`` the app runs twice, with nvray's prefix router (adapter affinity;
``prefix_routing=true``) and with Serve's default router, each deleted before the next starts.
Per mix: output tok/s, TTFT p50/p90/p99, errors, the adapter loads into GPU slots over both
engines and by engine (``nvray_lora_loads_total``, from several ``/metrics`` reads, as each
reaches one replica; an engine not listed before a mix counts from zero) and the hot
adapter's replicas at the end (``nvray_lora_resident``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import tempfile
import time
from typing import Any

from nvray.bench.http_load import (LoadSpec, RequestRecord, auth_headers, percentiles,
                                   read_model_card, send, start_app)

MIXES = ("even", "skewed")


def checkpoint_targets(model_dir: str) -> dict[str, tuple[int, int]]:
    """Every attention and MLP projection of a Llama-like checkpoint (Qwen3, Llama 3): module
    name -> full (in, out) features, from its ``config.json``."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg.get("num_key_value_heads", heads) * head_dim
    mlp = cfg["intermediate_size"]
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv),
              "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (q, hidden),
              "mlp.gate_proj": (hidden, mlp), "mlp.up_proj": (hidden, mlp),
              "mlp.down_proj": (mlp, hidden)}
    return {f"model.layers.{i}.{m}": s for i in range(cfg["num_hidden_layers"])
            for m, s in shapes.items()}


def write_adapters(model_dir: str, folder: str, count: int, rank: int) -> dict[str, str]:
    """``count`` adapters (names ``mix-0``...) over the same random tensors (their loads are
    measured, not their values)."""
    from nvray.bench.lora_adapters import clone_adapter, write_random_adapter  # noqa: PLC0415

    first = write_random_adapter(os.path.join(folder, "mix-0"), checkpoint_targets(model_dir),
                                 rank, seed=0)
    paths = {"mix-0": first}
    for i in range(1, count):
        paths[f"mix-{i}"] = clone_adapter(first, os.path.join(folder, f"mix-{i}"))
    return paths


def pick_adapters(mix: str, names: list[str], num_requests: int, hot_share: float,
                  seed: int) -> list[str]:
    rng = random.Random(seed)
    if mix == "even":
        return [rng.choice(names) for _ in range(num_requests)]
    return [names[0] if rng.random() < hot_share else rng.choice(names[1:])
            for _ in range(num_requests)]


async def metric_values(session: Any, spec: LoadSpec, name: str, reads: int = 12
                        ) -> dict[str, float]:
    """``name``'s samples over the app's engines: label text -> value. Each ``/metrics`` read
    reaches one replica of the app, which lists the engines it knows (labelled by engine), so
    several reads are merged, a counter's largest reading kept."""
    found: dict[str, float] = {}
    for _ in range(reads):
        async with session.get(spec.url + "/metrics", headers=auth_headers(spec)) as resp:
            text = await resp.text()
        for labels, value in re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
            found[labels] = max(found.get(labels, 0.0), float(value))
    return found


def _engine_of(labels: str) -> str:
    m = re.search(r'engine="([^"]*)"', labels)
    return m.group(1) if m else ""


async def run_mix(spec: LoadSpec, adapters: list[str], parallel: int, seed: int
                  ) -> dict[str, Any]:
    import aiohttp  # noqa: PLC0415 - Ray Serve's own dependency

    rng = random.Random(seed)
    gate = asyncio.Semaphore(parallel)
    records: list[RequestRecord] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=spec.timeout_s)
                                     ) as session:
        await read_model_card(session, spec)  # the vocabulary the prompt ids are drawn below
        prompts = [[rng.randrange(spec.max_token_id) for _ in range(spec.prompt_len)]
                   for _ in adapters]
        before = await metric_values(session, spec, "nvray_lora_loads_total")

        async def one(adapter: str, prompt: list[int]) -> None:
            body = {"model": adapter, "prompt": prompt, "max_tokens": spec.output_len,
                    "ignore_eos": True, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            async with gate:
                records.append(await send(session, spec, "/v1/completions", body))

        start = time.perf_counter()
        await asyncio.gather(*(one(a, p) for a, p in zip(adapters, prompts)))
        wall = time.perf_counter() - start
        after = await metric_values(session, spec, "nvray_lora_loads_total")
        resident = await metric_values(session, spec, "nvray_lora_resident")
    ok = [r for r in records if r.ok]
    hot = adapters and max(set(adapters), key=adapters.count)
    return {"requests": len(records), "errors": len(records) - len(ok),
            "error_samples": sorted({r.error for r in records if r.error})[:3],
            "wall_s": round(wall, 2),
            "output_tok_per_s": round(sum(r.output_tokens for r in ok) / wall, 1),
            "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "hot_adapter": hot, "hot_share": round(adapters.count(hot) / len(adapters), 3),
            "lora_loads": sum(v - before.get(labels, 0.0) for labels, v in after.items()),
            "lora_loads_by_engine": sorted(v - before.get(labels, 0.0)
                                           for labels, v in after.items()),
            "hot_adapter_replicas": len({_engine_of(labels) for labels in resident
                                         if f'adapter="{hot}"' in labels})}


def run(args: Any, app_args: dict[str, Any]) -> dict[str, Any]:
    """Both mixes against one app (``--url``: its ``lora_modules`` must hold ``mix-0``...), or
    against the app with and without prefix routing, started here in turn."""
    result: dict[str, Any] = {
        "benchmark": "serve-lora-mix", "adapters": args.adapters, "lora_rank": args.lora_rank,
        "max_loras": args.max_loras, "num_requests": args.num_requests,
        "parallel": args.parallel, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "hot_share": args.hot_share}
    names = [f"mix-{i}" for i in range(args.adapters)]
    if args.url:
        result["given"] = _mixes(args, args.url.rstrip("/"), names)
        return result
    from ray import serve  # noqa: PLC0415

    from nvray.models.tiny import resolve_model  # noqa: PLC0415

    model = resolve_model(app_args.get("model", "tiny"))
    with tempfile.TemporaryDirectory(prefix="nvray-bench-mix-") as folder:
        paths = write_adapters(model, folder, args.adapters, args.lora_rank)
        base = {"min_replicas": 2, "max_replicas": 2, **app_args, "model": model,
                "lora_modules": paths, "max_loras": args.max_loras,
                "max_lora_rank": args.lora_rank}
        result["app_args"] = {k: v for k, v in base.items() if k != "lora_modules"}
        for name, on in (("prefix_router", True), ("default_router", False)):
            url = start_app({**base, "prefix_routing": on}, args.port, name)
            try:
                result[name] = _mixes(args, url, names)
            finally:
                serve.delete(name)
            print(json.dumps({name: result[name]}), flush=True)
    return result


def _mixes(args: Any, url: str, names: list[str]) -> dict[str, Any]:
    spec = LoadSpec(url, None, "completions", args.prompt_len, args.output_len, args.api_key)
    return {mix: asyncio.run(run_mix(spec, pick_adapters(mix, names, args.num_requests or 256,
                                                         args.hot_share, args.seed),
                                     args.parallel, args.seed))
            for mix in MIXES}
