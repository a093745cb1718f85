"""``python -m nvray.bench``: benchmarks that print and save figures (tests never time things).

Each subcommand is a module of ``nvray/bench`` with ``add_arguments(parser)`` and
``run(args) -> figures``, named in ``SUBCOMMANDS`` with its line of help: a new benchmark is
its module and that line. Subcommands:
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
import importlib
import json
import sys
from typing import Any

from nvray.bench.cli_args import show_defaults

# subcommand: (its module in nvray/bench, which gives add_arguments(parser) and run(args), and
# its line in the help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "control-plane": ("control_plane", "scheduler + block manager time per step"),
    "ray-overhead": ("ray_overhead", "Ray rank actors vs in-process, per decode step"),
    "throughput": ("throughput",
                   "nano-vllm's bench workload: output tok/s, in-process and on Ray"),
    "embed": ("embed", "LLM.embed prompt tok/s and rows/s against the prefill floor"),
    "speculative": ("speculative",
                    "speculative decoding with a drafter of set acceptance, against none"),
    "step-gap": ("step_gap", "a drafting step's host pieces and device span, beside a plain "
                             "step's"),
    "allreduce": ("allreduce", "the TP all-reduce by message size: NCCL, P2P one-shot, "
                               "two-shot"),
    "gpu-busy": ("gpu_busy", "GPU busy share of decode steps (torch profiler), overlap on and "
                             "off"),
    "sampler": ("sampler", "the sampler's GPU and host time per step by filter mix"),
    "structured": ("structured", "structured outputs: tok/s under a schema, compile time, TTFT"),
    "idle": ("idle", "an idle engine's CPU use per process, and the first token that wakes it"),
    "serve": ("serve", "load generator for a running app (or one it starts): latency and tok/s"),
    "scaleup": ("scaleup",
                "a burst that makes Serve add an engine replica: time to its first answer"),
    "startup": ("startup", "seconds from a new process to a ready engine: LLM(), serve run"),
    "long-context": ("long_context", "decode tok/s at long context, hybrid against full "
                                     "attention"),
    "prefix-ttft": ("prefix_ttft", "TTFT of a long system prompt, prefix-cache miss against hit"),
    "soak": ("soak", "streaming load with random disconnects for minutes: errors, memory"),
}


def _module(cmd: str) -> Any:
    return importlib.import_module(f"nvray.bench.{SUBCOMMANDS[cmd][0]}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nvray.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", help="also write the figures to this JSON file")
    for cmd, (_, summary) in SUBCOMMANDS.items():
        parser = sub.add_parser(cmd, parents=[common], help=summary)
        _module(cmd).add_arguments(parser)
        show_defaults(parser)
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the subcommand ``args`` names (its module's ``run``)."""
    return _module(args.cmd).run(args)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.cmd == "serve" and "levels" in result:  # a sweep: a table for people, on stderr
        print(_module("serve").table(result), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
