"""Multi-LoRA on the in-process engine, against PEFT's own model as the oracle.

Adapters are written by PEFT (``tests/lora_adapters.py``): different ranks, target modules, an
rsLoRA one and one with a per-module alpha. A batch mixes them with the base model; each request
gets PEFT's greedy tokens for its adapter, and the adapters change the tokens (else the check
would be empty). Prefix caching never serves one adapter's KV to another; more adapters than
GPU slots take turns; preemption keeps the tokens; an adapter nvray cannot serve is refused when
named, with the reason, and the engine goes on.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from lora_adapters import ATTENTION, MLP, peft_greedy, peft_logits, write_adapter
from oracle import random_prompts
from tiny_engines import tiny_inprocess

from nvray import LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "all": write_adapter(tiny_path, str(root / "all"), 8, ATTENTION + MLP, seed=1),
        "qv-rs": write_adapter(tiny_path, str(root / "qv-rs"), 4, ["q_proj", "v_proj"], seed=2,
                               use_rslora=True, alpha=6),
        "mlp": write_adapter(tiny_path, str(root / "mlp"), 16, MLP, seed=3,
                             alpha_pattern={"down_proj": 3.0}),
        "ko": write_adapter(tiny_path, str(root / "ko"), 2, ["k_proj", "o_proj"], seed=4,
                            std=0.4),
    }


def _request(adapters: dict[str, str], name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, 1, adapters[name])


@pytest.fixture(scope="module")
def lora_llm():
    llm = tiny_inprocess(256, enable_lora=True, max_loras=2, max_num_batched_tokens=64)
    yield llm
    llm.shutdown()


def test_a_batch_mixing_adapters_and_the_base_gets_pefts_tokens(lora_llm, adapters, tiny_path):
    names = [None, "all", "qv-rs", "mlp", "ko", "all", None, "qv-rs"]
    prompts = random_prompts(len(names), 5, 40, seed=41)
    outs = lora_llm.generate(prompts, GREEDY, use_tqdm=False,
                             lora_request=[_request(adapters, n) for n in names])
    for name, prompt, out in zip(names, prompts, outs):
        path = adapters[name] if name else None
        assert list(out.token_ids) == peft_greedy(tiny_path, path, prompt, 8), name
    base = [peft_greedy(tiny_path, None, p, 8) for p in prompts]
    changed = [list(o.token_ids) != b for n, o, b in zip(names, outs, base) if n is not None]
    assert all(changed), "every adapter must change the tokens, or the test checks nothing"
    lora = lora_llm.stats()["lora"]
    assert lora["num_slots"] == 2 and lora["num_loads"] >= 4  # 4 adapters took turns in 2 slots


def test_log_probabilities_are_pefts_within_tolerance(lora_llm, adapters, tiny_path):
    prompt = random_prompts(1, 12, 12, seed=43)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    for name in ("all", "qv-rs"):
        out = lora_llm.generate([prompt], params, use_tqdm=False,
                                lora_request=_request(adapters, name))[0]
        logits = peft_logits(tiny_path, adapters[name], prompt + list(out.token_ids))
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            want = logits[len(prompt) - 1 + i].log_softmax(-1)[token].item()
            assert math.isclose(entry.logprob, want, abs_tol=1e-3), (name, i)


def test_the_prefix_cache_never_shares_kv_between_adapters(lora_llm, adapters, tiny_path):
    prompt = random_prompts(1, 40, 40, seed=45)[0]
    seen = []
    for name in ("all", "mlp", None, "all"):
        out = lora_llm.generate([prompt], GREEDY, use_tqdm=False,
                                lora_request=_request(adapters, name))[0]
        path = adapters[name] if name else None
        assert list(out.token_ids) == peft_greedy(tiny_path, path, prompt, 8), name
        seen.append(out.num_cached_tokens)
    assert seen[1] == 0 and seen[2] == 0, "another adapter's (or the base's) KV was served"
    assert seen[3] >= 32, "the same adapter's own prefix should be a cache hit"


def test_preempted_adapter_requests_keep_their_tokens(adapters, tiny_path):
    names = ["all", "ko", None, "qv-rs", "all", "mlp"]
    prompts = random_prompts(len(names), 20, 30, seed=47)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = tiny_inprocess(256, enable_lora=True, max_loras=3, num_kvcache_blocks=20,
                         max_num_batched_tokens=64)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False,
                            lora_request=[_request(adapters, n) for n in names])
        assert llm.stats()["num_preemptions"] > 0, "the workload must preempt"
    finally:
        llm.shutdown()
    for name, prompt, out in zip(names, prompts, outs):
        path = adapters[name] if name else None
        assert list(out.token_ids) == peft_greedy(tiny_path, path, prompt, 24), name


def _copy_with_config(src: str, dst: str, **changes: object) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_adapters_nvray_cannot_serve_are_refused_with_the_reason(lora_llm, adapters, tiny_path,
                                                                 tmp_path):
    wide = write_adapter(tiny_path, str(tmp_path / "wide"), 32, ["q_proj"], seed=5)
    head = write_adapter(tiny_path, str(tmp_path / "head"), 4, ["q_proj", "lm_head"], seed=6)
    dora = _copy_with_config(adapters["ko"], str(tmp_path / "dora"), use_dora=True)
    alpha = _copy_with_config(adapters["ko"], str(tmp_path / "alpha"), lora_alpha="sixteen")
    cut = _copy_with_config(adapters["ko"], str(tmp_path / "cut"))
    weights = os.path.join(cut, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    cases = {"wide": (wide, "above max_lora_rank=16"),
             "alpha": (alpha, "scaling .* cannot be computed"),
             "cut": (cut, "not a readable safetensors file"),
             "head": (head, "lm_head"),
             "dora": (dora, "DoRA"),
             "missing": (str(tmp_path / "nowhere"), "is not a directory")}
    for name, (path, reason) in cases.items():
        with pytest.raises(ValueError, match=reason) as err:
            lora_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False,
                              lora_request=LoRARequest(name, 1, path))
        assert repr(name) in str(err.value)
    out = lora_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False,
                            lora_request=_request(adapters, "ko"))[0]
    assert list(out.token_ids) == peft_greedy(tiny_path, adapters["ko"], [5, 6, 7], 8)


def test_an_engine_without_enable_lora_refuses_adapters(adapters):
    llm = tiny_inprocess(128)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False,
                         lora_request=_request(adapters, "ko"))
    finally:
        llm.shutdown()


def test_an_adapter_rewritten_on_disk_is_served_anew(lora_llm, tiny_path, tmp_path):
    """A retrained adapter written over the old one: its new weights, none of the old one's KV."""
    path = write_adapter(tiny_path, str(tmp_path / "re"), 8, ATTENTION, seed=21)
    prompt = random_prompts(1, 40, 40, seed=49)[0]
    old = peft_greedy(tiny_path, path, prompt, 8)
    first = lora_llm.generate([prompt], GREEDY, use_tqdm=False,
                              lora_request=LoRARequest("re", 1, path))[0]
    assert list(first.token_ids) == old
    write_adapter(tiny_path, path, 8, ATTENTION, seed=22)
    stat = os.stat(os.path.join(path, "adapter_model.safetensors"))
    os.utime(os.path.join(path, "adapter_model.safetensors"),
             ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse clock: still newer
    peft_new = peft_greedy(tiny_path + "/", path, prompt, 8)  # another cache key: a fresh PEFT load
    second = lora_llm.generate([prompt], GREEDY, use_tqdm=False,
                               lora_request=LoRARequest("re", 1, path))[0]
    assert peft_new != old and list(second.token_ids) == peft_new
    assert second.num_cached_tokens == 0, "the old adapter's KV was served"


@pytest.mark.parametrize("family,targets", [
    ("llama3", ATTENTION + MLP),  # GQA, llama3 rope scaling
    ("gemma3", ATTENTION + MLP),  # windowed layers, gelu MLP
    ("qwen3-moe-mixed", ATTENTION),  # attention only: experts are not adapted (see below)
])
def test_other_families_serve_pefts_adapters(family, targets, family_path, tmp_path):
    """PEFT's greedy tokens and log-probabilities (a random Gemma saturates on one token: its
    log-probabilities show the adapter)."""
    path = family_path(family)
    lora = write_adapter(path, str(tmp_path / "a"), 8, targets, seed=51, std=0.4)
    prompts = random_prompts(2, 10, 30, seed=53)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    llm = tiny_engine_of(path)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False,
                            lora_request=[LoRARequest("a", 1, lora), None])
    finally:
        llm.shutdown()
    for out, prompt, adapter in zip(outs, prompts, (lora, None)):
        assert list(out.token_ids) == peft_greedy(path, adapter, prompt, 6)
        logits = peft_logits(path, adapter, prompt + list(out.token_ids))
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            want = logits[len(prompt) - 1 + i].log_softmax(-1)[token].item()
            assert math.isclose(entry.logprob, want, abs_tol=1e-3), (adapter, i)
    base = peft_logits(path, None, prompts[0] + list(outs[0].token_ids))
    first = base[len(prompts[0]) - 1].log_softmax(-1)[outs[0].token_ids[0]].item()
    assert abs(outs[0].logprobs[0].logprob - first) > 1e-2, "the adapter changed nothing"


def test_an_adapter_of_moe_experts_is_refused_naming_them(family_path, tmp_path):
    path = family_path("qwen3-moe-mixed")
    lora = write_adapter(path, str(tmp_path / "e"), 4, MLP, seed=55)
    llm = tiny_engine_of(path)
    try:
        with pytest.raises(ValueError, match=r"mlp\.experts'.*no adaptable projection"):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("e", 1, lora))
    finally:
        llm.shutdown()


def tiny_engine_of(path: str):
    from nvray import LLM

    return LLM(path, runtime="inprocess", max_model_len=256, kvcache_block_size=8,
               enable_lora=True)


def test_an_adapter_changed_on_disk_while_its_request_waits_fails_that_request_only(
        lora_llm, tiny_path, tmp_path):
    """Checked when added, rewritten before it got a slot: the request ends with an error
    naming the adapter (no step loads files other than those checked), the base request beside
    it runs, and the next request for the adapter is checked afresh and served."""
    path = write_adapter(tiny_path, str(tmp_path / "moving"), 4, ATTENTION, seed=57)
    engine = lora_llm.engine
    prompt = random_prompts(1, 12, 12, seed=59)[0]
    engine.add_request("moving-1", prompt, GREEDY, lora_request=LoRARequest("moving", 1, path))
    engine.add_request("base-1", prompt, GREEDY)
    weights = os.path.join(path, "adapter_model.safetensors")
    stat = os.stat(weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten since
    finals = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["moving-1"].finish_reason == "error"
    assert "'moving'" in finals["moving-1"].error and "changed" in finals["moving-1"].error
    assert list(finals["base-1"].token_ids) == peft_greedy(tiny_path, None, prompt, 8)
    again = lora_llm.generate([prompt], GREEDY, use_tqdm=False,
                              lora_request=LoRARequest("moving", 1, path))[0]
    assert list(again.token_ids) == peft_greedy(tiny_path, path + "/", prompt, 8)


def test_the_mix_benchmarks_adapters_fit_the_engine_and_skew_as_asked(lora_llm, tiny_path,
                                                                       tmp_path):
    """``serve --workload lora-mix`` writes adapters from the checkpoint's config alone (the app
    runs elsewhere): their projections must be the engine's own, or every request is refused."""
    from nvray.bench.lora_mix import checkpoint_targets, pick_adapters, write_adapters

    assert checkpoint_targets(tiny_path) == lora_llm.engine.limits.lora_targets
    paths = write_adapters(tiny_path, str(tmp_path), 3, rank=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = lora_llm.generate(["mix"], params, use_tqdm=False,
                            lora_request=LoRARequest("mix-2", 1, paths["mix-2"]))[0]
    assert len(out.token_ids) == 4 and "mix-2" in lora_llm.stats()["lora"]["resident"]
    names = list(paths)
    skewed = pick_adapters("skewed", names, 2000, 0.5, seed=0)
    assert 0.45 < skewed.count("mix-0") / 2000 < 0.55 and set(skewed) == set(names)
    even = pick_adapters("even", names, 2000, 0.5, seed=0)
    assert all(0.28 < even.count(n) / 2000 < 0.39 for n in names)
