"""``python -m nvray.bench``: benchmarks that print and save figures (tests never time things).

Subcommands:
- ``control-plane``: scheduler + block manager time per step, and the whole control plane
  (schedule, step input, stop checks, detokenization) with 256 running sequences; the model is
  replaced by an executor that answers instantly, so only the control plane is timed
  (``nvray/bench/control_plane.py``).
- ``ray-overhead``: the same LLMEngine stepping the model in-process and through Ray rank
  actors (compiled graph, plain actor calls) at TP=1, interleaved in one run; per decode step
  (``nvray/bench/ray_overhead.py``).
- ``throughput``: nano-vllm's "bench" workload (256 sequences, seed 0, prompt ids uniform in
  [0, 10000), prompt length and max_tokens uniform in [100, 1024], ignore_eos, temperature 0.6)
  through ``LLM``, in-process and on Ray, CUDA graphs on and (``--eager``) off; output
  tokens per second, prefill included. Without ``--model`` it builds a Qwen3-0.6B-shaped
  (``--shape 8b``: Qwen3-8B-shaped) checkpoint with random bf16 weights (throughput does not
  depend on weight values here). ``--tensor-parallel-size 1,2`` runs Ray at each TP size
  (in-process at TP=1 only) and gives each TP>1 run its ``speedup_vs_tp1``. On a GPU whose
  bandwidth and matmul peak were measured (H100, H200), each run is also given as a share of
  the workload's bandwidth floor (design.md) and roofline floor (``nvray/bench/floor.py``).
  ``--overlap on,off`` runs each runtime with overlapped steps and without; ``--features
  plain,logprobs,penalties,filters,top_p`` adds top-5 log-probabilities, penalties, top-p 0.95
  with top-k 20 (Qwen3's recommended sampling) or top-p 0.95 alone to every request;
  ``--max-num-batched-tokens 8192,16384`` compares token budgets per step. Each run also gives
  its steps and their wall time by kind (``prefill_steps_s``: steps that launch prompt tokens;
  ``decode_steps_s``: the others), from the engine's stats (``nvray/bench/throughput.py``).
- ``embed``: ``LLM.embed`` over batches of random token-id prompts (by default 256 of 512
  tokens, the 0.6B shape: Qwen3-Embedding-0.6B's), fresh prompts each pass: prompt tok/s and
  rows/s (medians over ``--repeats``) as a share of the prefill floor, the forward pass's FLOPs
  without the LM head at the GPU's matmul peak (``nvray/bench/embed.py``);
  ``--max-num-batched-tokens 16384,32768`` compares prefill chunk budgets.
- ``speculative``: speculative decoding's machinery: output tok/s at each concurrency without
  speculation and with an oracle drafter of set mean acceptance length, one never right and
  the n-gram proposer, greedy; ``--draft-model 0.6b`` adds a draft model on the rank and
  ``--eagle3`` an EAGLE-3 head, ``--mtp`` the target's own MTP head (Qwen3.5);
  ``--tensor-parallel-size 2`` on two ranks; ``--shared-prefix 4096`` prompts that share a
  system prompt (``nvray/bench/speculative.py``).
- ``step-gap``: where a drafting step's time goes beside a plain step's: the host's pieces
  timed by wrapping them, each step's device span by CUDA events, in-process
  (``nvray/bench/step_gap.py``).
- ``allreduce``: the TP all-reduce by message size, NCCL against the P2P one-shot and two-shot
  over symmetric memory, CUDA-graph captured, one process per GPU (``nvray/bench/allreduce.py``);
  ``throughput --all-reduce auto,nccl`` compares them in the engine; ``throughput --profile DIR``
  writes each rank's kernel times over 20 decode steps (one configuration at a time);
  ``throughput --loras 8 --lora-rank 16`` runs each configuration again with multi-LoRA
  (``LoRAWorkload`` in ``nvray/bench/throughput.py``).
- ``sampler``: the sampler's GPU and host time per step for each filter mix, sorting the
  vocabulary and with the sort-free kernel (``nvray/bench/sampler.py``).
- ``gpu-busy``: GPU busy share of decode wall time (torch profiler), overlapped steps on and off
  (``nvray/bench/gpu_busy.py``).
- ``long-context``: decode at long context (by default 64 sequences of 32K tokens), Qwen3.5's
  hybrid against the Qwen3-8B shape: the KV blocks each holds, the sequences that fit, decode
  tok/s and their ratio (``nvray/bench/long_context.py``).
- ``prefix-ttft``: TTFT of a 4K-token system prompt + question, missing the prefix cache and
  hitting it (``nvray/bench/prefix_ttft.py``).
- ``soak``: minutes of streaming load with random disconnects against the app: unexpected
  errors, driver memory and KV usage over time (``nvray/bench/soak.py``).
- ``structured``: structured outputs: output tok/s with every request (and one in ten) under
  a JSON schema against the same tokens unconstrained, a 20-field schema's compile time cold
  and cached, TTFT with a cached schema (``nvray/bench/structured.py``).
- ``idle``: cores each driver and rank process of an idle engine on Ray uses, and the time to
  the first token of a request that wakes it against one right after another
  (``nvray/bench/idle.py``).
- ``scaleup``: a burst of streamed requests that makes Serve add a second engine replica: the time
  from the burst to the new replica running and to its first token, against its engine's own
  start-up, and the requests' latency before and after (``nvray/bench/scaleup.py``).
- ``serve``: a load generator for the HTTP app (``nvray/bench/serve.py``): concurrency sweep,
  streaming and not, TTFT / inter-token / end-to-end latency percentiles, output tok/s;
  ``--api chat,messages,responses`` runs chat completions, Anthropic's Messages and OpenAI's
  Responses side by side against one app, with each one's TTFT and tok/s as a ratio to chat's.
- ``startup``: seconds from a new process to a ready engine: ``LLM()`` in-process and on Ray
  with the engine's start-up phases, and ``serve run`` to ``/health`` 200 (``--serve``); on a
  cluster each run starts or joins as it would, or behind ``ray start --head``
  (``--cluster head``) (``nvray/bench/startup.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from nvray.bench import scaleup, serve, soak, startup
from nvray.bench.allreduce import ROWS as ALLREDUCE_ROWS
from nvray.bench.checkpoints import QWEN3_SHAPES, SHAPES
from nvray.bench.throughput import (FEATURES, LoRAWorkload, bench_throughput,
                                    resolve_placements)
from nvray.config import ALL_REDUCES, KV_CACHE_DTYPES


def _word_list(flag: str, text: str, values: dict[str, Any]) -> tuple[Any, ...]:
    """``--flag a,b``: the values of comma-separated words from ``values``; others refused."""
    words = text.split(",")
    if any(w not in values for w in words):
        raise SystemExit(f"{flag} {text!r}: give {', '.join(values)} or {','.join(values)}")
    return tuple(values[w] for w in words)


def _budgets(text: str | None) -> tuple[int | None, ...]:
    if text is None:
        return (None,)
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise SystemExit(f"--max-num-batched-tokens {text!r}: give token counts, e.g. 8192,16384") from None


def _sizes(text: str, flag: str = "--tensor-parallel-size") -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give sizes, e.g. 1,2") from None


def _names(flag: str, text: str, known: list[str]) -> tuple[str, ...]:
    """``--flag a,b``: the comma-separated names, each one of ``known``; others refused."""
    names = tuple(text.split(","))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; choose from {known}")
    return names


def _add_drafting_workload(parser: argparse.ArgumentParser, concurrency: str,
                           output_len: int) -> None:
    """The workload options of ``speculative`` and ``step-gap``."""
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or 'tiny' (default: a random checkpoint of "
                             "--shape)")
    parser.add_argument("--shape", default="0.6b", choices=SHAPES)
    parser.add_argument("--concurrency", default=concurrency, help="comma-separated")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k")
    parser.add_argument("--mean-acceptance-length", type=float, default=3.0,
                        help="the oracle drafter's accepted drafts + 1, on average")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=output_len)


class _DefaultsShown(argparse.HelpFormatter):
    """Each option's default after its help (options with no help text too), unless the help
    already says it or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not _has_default(action) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _has_default(action: argparse.Action) -> bool:
    return bool(action.option_strings) and not any(
        action.default is none for none in (None, argparse.SUPPRESS, False))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nvray.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", help="also write the figures to this JSON file")
    cp = sub.add_parser("control-plane", parents=[common], help="scheduler + block manager time per step")
    cp.add_argument("--num-seqs", type=int, default=256)
    cp.add_argument("--steps", type=int, default=200)
    cp.add_argument("--block-size", type=int, default=16)
    cp.add_argument("--stream", action="store_true",
                    help="every request streams (an output per step, detokenized as it goes)")
    ro = sub.add_parser("ray-overhead", parents=[common],
                        help="Ray rank actors vs in-process, per decode step")
    ro.add_argument("--model", default="tiny")
    ro.add_argument("--num-seqs", type=int, default=32)
    ro.add_argument("--rounds", type=int, default=3)
    tp = sub.add_parser("throughput", parents=[common],
                        help="nano-vllm's bench workload: output tok/s, in-process and on Ray")
    tp.add_argument("--model", default=None,
                    help="checkpoint directory (default: a random Qwen3-0.6B-shaped bf16 one)")
    tp.add_argument("--runtimes", default="inprocess,ray")
    tp.add_argument("--eager", action="store_true", help="also run with enforce_eager=True")
    tp.add_argument("--num-seqs", type=int, default=256)
    tp.add_argument("--max-model-len", type=int, default=4096)
    tp.add_argument("--shape", default="0.6b", choices=SHAPES,
                    help="shape of the random checkpoint built without --model: Qwen3 0.6b/8b, "
                         "or a family's (llama3-8b, qwen3-30b-a3b, gemma3-12b: config only, "
                         "random weights made on the GPU)")
    tp.add_argument("--tensor-parallel-size", default="1",
                    help="TP sizes to compare, comma-separated, e.g. 1,2 (above 1: Ray only)")
    tp.add_argument("--pipeline-parallel-size", default="1",
                    help="PP sizes to compare, comma-separated, e.g. 1,2 (above 1: Ray only; "
                         "each with every TP size)")
    tp.add_argument("--floor", type=float, default=None,
                    help="TP=1 physical floor in output tok/s for the %% column (default: from "
                         "the model's shape, the workload and the GPU's measured bandwidth, "
                         "nvray/bench/floor.py; TP=n: n times it)")
    tp.add_argument("--overlap", default="on", help="overlapped steps: on, off or on,off")
    tp.add_argument("--max-num-batched-tokens", default=None,
                    help="token budgets per step to compare, comma-separated (default: the engine's)")
    tp.add_argument("--quantization", default="none",
                    help="weights to compare, comma-separated: none (the checkpoint's), fp8 "
                         "(quantized at load)")
    tp.add_argument("--kv-cache-dtype", default="auto",
                    help="KV caches to compare, comma-separated: auto (the compute dtype), fp8")
    tp.add_argument("--features", default="plain",
                    help=f"per-request features to add, comma-separated: {', '.join(FEATURES)}")
    tp.add_argument("--all-reduce", default="auto",
                    help="TP all-reduces to compare, comma-separated: auto (P2P for decode "
                         "sizes on one host), nccl")
    tp.add_argument("--expert-parallel", default="off",
                    help="MoE experts at TP>1 to compare, comma-separated: off (each expert's "
                         "width split over the ranks), on (whole experts per rank)")
    tp.add_argument("--loras", type=int, default=0,
                    help="also run with this many random LoRA adapters (a tenth of the requests "
                         "on the base), in-process: lora_vs_base, swaps/s, first-use latency")
    tp.add_argument("--lora-rank", type=int, default=16)
    tp.add_argument("--max-loras", type=int, default=8, help="GPU adapter slots (--loras)")
    tp.add_argument("--profile", default=None, metavar="DIR",
                    help="write each rank's kernel times over 20 decode steps under DIR "
                         "(nvray/worker/step_profiler.py)")
    em = sub.add_parser("embed", parents=[common],
                        help="LLM.embed prompt tok/s and rows/s against the prefill floor")
    em.add_argument("--model", default=None,
                    help="checkpoint directory or 'tiny' (default: a random checkpoint of --shape)")
    em.add_argument("--shape", default="0.6b", choices=SHAPES)
    em.add_argument("--input-len", type=int, default=512, help="tokens per prompt")
    em.add_argument("--batch", type=int, default=256, help="prompts per llm.embed call")
    em.add_argument("--repeats", type=int, default=5, help="timed passes (after one warm-up)")
    em.add_argument("--runtimes", default="inprocess", help="inprocess, ray or inprocess,ray")
    em.add_argument("--max-num-batched-tokens", default=None,
                    help="token budgets per step to compare, comma-separated (default: the engine's)")
    sp = sub.add_parser("speculative", parents=[common],
                        help="speculative decoding with a drafter of set acceptance, against none")
    _add_drafting_workload(sp, concurrency="1,8,32,128", output_len=256)
    sp.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens every prompt starts with (a system prompt), before its own")
    sp.add_argument("--repeats", type=int, default=3, help="timed passes (after one warm-up)")
    sp.add_argument("--no-echo", dest="echo", action="store_false",
                    help="keep the loaded weights (default: turn them into a network that "
                         "repeats its last token, whose tokens do not depend on the batch shape)")
    sp.add_argument("--draft-model", default=None,
                    help="also a draft model on the target's rank: a checkpoint directory or a "
                         "Qwen3 shape (e.g. 0.6b), random, then echoed")
    sp.add_argument("--eagle3", action="store_true",
                    help="also an EAGLE-3 head of the target's shape on its rank (draft "
                         "vocabulary 32000), random, then echoed")
    sp.add_argument("--mtp", action="store_true",
                    help="add the target's own MTP head (Qwen3.5) drafting on its rank")
    sp.add_argument("--no-host-drafters", dest="host_drafters", action="store_false",
                    help="skip the oracle, never-right and n-gram runs")
    sp.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="the target's ranks (>1: rank actors on Ray, the engine in this process)")
    sg = sub.add_parser("step-gap", parents=[common],
                        help="a drafting step's host pieces and device span, beside a plain step's")
    _add_drafting_workload(sg, concurrency="1,32", output_len=128)
    ar = sub.add_parser("allreduce", parents=[common],
                        help="the TP all-reduce by message size: NCCL, P2P one-shot, two-shot")
    ar.add_argument("--world-size", type=int, default=None, help="GPUs (default: all)")
    ar.add_argument("--hidden", type=int, default=4096)
    ar.add_argument("--rows", default=",".join(map(str, ALLREDUCE_ROWS)))
    gb = sub.add_parser("gpu-busy", parents=[common],
                        help="GPU busy share of decode steps (torch profiler), overlap on and off")
    gb.add_argument("--model", default=None)
    gb.add_argument("--batch-sizes", default="256,32", help="running sequences, comma-separated")
    gb.add_argument("--prompt-len", type=int, default=256)
    gb.add_argument("--steps", type=int, default=30)
    gb.add_argument("--max-model-len", type=int, default=4096)
    sm = sub.add_parser("sampler", parents=[common],
                        help="the sampler's GPU and host time per step by filter mix")
    sm.add_argument("--rows", type=int, default=256)
    sm.add_argument("--iters", type=int, default=20)
    so = sub.add_parser("structured", parents=[common],
                        help="structured outputs: tok/s under a schema, compile time, TTFT")
    so.add_argument("--model", default=None)
    so.add_argument("--num-seqs", type=int, default=256)
    so.add_argument("--max-model-len", type=int, default=4096)
    il = sub.add_parser("idle", parents=[common],
                        help="an idle engine's CPU use per process, and the first token that wakes it")
    il.add_argument("--model", default=None)
    il.add_argument("--idle-s", type=float, default=5.0)
    il.add_argument("--window-s", type=float, default=3.0)
    il.add_argument("--runs", type=int, default=5)
    il.add_argument("--max-model-len", type=int, default=4096)
    sv = sub.add_parser("serve", parents=[common],
                        help="load generator for a running app (or one it starts): latency and tok/s")
    serve.add_arguments(sv)
    su = sub.add_parser("scaleup", parents=[common],
                        help="a burst that makes Serve add an engine replica: time to its first answer")
    scaleup.add_arguments(su)
    st = sub.add_parser("startup", parents=[common],
                        help="seconds from a new process to a ready engine: LLM(), serve run")
    st.add_argument("--model", default=None,
                    help="checkpoint path or 'tiny' (default: a random checkpoint of --shape, "
                         "built on first use: GPU-sized; give 'tiny' on a CPU)")
    st.add_argument("--shape", default="0.6b", choices=sorted(QWEN3_SHAPES))
    startup.add_arguments(st)
    lc = sub.add_parser("long-context", parents=[common],
                        help="decode tok/s at long context, hybrid against full attention")
    lc.add_argument("--shape", default="qwen3.5-9b,qwen3-8b", help="comma-separated shapes")
    lc.add_argument("--num-seqs", type=int, default=64)
    lc.add_argument("--context", type=int, default=32768, help="prompt tokens per sequence")
    lc.add_argument("--steps", type=int, default=30, help="decode steps timed")
    pt = sub.add_parser("prefix-ttft", parents=[common],
                        help="TTFT of a long system prompt, prefix-cache miss against hit")
    pt.add_argument("--shape", default="qwen3.5-9b", help="comma-separated shapes")
    pt.add_argument("--system-len", type=int, default=4096)
    pt.add_argument("--question-len", type=int, default=64)
    pt.add_argument("--requests", type=int, default=8, help="timed requests of each kind")
    sk = sub.add_parser("soak", parents=[common],
                        help="streaming load with random disconnects for minutes: errors, memory")
    soak.add_arguments(sk)
    for subcommand in sub.choices.values():
        subcommand.formatter_class = _DefaultsShown
        for action in subcommand._actions:  # argparse prints no help line without a help
            if action.help is None and _has_default(action):
                action.help = "(default: %(default)s)"
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the subcommand ``args`` names (each imports what it runs, when it runs)."""
    if args.cmd == "serve":
        return serve.run(args)
    if args.cmd == "soak":
        return soak.run(args)
    if args.cmd == "startup":
        return startup.run(args)
    if args.cmd == "scaleup":
        return scaleup.run(args, serve.parse_app_args(args.app_args or []))
    if args.cmd == "control-plane":
        from nvray.bench.control_plane import bench_control_plane  # noqa: PLC0415

        return bench_control_plane(args.num_seqs, args.steps, args.block_size, args.stream)
    if args.cmd == "throughput":
        runtimes, sizes = tuple(args.runtimes.split(",")), _sizes(args.tensor_parallel_size)
        stages = _sizes(args.pipeline_parallel_size, "--pipeline-parallel-size")
        try:
            resolve_placements(runtimes, sizes, stages)  # refused before a checkpoint is built
        except ValueError as e:
            raise SystemExit(f"throughput: {e}") from None
        overlaps = _word_list("--overlap", args.overlap, {"on": True, "off": False})
        quantizations = _word_list("--quantization", args.quantization, {"none": None, "fp8": "fp8"})
        kv_dtypes = _word_list("--kv-cache-dtype", args.kv_cache_dtype, {d: d for d in KV_CACHE_DTYPES})
        all_reduces = _word_list("--all-reduce", args.all_reduce, {a: a for a in ALL_REDUCES})
        expert_parallels = _word_list("--expert-parallel", args.expert_parallel,
                                      {"off": False, "on": True})
        if args.profile:  # read by the ranks (Ray's local workers inherit this environment)
            os.environ["NVRAY_PROFILE_DIR"] = args.profile
        if args.loras < 0 or args.lora_rank < 1 or args.max_loras < 1:
            raise SystemExit("throughput: --loras must be >= 0, --lora-rank and --max-loras >= 1")
        lora = (LoRAWorkload(args.loras, args.lora_rank, args.max_loras) if args.loras else None)
        return bench_throughput(args.model, runtimes, args.eager, args.num_seqs,
                                args.max_model_len, args.floor, overlaps,
                                _names("--features", args.features, list(FEATURES)),
                                _budgets(args.max_num_batched_tokens),
                                sizes, args.shape, quantizations, kv_dtypes, all_reduces,
                                expert_parallels, stages, lora)
    if args.cmd == "embed":
        from nvray.bench.embed import bench_embed  # noqa: PLC0415

        runtimes = _names("--runtimes", args.runtimes, ["inprocess", "ray"])
        if min(args.input_len, args.batch, args.repeats) < 1:
            raise SystemExit("embed: --input-len, --batch and --repeats must be >= 1")
        return bench_embed(args.model, args.shape, args.input_len, args.batch, args.repeats,
                           runtimes, _budgets(args.max_num_batched_tokens))
    if args.cmd == "speculative":
        from nvray.bench.speculative import bench_speculative  # noqa: PLC0415

        concurrencies = tuple(int(c) for c in args.concurrency.split(","))
        if min(*concurrencies, args.input_len, args.output_len, args.repeats,
               args.tensor_parallel_size, args.shared_prefix + 1) < 1:
            raise SystemExit("speculative: concurrencies, lengths, --repeats and "
                             "--tensor-parallel-size must be >= 1 (--shared-prefix >= 0)")
        return bench_speculative(args.model, args.shape, concurrencies,
                                 args.num_speculative_tokens, args.mean_acceptance_length,
                                 args.input_len, args.output_len, args.repeats, args.echo,
                                 args.draft_model, args.host_drafters, args.eagle3,
                                 args.mtp, args.tensor_parallel_size, args.shared_prefix)
    if args.cmd == "step-gap":
        from nvray.bench.step_gap import bench_step_gap  # noqa: PLC0415

        concurrencies = tuple(int(c) for c in args.concurrency.split(","))
        if min(*concurrencies, args.input_len, args.output_len) < 1:
            raise SystemExit("step-gap: concurrencies and lengths must be >= 1")
        return bench_step_gap(args.model, args.shape, concurrencies, args.num_speculative_tokens,
                              args.mean_acceptance_length, args.input_len, args.output_len)
    if args.cmd == "allreduce":
        from nvray.bench.allreduce import bench_allreduce  # noqa: PLC0415

        return bench_allreduce(args.world_size, args.hidden,
                               tuple(int(r) for r in args.rows.split(",")))
    if args.cmd == "sampler":
        from nvray.bench.sampler import bench_sampler  # noqa: PLC0415

        return bench_sampler(args.rows, iters=args.iters)
    if args.cmd == "structured":
        from nvray.bench.structured import bench_structured  # noqa: PLC0415

        return bench_structured(args.model, args.num_seqs, args.max_model_len)
    if args.cmd == "idle":
        from nvray.bench.idle import bench_idle  # noqa: PLC0415

        return bench_idle(args.model, args.idle_s, args.window_s, args.runs,
                          max_model_len=args.max_model_len)
    if args.cmd == "long-context":
        from nvray.bench.long_context import bench_long_context  # noqa: PLC0415

        return bench_long_context(_names("--shape", args.shape, SHAPES), args.num_seqs,
                                  args.context, args.steps)
    if args.cmd == "prefix-ttft":
        from nvray.bench.prefix_ttft import bench_prefix_ttft  # noqa: PLC0415

        return bench_prefix_ttft(_names("--shape", args.shape, SHAPES), args.system_len,
                                 args.question_len,
                                 args.requests)
    if args.cmd == "gpu-busy":
        from nvray.bench.gpu_busy import bench_gpu_busy  # noqa: PLC0415

        return bench_gpu_busy(args.model, tuple(int(b) for b in args.batch_sizes.split(",")),
                              args.prompt_len, args.steps, max_model_len=args.max_model_len)
    from nvray.bench.ray_overhead import bench_ray_overhead  # noqa: PLC0415

    return bench_ray_overhead(args.model, args.num_seqs, rounds=args.rounds)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.cmd == "serve" and "levels" in result:  # a sweep: a table for people, on stderr
        print(serve.table(result), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
