"""/metrics: engines' stats (and an ingress's routing decisions) in Prometheus text format
(version 0.0.4): nvray's own ``nvray_*`` families, and vLLM's ``vllm:*`` names, labels and
buckets for what both engines measure, so that dashboards built for vLLM read an nvray app
(docs/observability.md lists them; docs/grafana/nvray.json is such a dashboard)."""

from __future__ import annotations

from typing import Any

Engines = list[tuple[dict[str, str], dict[str, Any]]]  # (labels, stats) of each engine
NVRAY, VLLM = "nvray_", "vllm:"
_GAUGES = (
    ("num_requests_running", "num_running", "Requests running in the engine"),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled"),
    ("kv_cache_usage_ratio", "kv_cache_usage", "Fraction of KV cache blocks in use"),
    ("kv_cache_peak_usage_ratio", "kv_cache_peak_usage", "Largest fraction of KV cache blocks in use at once since start"),
    ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up"),
    ("step_time_ms_median", "step_time_ms_median", "Median duration of the engine's last 256 steps, in milliseconds"),
    ("driver_resident_memory_bytes", "driver_resident_memory_bytes", "Resident memory of the engine's driver process, in bytes"),
)
_OPTIONAL_GAUGES = (  # present in some engines' stats only (expert parallel)
    ("expert_load_imbalance", "expert_load_imbalance", "Expert parallel: the busiest rank's (token, expert) pairs over the ranks' mean"),
)
_COUNTERS = (
    ("prompt_tokens_total", "prompt_tokens", "Prompt tokens accepted"),
    ("generation_tokens_total", "generation_tokens", "Tokens generated"),
    ("num_preemptions_total", "num_preemptions", "Sequences preempted for lack of KV blocks"),
    ("prefix_cache_queries_total", "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits_total", "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    ("requests_accepted_total", "num_accepted", "Requests the engine accepted"),
)
_LABELLED_COUNTERS = (  # name, stats key (a dict: label value -> count), label, help
    ("requests_finished_total", "num_finished", "reason",
     "Requests finished, by reason (stop, length, abort, error)"),
    ("steps_total", "steps", "kind",
     "Engine steps, by what each launched: prefill (computes prompt tokens) or decode"),
    ("step_seconds_total", "step_seconds", "kind",
     "Wall time of the engine's steps, by what each launched: prefill or decode"),
    ("expert_pairs_total", "expert_pairs_by_rank", "rank",
     "Expert parallel: (token, expert) pairs the experts of each rank computed"),
)
_SPEC_COUNTERS = (  # from stats()["speculative"]: engines with speculative_config only
    ("spec_decode_num_drafts_total", "num_drafts", "Speculation: runs of drafts verified"),
    ("spec_decode_num_draft_tokens_total", "num_draft_tokens", "Speculation: draft tokens proposed"),
    ("spec_decode_num_accepted_tokens_total", "num_accepted_tokens",
     "Speculation: draft tokens accepted"),
)
_HISTOGRAMS = (
    ("time_to_first_token_seconds", "Time from arrival to first generated token"),
    ("inter_token_latency_seconds", "Time between consecutive generated tokens"),
)
# vLLM's families: (name, stats key, help); histograms are the engine's (nvray/engine/metrics.py)
_VLLM_GAUGES = (
    ("num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
)
_VLLM_COUNTERS = (
    ("prompt_tokens_total", "prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens_total", "generation_tokens", "Number of generation tokens processed."),
    ("num_preemptions_total", "num_preemptions", "Cumulative number of preemption from the engine."),
    ("prefix_cache_queries_total", "prefix_cache_queried_tokens",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits_total", "prefix_cache_hit_tokens",
     "Prefix cache hits, in terms of number of cached tokens."),
)
_VLLM_HISTOGRAMS = (  # (name, the engine's histogram, help)
    ("time_to_first_token_seconds", "time_to_first_token_seconds",
     "Histogram of time to first token in seconds."),
    ("inter_token_latency_seconds", "inter_token_latency_seconds",
     "Histogram of inter-token latency in seconds."),
    ("time_per_output_token_seconds", "inter_token_latency_seconds",
     "Histogram of time per output token in seconds (vLLM's older name for the inter-token latency)."),
    ("request_time_per_output_token_seconds", "request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request."),
    ("e2e_request_latency_seconds", "e2e_request_latency_seconds",
     "Histogram of e2e request latency in seconds."),
    ("request_queue_time_seconds", "request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request."),
    ("request_inference_time_seconds", "request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request."),
    ("request_prefill_time_seconds", "request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request."),
    ("request_decode_time_seconds", "request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request."),
    ("request_prompt_tokens", "request_prompt_tokens", "Number of prefill tokens processed."),
    ("request_generation_tokens", "request_generation_tokens",
     "Number of generation tokens processed."),
    ("request_params_max_tokens", "request_params_max_tokens",
     "Histogram of the max_tokens request parameter."),
    ("request_params_n", "request_params_n", "Histogram of the n request parameter."),
    ("iteration_tokens_total", "iteration_tokens_total",
     "Histogram of number of tokens per engine_step."),
)


def _escaped(value: object) -> str:
    """A label value as the text format writes it: backslash, quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt_labels(labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{_escaped(v)}"' for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


def _histogram(name: str, snap: dict[str, Any], labels: dict[str, str]) -> list[str]:
    lines = []
    bounds = [repr(float(b)) for b in snap["buckets"]] + ["+Inf"]  # le="1.0", as Prometheus
    for bound, count in zip(bounds, snap["cumulative_counts"]):
        lines.append(f"{name}_bucket{_fmt_labels({**labels, 'le': bound})} {count}")
    lines.append(f"{name}_sum{_fmt_labels(labels)} {snap['sum']}")
    lines.append(f"{name}_count{_fmt_labels(labels)} {snap['count']}")
    return lines


def _speculative_lines(prefix: str, healthy: Engines) -> list[str]:
    """vLLM's speculative-decoding counters, from the engines that speculate."""
    speculating = [(labels, stats["speculative"]) for labels, stats in healthy
                   if "speculative" in stats]
    lines = []
    for name, key, help_text in _SPEC_COUNTERS:
        full = f"{prefix}{name}"
        lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter"]
        lines += [f"{full}{_fmt_labels(labels)} {spec[key]}" for labels, spec in speculating]
    full = f"{prefix}spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f"# HELP {full} Speculation: how often the draft at each position was accepted",
              f"# TYPE {full} counter"]
    lines += [f"{full}{_fmt_labels({**labels, 'position': str(i)})} {count}"
              for labels, spec in speculating
              for i, count in enumerate(spec["accepted_per_position"])]
    return lines


def _lora_lines(prefix: str, healthy: Engines) -> list[str]:
    """Multi-LoRA engines: the adapters in their GPU slots and the loads into them."""
    serving = [(labels, stats["lora"]) for labels, stats in healthy if "lora" in stats]
    full = f"{prefix}lora_loads_total"
    lines = [f"# HELP {full} LoRA adapters loaded into a GPU slot (swaps)",
             f"# TYPE {full} counter"]
    lines += [f"{full}{_fmt_labels(labels)} {lora['num_loads']}" for labels, lora in serving]
    full = f"{prefix}lora_resident"
    lines += [f"# HELP {full} 1 for each LoRA adapter held in a GPU slot",
              f"# TYPE {full} gauge"]
    lines += [f"{full}{_fmt_labels({**labels, 'adapter': name})} 1"
              for labels, lora in serving for name in sorted(lora["resident"])]
    return lines


def _table_lines(prefix: str, kind: str, table: tuple, healthy: Engines) -> list[str]:
    """A family per (name, stats key, help) row of ``table``: one sample per engine."""
    lines = []
    for name, key, help_text in table:
        full = f"{prefix}{name}"
        lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
        lines += [f"{full}{_fmt_labels(labels)} {stats[key]}" for labels, stats in healthy
                  if key in stats]
    return lines


def _histogram_lines(prefix: str, table: tuple, healthy: Engines) -> list[str]:
    """A histogram family per (name, the engine's histogram, help) row of ``table``."""
    lines = []
    for name, key, help_text in table:
        full = f"{prefix}{name}"
        lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
        for labels, stats in healthy:
            lines += _histogram(full, stats[key], labels)
    return lines


def _startup_lines(healthy: Engines) -> list[str]:
    """The engines' start-up: in all, and by phase."""
    full = f"{NVRAY}startup_total_seconds"
    lines = [f"# HELP {full} The engine's whole start-up, seconds", f"# TYPE {full} gauge"]
    lines += [f"{full}{_fmt_labels(labels)} {stats['startup']['total_s']}"
              for labels, stats in healthy if stats.get("startup")]
    full = f"{NVRAY}startup_seconds"
    lines += [f"# HELP {full} The engine's start-up, seconds by phase (stats()['startup'])",
              f"# TYPE {full} gauge"]
    lines += [f"{full}{_fmt_labels({**labels, 'phase': phase})} {seconds}"
              for labels, stats in healthy
              for phase, seconds in stats.get("startup", {}).get("phases_s", {}).items()]
    return lines


def _nvray_lines(engines: Engines, healthy: Engines) -> list[str]:
    """nvray's own families (every engine's health; the rest from the healthy ones)."""
    full = f"{NVRAY}engine_healthy"
    lines = [f"# HELP {full} 1 if the engine is healthy", f"# TYPE {full} gauge"]
    lines += [f"{full}{_fmt_labels(labels)} {1 if stats.get('healthy') else 0}"
              for labels, stats in engines]
    lines += _table_lines(NVRAY, "gauge", _GAUGES, healthy)
    lines += _table_lines(NVRAY, "counter", _COUNTERS, healthy)
    for name, key, label, help_text in _LABELLED_COUNTERS:
        full = f"{NVRAY}{name}"
        lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter"]
        lines += [f"{full}{_fmt_labels({**labels, label: value})} {count}"
                  for labels, stats in healthy
                  for value, count in sorted(stats.get(key, {}).items())]
    lines += _table_lines(NVRAY, "gauge", _OPTIONAL_GAUGES, healthy)
    lines += _speculative_lines(NVRAY, healthy)
    lines += _lora_lines(NVRAY, healthy)
    lines += _startup_lines(healthy)
    return lines + _histogram_lines(NVRAY, tuple((name, f"nvray_{name}", help_text)
                                                 for name, help_text in _HISTOGRAMS), healthy)


def _vllm_lines(healthy: Engines) -> list[str]:
    """vLLM's families (vllm/v1/metrics names, labels and buckets) for what nvray measures."""
    lines = _table_lines(VLLM, "gauge", _VLLM_GAUGES, healthy)
    lines += _table_lines(VLLM, "counter", _VLLM_COUNTERS, healthy)
    full = f"{VLLM}request_success_total"
    lines += [f"# HELP {full} Count of successfully processed requests.",
              f"# TYPE {full} counter"]
    lines += [f"{full}{_fmt_labels({**labels, 'finished_reason': reason})} {count}"
              for labels, stats in healthy
              for reason, count in sorted(stats.get("num_finished", {}).items())]
    lines += _speculative_lines(VLLM, healthy)
    return lines + _histogram_lines(VLLM, _VLLM_HISTOGRAMS, healthy)


def render_metrics(stats_by_engine: dict[str | None, dict[str, Any]], model: str,
                   routing: dict[str, int] | None = None) -> str:
    """Each engine's stats (labelled ``engine="<id>"`` unless the key is None: the replica's
    own engine) and, for a prefix-routed ingress, its routing decisions."""
    engines = [({"model_name": model} if eid is None else {"model_name": model, "engine": eid},
                stats) for eid, stats in stats_by_engine.items()]
    healthy = [(labels, stats) for labels, stats in engines if stats.get("healthy")]
    lines = _nvray_lines(engines, healthy) + _vllm_lines(healthy)
    if routing is not None:
        full = f"{NVRAY}router_requests_total"
        lines += [f"# HELP {full} Requests this ingress routed to an engine replica by prefix "
                  "affinity or by load", f"# TYPE {full} counter"]
        lines += [f"{full}{_fmt_labels({'model_name': model, 'by': by})} {count}"
                  for by, count in sorted(routing.items())]
    return "\n".join(lines) + "\n"
