"""HTTP load against an nvray app: what the ``serve``, ``soak`` and multi-turn benchmarks share.

``LoadSpec`` says where requests go and what they look like; ``request_body`` draws one random
request of one of ``APIS`` (completions: random token ids; chat completions, Anthropic's Messages
and OpenAI's Responses: one user message of random ``WORDS``, the same message for the same
draws); ``send`` posts one and returns its ``RequestRecord`` (TTFT, inter-token gaps, tokens,
cached prompt tokens, the streamed text; a failed request is recorded with its error, never
raised). Streamed, completions and chat are read chunk by chunk (``read_stream``: tokens per
chunk from ``continuous_usage_stats``), Messages and Responses event by event (``read_events``:
TTFT at the first ``content_block_delta`` / ``response.output_text.delta``, output tokens from
the final usage; no inter-token gaps, an event's tokens being unknown). ``percentiles`` gives
p50/p90/p99 in milliseconds; ``metric_value`` reads one sample of the app's ``/metrics`` text;
``start_app`` starts the nvray app on this machine's Ray cluster and returns once its ``/health``
answers 200.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

# each API's route
APIS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
        "messages": "/v1/messages", "responses": "/v1/responses"}
WORDS = ("engine", "paged", "cache", "token", "stream", "batch", "kernel", "rank", "block",
         "prefix", "schedule", "decode", "prefill", "graph", "tensor", "replica")


@dataclass
class LoadSpec:
    url: str
    model: str | None = None
    api: str = "completions"  # or "chat", "messages", "responses" (APIS)
    prompt_len: int = 256
    output_len: int = 256
    api_key: str | None = None
    timeout_s: float = 600.0
    max_token_id: int = 10000  # prompt ids are drawn below this (and below the model's vocab)


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    output_tokens: int = 0
    num_chunks: int = 0
    itl_s: list[float] = field(default_factory=list)  # one per token after the first
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage)
    text: str = ""  # the streamed answer


def percentiles(values: list[float], scale: float = 1e3) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    pick = lambda q: round(scale * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)  # noqa: E731
    return {"p50": round(scale * statistics.median(ordered), 3), "p90": pick(0.9), "p99": pick(0.99)}


def metric_value(text: str, name: str) -> float | None:
    """The first sample of metric ``name`` (any labels) in Prometheus text; None if absent."""
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else None


def auth_headers(spec: LoadSpec) -> dict[str, str]:
    return {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}


def request_body(spec: LoadSpec, rng: random.Random, stream: bool) -> tuple[str, dict[str, Any]]:
    if spec.api == "completions":
        prompt: Any = [rng.randrange(spec.max_token_id) for _ in range(spec.prompt_len)]
    else:
        text = " ".join(rng.choice(WORDS) for _ in range(spec.prompt_len))
        prompt = [{"role": "user", "content": text}]
    common: dict[str, Any] = {"temperature": 0, "stream": stream}
    if spec.model:
        common["model"] = spec.model
    if spec.api == "messages":  # Anthropic's: no ignore_eos, no stream options
        return APIS["messages"], {**common, "max_tokens": spec.output_len, "messages": prompt}
    if spec.api == "responses":
        return APIS["responses"], {**common, "max_output_tokens": spec.output_len,
                                   "input": prompt, "store": False}
    common.update(max_tokens=spec.output_len, ignore_eos=True)
    if stream:
        common["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if spec.api == "chat":
        return APIS["chat"], {**common, "messages": prompt}
    return APIS["completions"], {**common, "prompt": prompt}


def chunk_has_output(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
            return True
    return False


async def send(session: Any, spec: LoadSpec, path: str, body: dict[str, Any]) -> RequestRecord:
    rec = RequestRecord()
    headers = auth_headers(spec)
    start = time.perf_counter()
    try:
        async with session.post(spec.url + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            if body["stream"]:
                reader = read_events if spec.api in ("messages", "responses") else read_stream
                await reader(resp, rec, start)
            else:
                usage = (await resp.json())["usage"]
                rec.output_tokens = usage.get("completion_tokens", usage.get("output_tokens"))
            rec.e2e_s = time.perf_counter() - start
            rec.ok = rec.error is None
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        rec.error = f"{type(e).__name__}: {e}"[:200]
    return rec


async def read_stream(resp: Any, rec: RequestRecord, start: float) -> None:
    last_t, tokens = start, 0
    async for line in resp.content:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        now, chunk = time.perf_counter(), json.loads(line[6:])
        if "error" in chunk:
            rec.error = f"stream error: {chunk['error'].get('message')}"[:200]
            return
        if not chunk_has_output(chunk):
            if chunk.get("usage") and not chunk.get("choices"):
                tokens = chunk["usage"]["completion_tokens"]  # the final usage chunk
                rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                rec.cached_tokens = (chunk["usage"].get("prompt_tokens_details")
                                     or {}).get("cached_tokens", 0)
            continue
        rec.text += "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                            for c in chunk["choices"])
        usage = chunk.get("usage")
        new = (usage["completion_tokens"] - tokens) if usage else 1
        tokens += new
        rec.num_chunks += 1
        if rec.ttft_s is None:
            rec.ttft_s = now - start
            new -= 1  # the first token has no gap before it
        if new > 0:
            rec.itl_s.extend([(now - last_t) / new] * new)
        last_t = now
    rec.output_tokens = tokens


def event_text(event: dict[str, Any]) -> str | None:
    """The output a Messages or Responses event carries (None: not an output event)."""
    kind = event.get("type", "")
    if kind == "content_block_delta":
        delta = event["delta"]
        return delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
    if kind in ("response.output_text.delta", "response.reasoning_text.delta"):
        return event["delta"]
    return None


def event_usage(event: dict[str, Any]) -> dict[str, Any] | None:
    """The final usage of a Messages (``message_delta``) or Responses stream (None: another event)."""
    if event.get("type") == "message_delta":
        return event["usage"]
    if event.get("type") in ("response.completed", "response.incomplete"):
        return event["response"]["usage"]
    return None


async def read_events(resp: Any, rec: RequestRecord, start: float) -> None:
    """A Messages or Responses stream: TTFT at the first output event, tokens from the usage."""
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue  # the "event:" line repeats the data's type
        now, event = time.perf_counter(), json.loads(line[6:])
        if event.get("type") == "error":
            error = event.get("error") or event  # Anthropic's nests it, OpenAI's does not
            rec.error = f"stream error: {error.get('message')}"[:200]
            return
        text = event_text(event)
        if text is not None:
            rec.text += text
            rec.num_chunks += 1
            rec.ttft_s = now - start if rec.ttft_s is None else rec.ttft_s
        elif (usage := event_usage(event)) is not None:
            rec.output_tokens = usage["output_tokens"]
            rec.prompt_tokens = usage.get("input_tokens", 0)
            rec.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)


async def read_model_card(session: Any, spec: LoadSpec) -> None:
    """The served model's name (unless given) and vocabulary (prompt ids are drawn below it)."""
    async with session.get(spec.url + "/v1/models", headers=auth_headers(spec)) as resp:
        card = (await resp.json())["data"][0]
    spec.model = spec.model or card["id"]
    spec.max_token_id = min(spec.max_token_id, card.get("vocab_size") or spec.max_token_id)


def start_app(app_args: dict[str, Any], port: int, name: str | None = None) -> str:
    """Start the nvray app on this machine's Ray cluster (at ``/name`` if named, else at
    ``/``); returns its base URL."""
    from ray import serve  # noqa: PLC0415

    from deployments import build_app  # noqa: PLC0415
    from nvray.runtime.cluster import ensure_ray  # noqa: PLC0415

    ensure_ray()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    prefix = f"/{name}" if name else "/"
    serve.run(build_app(app_args), name=name or "nvray-bench", route_prefix=prefix)
    url = f"http://127.0.0.1:{port}{prefix.rstrip('/')}"
    wait_healthy(url)
    return url


def wait_healthy(url: str, timeout_s: float = 900.0) -> None:
    """Until the app's ``/health`` answers 200: ``serve.run`` returns once its replicas run, and
    a replica's engine may still be starting (``deployments/ingress/server.py``), which a load's
    first requests would otherwise wait out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
                if response.status == 200:
                    return
        except OSError:  # a 503 while the engine starts (HTTPError), or a refused connection
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.2)

