"""``python -m nvray.bench speculative``: the machinery of speculative decoding, measured with a
drafter whose acceptance is a parameter (random weights cannot show real acceptance).

Workload, per concurrency c: c prompts of ``input_len`` random token ids (after
``shared_prefix`` tokens they all share, as a system prompt: 0 by default), greedy,
``output_len`` tokens each, ``ignore_eos``, all submitted at once (``LLM.generate``). First the
plain engine (no speculation, overlapped steps: the engine's default) runs each concurrency
after a warm-up, and its outputs are recorded. Then one engine with ``speculative_config``
(k = ``num_speculative_tokens``) runs the same workloads with its proposer replaced by an
oracle: each sequence's recorded continuation, each draft position kept with probability r and
otherwise replaced by a wrong token (the run stops accepting there), r chosen so that the mean
acceptance length (accepted drafts + 1) is ``--mean-acceptance-length``; then with a drafter
that is never right (r = 0: the full cost of verifying k drafts for nothing) — these two with
``adaptive`` off (k drafts whatever they earn) — then the never-right drafter with ``adaptive``
on (the policy's saving), the same under the default ``disable_by_batch_size`` (``policy``: what
a user of the defaults gets from drafts that never hold), then the real n-gram proposer
(adaptive); ``disable_by_batch_size`` set to the largest concurrency but in ``policy``. Figures:
output tok/s (median of ``repeats`` passes), each as a ratio to
the plain engine's at that concurrency, the measured mean acceptance length, and the share of
sequences whose tokens equal the plain engine's (must be 1.0: else the oracle's drafts are wrong
from where they differ).

The echo checkpoint (default; ``echo=False``: the weights as loaded): a random deep network in
bf16 has near-ties everywhere, and a verification step's other batch shape moves one within a
few tokens, so a recorded continuation stops being the target's. ``echo_weights`` turns the
loaded weights, in place, into a network that repeats its last token with a wide margin
(attention's and the MLP's output projections zero, the LM head the embedding scaled, the final
norm's weight one): the same shapes, so the same bytes and FLOPs a step, and the same tokens
whatever the batch. The n-gram proposer is then always right after two generated tokens.

``--draft-model`` (a checkpoint or a Qwen3 shape, e.g. ``0.6b`` for the 8B target) adds a
draft model on the target's rank: with its random weights it is never right on the echo
target (k fixed, adaptive, the default policy), then echoed itself it is always right (k fixed:
the drafter's forwards at full acceptance); ``--eagle3`` does the same with an EAGLE-3 head
of the target's shape (``checkpoints.eagle3_checkpoint``: one layer, a draft vocabulary of
32000 ids, as the published heads of Llama 3.1 8B and Qwen3 8B), echoed by ``echo_eagle3``;
``--mtp`` the same with the target's own MTP head (Qwen3.5; echoed by ``echo_mtp``);
``--no-host-drafters`` skips the runs above.

``--tensor-parallel-size`` n > 1: every engine's target (and drafter) runs on n rank actors on
Ray, the engine itself in this process (``engine_here``), so the oracle is swapped in as at
TP=1 and the echo reaches every rank's shards (``on_ranks``).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any

from nvray.bench.checkpoints import default_checkpoint, eagle3_checkpoint, is_config_only
from nvray.bench.engine_here import engine_here, on_ranks
from nvray.speculative import SpeculativeConfig
from nvray.bench.cli_args import add_drafting_workload, sizes

_WARM_TOKENS = 16  # a warm-up's tokens a sequence


def keep_probability(mean_length: float, k: int) -> float:
    """r with 1 + r + r^2 + ... + r^k = ``mean_length`` (positions kept independently, the run
    ending at the first corrupted one)."""
    target = mean_length - 1
    if not 0 <= target <= k:
        raise ValueError(f"--mean-acceptance-length must be in [1, {k + 1}] for k={k}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, k + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class OracleProposer:
    """Drafts a recorded greedy continuation, each position kept with probability ``keep``."""

    def __init__(self, answers: list[list[int]], prompt_len: int, keep: float,
                 vocab_size: int, seed: int = 0) -> None:
        self.by_prompt = {tuple(a[:prompt_len]): a for a in answers}
        self.prompt_len, self.keep, self.vocab_size = prompt_len, keep, vocab_size
        self.rng = random.Random(seed)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        answer = self.by_prompt.get(tuple(token_ids[:self.prompt_len]))
        if answer is None:
            return []
        drafts = answer[len(token_ids):len(token_ids) + k]
        for i, token in enumerate(drafts):
            if self.rng.random() >= self.keep:
                drafts[i] = (token + 1) % self.vocab_size
                return drafts[:i + 1]  # what follows a wrong draft is never looked at
        return drafts


def random_prompts(c: int, input_len: int, vocab: int, shared: int = 0, ranks: int = 1
             ) -> list[list[int]]:
    """``c`` prompts of ``shared`` tokens they all start with, then ``input_len`` of their own;
    ids below 10000 / ``ranks`` (within rank 0's shard of an echoed EAGLE-3 head's vocabulary:
    ``echo_eagle3``)."""
    top = min(vocab, 10000 // ranks)
    shared_rng, rng = random.Random(-1), random.Random(c)
    prefix = [shared_rng.randrange(top) for _ in range(shared)]
    return [prefix + [rng.randrange(top) for _ in range(input_len)] for _ in range(c)]


def echo_weights(llm: Any, margin: float = 50.0) -> None:
    """Make the target's weights on every rank of ``llm`` (``engine_here``) repeat the last
    token (``echo_model``; each rank's shards: a vocabulary shard's scale from its own rows)."""
    on_ranks(llm, _echo_target, margin)


def _echo_target(runner: Any, margin: float) -> None:
    echo_model(runner.model, margin)


def _echo_drafter(runner: Any, method: str) -> None:
    """Make a rank's drafter always right on its echo target (``echo_eagle3``, ``echo_mtp``;
    a draft model: ``echo_model``)."""
    if method == "eagle3":
        echo_eagle3(runner.drafter.model, runner.model)
    elif method == "mtp":
        echo_mtp(runner.drafter.model)
    else:
        echo_model(runner.drafter.model)


def echo_model(model: Any, margin: float = 50.0) -> None:
    """Make ``model``'s weights (CUDA graphs read the same tensors) repeat the
    last token: the residual stream stays the token's embedding e (every ``o_proj``, linear
    attention's ``out_proj``, ``down_proj`` and MoE experts' ``w2`` zero; a shared expert's gate may be left, its
    ``down_proj`` is zero), the final norm's weight is one, and the LM head is the embedding
    scaled so that the token's own logit is ``margin`` (``hidden * alpha * rms(e) = margin``)
    while another's is about ``margin / sqrt(hidden)``."""
    import torch  # noqa: PLC0415

    params = dict(model.named_parameters())
    embed = params["model.embed_tokens.weight"]
    with torch.no_grad():
        for name, param in params.items():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight",
                              "w2_weight")):  # out_proj: linear attention's; w2: experts
                param.zero_()
        params["model.norm.weight"].fill_(1.0)
        rms = embed.float().pow(2).mean().sqrt()
        alpha = margin / (embed.shape[1] * rms)
        params.get("lm_head.weight", embed).copy_((embed.float() * alpha).to(embed.dtype))


def greedy_params(c: int, output_len: int) -> list[Any]:
    from nvray import SamplingParams  # noqa: PLC0415

    return [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            for _ in range(c)]


def _timed(llm: Any, prompts: list[list[int]], params: Any, repeats: int
           ) -> tuple[float, list[list[int]], dict[str, Any]]:
    """Median output tok/s over ``repeats`` passes, the outputs, speculation's counts over them.
    The warm-up runs the whole batch, a few tokens each: kernels that compile or autotune per
    shape (fla-core's chunked ones, at the batch's prefill length) do so outside the timing."""
    llm.generate(prompts, [dataclasses.replace(p, max_tokens=min(p.max_tokens, _WARM_TOKENS))
                           for p in params], use_tqdm=False)
    before = llm.stats().get("speculative", {})
    rates, outs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    after = llm.stats().get("speculative", {})
    counted = {key: after[key] - before.get(key, 0) for key in
               ("num_drafts", "num_draft_tokens", "num_accepted_tokens") if key in after}
    return statistics.median(rates), [list(o.token_ids) for o in outs], counted


def _run(llm: Any, c: int, name: str, prompts: list[list[int]], answers: list[list[int]],
         plain: float, output_len: int, repeats: int) -> dict[str, Any]:
    """One drafter at one concurrency: tok/s against plain decoding, acceptance, same tokens."""
    rate, outs, counted = _timed(llm, prompts, greedy_params(c, output_len), repeats)
    same = sum(a == b for a, b in zip(outs, answers)) / c
    drafts = counted.get("num_drafts", 0)
    run = {"concurrency": c, "drafter": name, "tok_per_s": round(rate, 1),
           "plain_tok_per_s": round(plain, 1), "ratio": round(rate / plain, 3),
           "mean_acceptance_length": round(1 + counted["num_accepted_tokens"] / drafts, 3)
           if drafts else None,
           "same_tokens_share": round(same, 3)}
    print(f"c={c} {name}: {rate:,.0f} tok/s = {run['ratio']}x plain, mean "
          f"acceptance length {run['mean_acceptance_length']}", flush=True)
    return run


def _configs(config: SpeculativeConfig) -> dict[str, SpeculativeConfig]:
    """k drafts whatever they earn; adaptive (the engine's); adaptive under the default
    ``disable_by_batch_size`` (the policy a user of the defaults gets)."""
    default_batch = SpeculativeConfig().disable_by_batch_size
    return {"fixed": dataclasses.replace(config, adaptive=False), "adaptive": config,
            "policy": dataclasses.replace(config, disable_by_batch_size=default_batch)}


def draft_model_runs(model: str, draft_model: str, options: dict[str, Any], k: int,
                     workloads: dict[int, list[list[int]]], answers: dict[int, list[list[int]]],
                     plain: dict[int, float], output_len: int, repeats: int,
                     echo: bool, method: str = "draft_model") -> list[dict[str, Any]]:
    """A drafter on the target's rank (``method`` ``draft_model``: ``draft_model`` is a
    checkpoint directory or a Qwen3 shape's name; ``eagle3``: ``draft_model`` is an EAGLE-3
    checkpoint): first with its random weights (on the echo checkpoint: never right) at k
    fixed, adaptive and under the default policy, then, with ``echo``, turned into an echo
    network too (always right: what the drafter's own forwards cost at full acceptance)."""
    import os  # noqa: PLC0415

    spec = {"method": method, "num_speculative_tokens": k, "disable_by_batch_size": max(workloads)}
    if method != "mtp":  # (an MTP head is the target checkpoint's own)
        spec["model"] = (draft_model if os.path.isdir(draft_model) or draft_model == "tiny"
                         else default_checkpoint(draft_model))
    llm = engine_here(model, speculative_config=spec, **options)
    runs = []
    try:
        if echo:
            echo_weights(llm)
        speculator = llm.engine.speculator
        configs = _configs(speculator.config)
        for c, prompts in workloads.items():
            for name in ("fixed", "adaptive", "policy"):
                speculator.config = configs[name]
                runs.append(_run(llm, c, f"{method}_random_{name}", prompts, answers[c],
                                 plain[c], output_len, repeats))
        if echo:
            on_ranks(llm, _echo_drafter, method)
            speculator.config = configs["fixed"]
            for c, prompts in workloads.items():
                runs.append(_run(llm, c, f"{method}_echo_fixed", prompts, answers[c],
                                 plain[c], output_len, repeats))
    finally:
        llm.shutdown()
    return runs


def _echo_head(head: Any, part: int = 0) -> dict[str, Any]:
    """A head's ``fc`` passing its input's ``part``-th H-wide part on, its layer adding
    nothing (output projections zero); its parameters by name."""
    import torch  # noqa: PLC0415

    params = dict(head.named_parameters())
    with torch.no_grad():
        fc = params["fc.weight"]
        fc.zero_()
        width = fc.shape[0]
        fc[:, part * width:(part + 1) * width].copy_(
            torch.eye(width, dtype=fc.dtype, device=fc.device))
        for name, param in params.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
    return params


def echo_mtp(head: Any) -> None:
    """Make Qwen3.5's MTP head of an echo target (``echo_model``) always right: ``fc`` passes
    the target's stored final state on (its token's normed embedding: right only where the
    stored states are), attention and MLP add nothing, its norms scale by one, so the target's
    LM head (its embeddings scaled) proposes that token."""
    import torch  # noqa: PLC0415

    params = _echo_head(head, part=1)
    with torch.no_grad():
        for name in ("pre_fc_norm_hidden.weight", "norm.weight"):
            params[name].fill_(1.0)  # (the loaded 1 + w)


def echo_eagle3(drafter: Any, target: Any) -> None:
    """Make an EAGLE-3 drafter of an echo target (``echo_model``) always right: ``fc`` passes
    the first feature on (the echo target's stream at a position is its token's embedding),
    attention and MLP add nothing, and the LM head is the target's over the draft vocabulary
    (its first ids: ``d2t`` zero). Both heads are split by vocabulary over the ranks, and each
    rank copies its target shard's first rows: right for the ids of rank 0's draft shard, where
    the prompts' ids are (below 10000 / ranks, ``random_prompts``)."""
    import torch  # noqa: PLC0415

    params = _echo_head(drafter)
    head = dict(target.named_parameters()).get("lm_head.weight",
                                               target.model.embed_tokens.weight)
    with torch.no_grad():
        params["norm.weight"].fill_(1.0)
        lm_head = params["lm_head.weight"]
        lm_head.copy_(head[:lm_head.shape[0]])
        if "d2t" in params:
            params["d2t"].zero_()


def bench_speculative(model: str | None = None, shape: str = "0.6b",
                      concurrencies: tuple[int, ...] = (1, 8, 32, 128), k: int = 4,
                      mean_length: float = 3.0, input_len: int = 256, output_len: int = 256,
                      repeats: int = 3, echo: bool = True, draft_model: str | None = None,
                      host_drafters: bool = True, eagle3: bool = False,
                      mtp: bool = False, tensor_parallel_size: int = 1,
                      shared_prefix: int = 0) -> dict[str, Any]:
    keep = keep_probability(mean_length, k)
    options: dict[str, Any] = {"tensor_parallel_size": tensor_parallel_size,
                               "max_model_len": shared_prefix + input_len + output_len + 8}
    if model is None and is_config_only(shape):
        options["load_format"] = "dummy"
    model = model or default_checkpoint(shape)
    plain_llm = engine_here(model, **options)
    if echo:
        echo_weights(plain_llm)
    vocab = plain_llm.engine.limits.vocab_size
    workloads = {c: random_prompts(c, input_len, vocab, shared_prefix, tensor_parallel_size)
                 for c in concurrencies}
    plain, answers = {}, {}
    try:
        for c, prompts in workloads.items():
            plain[c], answers[c], _ = _timed(plain_llm, prompts, greedy_params(c, output_len), repeats)
            print(f"c={c}: plain {plain[c]:,.0f} tok/s", flush=True)
    finally:
        plain_llm.shutdown()
    runs = [] if not draft_model else draft_model_runs(
        model, draft_model, options, k, workloads, answers, plain, output_len, repeats, echo)
    if eagle3:
        head = eagle3_checkpoint(model, with_weights=options.get("load_format") != "dummy")
        runs += draft_model_runs(model, head, options, k, workloads, answers, plain,
                                 output_len, repeats, echo, method="eagle3")
    if mtp:
        runs += draft_model_runs(model, "", options, k, workloads, answers, plain, output_len,
                                 repeats, echo, method="mtp")
    if host_drafters:
        runs += _host_drafter_runs(model, options, k, keep, workloads, answers, plain,
                                   output_len, repeats, echo)
    return {"model": model, "tensor_parallel_size": tensor_parallel_size,
            "draft_model": draft_model, "eagle3": eagle3, "mtp": mtp, "k": k,
            "target_mean_acceptance_length": mean_length,
            "keep_probability": round(keep, 4), "input_len": input_len,
            "shared_prefix": shared_prefix,
            "output_len": output_len, "repeats": repeats, "echo": echo, "runs": runs}


def _host_drafter_runs(model: str, options: dict[str, Any], k: int, keep: float,
                       workloads: dict[int, list[list[int]]], answers: dict[int, list[list[int]]],
                       plain: dict[int, float], output_len: int, repeats: int,
                       echo: bool) -> list[dict[str, Any]]:
    """The oracle, the never-right proposer (k fixed, adaptive, policy) and the n-gram
    proposer, drafting on the engine's host."""
    input_len = len(next(iter(workloads.values()))[0])
    spec_llm = engine_here(model, speculative_config={
        "method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": max(workloads)},
        **options)
    if echo:
        echo_weights(spec_llm)
    runs = []
    try:
        speculator = spec_llm.engine.speculator
        vocab = spec_llm.engine.limits.vocab_size
        ngram, configs = speculator.proposer, _configs(speculator.config)
        for c, prompts in workloads.items():
            recorded = [p + a for p, a in zip(prompts, answers[c])]
            never = OracleProposer(recorded, input_len, 0.0, vocab)
            for name, proposer, config in (
                    ("oracle", OracleProposer(recorded, input_len, keep, vocab), "fixed"),
                    ("never_right", never, "fixed"), ("never_right_adaptive", never, "adaptive"),
                    ("never_right_policy", never, "policy"), ("ngram", ngram, "adaptive")):
                speculator.proposer, speculator.config = proposer, configs[config]
                runs.append(_run(spec_llm, c, name, prompts, answers[c], plain[c], output_len,
                                 repeats))
    finally:
        spec_llm.shutdown()
    return runs


def add_arguments(p: Any) -> None:
    add_drafting_workload(p, concurrency="1,8,32,128", output_len=256)
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens every prompt starts with (a system prompt), before its own")
    p.add_argument("--repeats", type=int, default=3, help="timed passes (after one warm-up)")
    p.add_argument("--no-echo", dest="echo", action="store_false",
                   help="keep the loaded weights (default: turn them into a network that "
                        "repeats its last token, whose tokens do not depend on the batch shape)")
    p.add_argument("--draft-model", default=None,
                   help="also a draft model on the target's rank: a checkpoint directory or a "
                        "Qwen3 shape (e.g. 0.6b), random, then echoed")
    p.add_argument("--eagle3", action="store_true",
                   help="also an EAGLE-3 head of the target's shape on its rank (draft "
                        "vocabulary 32000), random, then echoed")
    p.add_argument("--mtp", action="store_true",
                   help="add the target's own MTP head (Qwen3.5) drafting on its rank")
    p.add_argument("--no-host-drafters", dest="host_drafters", action="store_false",
                   help="skip the oracle, never-right and n-gram runs")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="the target's ranks (>1: rank actors on Ray, the engine in this process)")


def run(args: Any) -> dict[str, Any]:
    concurrencies = sizes(args.concurrency, "--concurrency")
    if min(*concurrencies, args.input_len, args.output_len, args.repeats,
           args.tensor_parallel_size, args.shared_prefix + 1) < 1:
        raise SystemExit("speculative: concurrencies, lengths, --repeats and "
                         "--tensor-parallel-size must be >= 1 (--shared-prefix >= 0)")
    return bench_speculative(args.model, args.shape, concurrencies, args.num_speculative_tokens,
                             args.mean_acceptance_length, args.input_len, args.output_len,
                             args.repeats, args.echo, args.draft_model, args.host_drafters,
                             args.eagle3, args.mtp, args.tensor_parallel_size,
                             args.shared_prefix)
