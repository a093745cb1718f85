"""Multi-LoRA on the GPU: the Triton shrink/expand kernels inside CUDA graphs (decode,
verification and prefill graphs) and eager steps, the tiny model in float32.

The oracle is the adapter merged into the weights (``W + scaling * B @ A``, a checkpoint of
its own) served by the same engine without LoRA: a batch mixing three adapters (different
targets and ranks, two sharing the two slots in turns) and the base must give each request the
merged model's greedy tokens. With n-gram speculation on, the LoRA engine's tokens stay the same
and verification graphs replay with adapter tokens in them.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch

from nvray import LLM, LoRARequest, SamplingParams
from oracle import random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.xdist_group("lora")]  # its adapters, built once

# a few hundred KV blocks: sized from an H200's memory, the tiny model's cache is millions of
# blocks (20 s of the block manager's start-up)
OPTIONS = {"runtime": "inprocess", "dtype": "float32", "max_model_len": 256,
           "num_kvcache_blocks": 512, "max_num_seqs": 8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
KINDS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
         "attn": ["q_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}
RANKS = {"all": 8, "attn": 16, "mlp": 4}


def _merged(base: str, adapter: str, out: str) -> str:
    """The base checkpoint with the adapter folded into its weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        cfg = json.load(f)
    lora = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    weights_file = os.path.join(out, "model.safetensors")
    weights = load_file(weights_file)
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        scale = cfg["lora_alpha"] / a.shape[0]
        weights[name] = (weights[name].float() + scale * (b.float() @ a.float())).to(weights[name].dtype)
    save_file(weights, weights_file)
    return out


def _targets(path: str) -> dict[str, tuple[int, int]]:
    """The tiny Qwen3's projections, checkpoint module -> (in, out)."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    h, q, kv = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], \
        c["num_key_value_heads"] * c["head_dim"]
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv),
              "self_attn.v_proj": (h, kv), "self_attn.o_proj": (q, h),
              "mlp.gate_proj": (h, c["intermediate_size"]),
              "mlp.up_proj": (h, c["intermediate_size"]),
              "mlp.down_proj": (c["intermediate_size"], h)}
    return {f"model.layers.{i}.{m}": s for i in range(c["num_hidden_layers"])
            for m, s in shapes.items()}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from nvray.bench.lora_adapters import write_random_adapter
    from nvray.models.tiny import tiny_model_path

    base, root = tiny_model_path(), tmp_path_factory.mktemp("gpu-loras")
    targets = _targets(base)
    found = {}
    for seed, (name, kinds) in enumerate(KINDS.items()):
        chosen = {m: s for m, s in targets.items() if m.rsplit(".", 1)[-1] in kinds}
        path = write_random_adapter(str(root / name), chosen, RANKS[name], seed=seed + 1,
                                    std=0.15, dtype="float32")
        found[name] = (path, _merged(base, path, str(root / f"{name}-merged")))
    return found


@functools.lru_cache(maxsize=None)
def _merged_tokens(path: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """The plain engine's greedy tokens (eager: it starts faster) on a merged checkpoint."""
    llm = LLM(path, enforce_eager=True, **OPTIONS)
    try:
        return [list(o.token_ids) for o in llm.generate([list(p) for p in prompts], GREEDY,
                                                        use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("speculate", [False, True])
def test_adapters_in_cuda_graphs_give_the_merged_models_tokens(adapters, speculate):
    names = ["all", None, "attn", "mlp", "all", "attn"]
    prompts = random_prompts(len(names), 8, 40, seed=51)
    expected = {}
    for name in set(names):
        chosen = tuple(tuple(p) for n, p in zip(names, prompts) if n == name)
        path = adapters[name][1] if name else "tiny"
        expected[name] = iter(_merged_tokens(path, chosen))
    spec = ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_min": 1, "disable_by_batch_size": 8}}
            if speculate else {})
    llm = LLM("tiny", enable_lora=True, max_loras=2, **OPTIONS, **spec)
    try:
        requests = [LoRARequest(n, 1, adapters[n][0]) if n else None for n in names]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
        runner = llm.engine.executor.runner
        assert runner.num_graph_replays > 0, "no step replayed a CUDA graph"
        if speculate:
            assert runner.num_verify_replays > 0, "no verification graph replayed"
        assert llm.stats()["lora"]["num_loads"] >= 3
    finally:
        llm.shutdown()
    base = _merged_tokens("tiny", tuple(tuple(p) for p in prompts))
    for name, out, plain in zip(names, outs, base):
        assert list(out.token_ids) == next(expected[name]), name
        assert name is None or list(out.token_ids) != plain, f"{name} changed nothing"
