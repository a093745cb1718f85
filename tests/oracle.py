"""Test helpers: the HF transformers oracle (greedy tokens, model, a reference beam search)
and random prompts."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: HF transformers' forward, argmax token by token (no EOS stop)."""
    return list(_hf_greedy_cached(path, tuple(prompt_ids), max_new_tokens))


@functools.lru_cache(maxsize=None)
def _hf_greedy_cached(path: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    import torch

    model = hf_model(path)
    ids = torch.tensor([list(prompt_ids)])
    out: list[int] = []
    with torch.no_grad():
        result = model(ids, use_cache=True)
        for _ in range(max_new_tokens):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), use_cache=True, **_kv_cache(result))
    return tuple(out)


def _kv_cache(result) -> dict:
    """The KV cache of a forward, as the next forward takes it: ``cache`` from transformers
    5.2x (which warns, deprecating ``past_key_values``), ``past_key_values`` before."""
    return {"cache": result["cache"]} if "cache" in result else {
        "past_key_values": result["past_key_values"]}


def random_prompts(n: int, min_len: int, max_len: int, seed: int, vocab: int = 500) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def greedy_step(tokens: list[int], start: int, table: list[int]):
    """A ``StepInput`` of one greedy sequence: ``tokens`` from position ``start``, over the
    physical blocks ``table``."""
    from nvray.step_protocol import SampleSpec, SeqStep, StepInput

    return StepInput([SeqStep(0, tokens, start, table, SampleSpec(0.0, 1.0, -1, 0.0, None, 0))])


def reference_beam_search(path: str, prompt: list[int], width: int, max_tokens: int,
                          eos: tuple[int, ...], length_penalty: float = 1.0):
    """A beam search over HF transformers' logits (each beam's whole sequence re-run):
    [(generated tokens, cumulative log-probability)], best first."""
    import torch

    def score(tokens, cum):
        ended = bool(tokens) and tokens[-1] in eos
        return cum / ((len(prompt) + len(tokens) - ended) ** length_penalty)

    beams, done = [([], 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = hf_model(path)(torch.tensor([prompt + tokens])).logits[0, -1]
            top = logits.float().log_softmax(-1).topk(2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t in eos else candidates).append((tokens + [t], cum + lp))
        beams = sorted(candidates, key=lambda c: score(*c), reverse=True)[:width]
    return sorted(done + beams, key=lambda c: score(*c), reverse=True)[:width]
