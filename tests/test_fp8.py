"""FP8 weights on the CPU path: Qwen's FP8 checkpoints, compressed-tensors FP8 (channel and
block scales) and on-the-fly FP8, against HF transformers' Qwen3 loaded from the same files by
transformers' own FP8 loaders, with the activation quantization reproduced (fp8_checkpoints.py).

The tolerance comes from the quantization noise itself: how far the FP8 oracle's logits lie from
the unquantized model's, prompt by prompt. nvray computes in fp32 like the oracle but not in the
same order, so now and then an activation lands on the other side of an FP8 rounding edge (one
step of the 3-bit mantissa): such a step may differ by a fraction of the noise, most steps do
not differ at all. Leaving out the activation quantization, a wrong scale or a misplaced shard
moves every step by most of the noise or more.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from fp8_checkpoints import (FORMATS, FP8_SHAPE, assert_near_argmax, hf_fp8_model,
                             write_fp8_checkpoint)
from oracle import hf_model, random_prompts
from nvray import LLM, EngineConfig, SamplingParams
from nvray.step_protocol import SampleSpec, SeqStep, StepInput
from nvray.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory) -> str:
    from nvray.models.tiny import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("fp8-src")), FP8_SHAPE, seed=5)


@pytest.fixture(scope="module")
def fp8_paths(tmp_path_factory, fp8_src) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8")
    return {fmt: write_fp8_checkpoint(fp8_src, str(root / fmt), fmt) for fmt in FORMATS}


def _runner(path: str, **options) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=path, num_kvcache_blocks=16, kvcache_block_size=16,
                                      **options), path)
    runner.allocate_kv_cache(16)
    return runner


def _error_ratios(runner: ModelRunner, oracle, full, prompts: list[list[int]], steps: int = 2
                  ) -> list[float]:
    """Per prompt and step: max |nvray - oracle| logit error over max |oracle - unquantized|."""
    spec = SampleSpec(0.0, 1.0, -1, 0.0, None, 0)
    table, ratios = list(range(15, -1, -1)), []
    for prompt in prompts:
        tokens = list(prompt)
        ours = runner.forward(StepInput([SeqStep(0, tokens, 0, table, spec)]))[0][0]
        for _ in range(steps):
            with torch.no_grad():
                ref = oracle(torch.tensor([tokens])).logits[0, -1]
                noise = float((ref - full(torch.tensor([tokens])).logits[0, -1]).abs().max())
            assert noise > 0.05, "the FP8 files must differ visibly from the unquantized model"
            ratios.append(float((ours - ref).abs().max()) / noise)
            tokens.append(int(ref.argmax()))
            ours = runner.forward(StepInput([SeqStep(0, [tokens[-1]], len(tokens) - 1, table,
                                                     spec)]))[0][0]
    return ratios


def assert_within_noise(ratios: list[float]) -> None:
    ordered = sorted(ratios)
    assert ordered[len(ordered) // 2] <= 0.01, f"most steps must match the oracle: {ordered}"
    assert ordered[-1] <= 0.35, f"no step may be off by a large part of the noise: {ordered}"


def _noise(oracle, full, prompt: list[int]) -> float:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        return float((oracle(ids).logits[0, -1] - full(ids).logits[0, -1]).abs().max())


PROMPTS = random_prompts(6, 10, 40, seed=7)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_logits_match_transformers(fmt, fp8_paths, fp8_src):
    path = fp8_paths[fmt]
    runner = _runner(path)
    assert runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert_within_noise(_error_ratios(runner, hf_fp8_model(path), hf_model(fp8_src), PROMPTS))


def test_fp8_on_the_fly_matches_a_compressed_tensors_checkpoint_of_the_same_weights(fp8_paths, fp8_src):
    """quantization='fp8' on the 32-bit checkpoint = FP8_DYNAMIC files made from it (per-channel
    weights, per-token activations), as transformers reads those files."""
    runner = _runner(fp8_src, quantization="fp8")
    assert runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert_within_noise(_error_ratios(runner, hf_fp8_model(fp8_paths["ct-channel"]),
                                      hf_model(fp8_src), PROMPTS))


@pytest.mark.parametrize("fmt", ["qwen-fp8", "ct-channel"])
def test_fp8_greedy_tokens_match_transformers(fmt, fp8_paths, fp8_src):
    path = fp8_paths[fmt]
    prompts = random_prompts(3, 5, 60, seed=9)
    oracle = hf_fp8_model(path)
    tol = _noise(oracle, hf_model(fp8_src), prompts[0]) * 0.35
    outs = LLM(path, runtime="inprocess").generate(prompts, GREEDY, use_tqdm=False)
    exact = [assert_near_argmax(oracle, prompt, out.token_ids, tol)
             for prompt, out in zip(prompts, outs)]
    assert sum(exact) / len(exact) >= 0.75, f"oracle argmax rate per prompt {exact}"


def test_stats_say_the_weights_are_fp8(fp8_paths, fp8_src):
    llm = LLM(fp8_paths["qwen-fp8"], runtime="inprocess")
    assert llm.stats()["dtypes"] == {
        "weights": "fp8 e4m3 (fp8, weight scales 128x128 blocks, dynamic activations)",
        "compute": "float32", "kv_cache": "float32"}
    on_the_fly = LLM(fp8_src, runtime="inprocess", quantization="fp8").stats()["dtypes"]
    assert on_the_fly["weights"].startswith("fp8 e4m3 (on-the-fly, weight scales per channel")
    assert LLM(fp8_src, runtime="inprocess").stats()["dtypes"]["weights"] == "float32"


def test_modules_left_unquantized_load_in_full_precision(tmp_path, fp8_src):
    kept = "model.layers.1.mlp.down_proj"
    path = write_fp8_checkpoint(fp8_src, str(tmp_path / "partial"), "qwen-fp8", ignore=(kept,))
    runner = _runner(path)
    layers = runner.model.model.layers
    assert layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert_within_noise(_error_ratios(runner, hf_fp8_model(path), hf_model(fp8_src), PROMPTS))


@pytest.fixture(scope="module")
def one_kv_head_fp8_path(tmp_path_factory) -> str:
    """One KV head (128 wide), so each of two ranks holds a replica of it and its scales."""
    from nvray.models.tiny import build_checkpoint

    root = tmp_path_factory.mktemp("fp8-one-kv-head")
    src = build_checkpoint(str(root / "src"), {**FP8_SHAPE, "num_attention_heads": 2,
                                               "num_key_value_heads": 1}, seed=13)
    return write_fp8_checkpoint(src, str(root / "fp8"), "qwen-fp8")


@pytest.mark.parametrize("model", ["two_kv_heads", "one_kv_head"])
def test_fp8_block_checkpoint_tp2_equals_tp1(ray_cluster, fp8_paths, one_kv_head_fp8_path, model):
    """Block scales split with the weights: at TP=2 every activation group and weight block
    is the same as at TP=1 (a replicated KV head's scales too), and each rank's FP8 KV cache
    holds its heads as one rank's does, so greedy tokens are too."""
    path = fp8_paths["qwen-fp8"] if model == "two_kv_heads" else one_kv_head_fp8_path
    prompts = random_prompts(3, 5, 60, seed=12)
    tp2 = LLM(path, tensor_parallel_size=2, kv_cache_dtype="fp8")
    try:
        outs2 = tp2.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        tp2.shutdown()
    outs1 = LLM(path, runtime="inprocess", kv_cache_dtype="fp8").generate(prompts, GREEDY,
                                                                          use_tqdm=False)
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs1]


def test_channel_scales_at_tp2_follow_transformers(ray_cluster, fp8_paths, fp8_src):
    """Per-channel scales: column-parallel layers split them, row-parallel ones keep them whole;
    the row-parallel layers quantize each rank's half of a token (per-token scales over the
    rank's columns), so TP=2 is held to an oracle that quantizes those inputs by halves too,
    not to TP=1's tokens."""
    path = fp8_paths["ct-channel"]
    oracle = hf_fp8_model(path, tp_ranks=2)
    prompts = random_prompts(3, 5, 60, seed=14)
    tol = 0.35 * _noise(oracle, hf_model(fp8_src), prompts[0])
    tp2 = LLM(path, tensor_parallel_size=2)
    try:
        outs = tp2.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        tp2.shutdown()
    exact = [assert_near_argmax(oracle, prompt, out.token_ids, tol)
             for prompt, out in zip(prompts, outs)]
    # an oracle that quantizes those inputs whole (TP=1's) makes 0.75-0.875 of these tokens
    # its exact argmax; this one, all of them
    assert sum(exact) / len(exact) >= 0.9, f"oracle argmax rate per prompt {exact}"


def _edit_quant_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    qc = cfg["quantization_config"]
    for key, value in changes.items():
        node = qc
        *parents, leaf = key.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("fmt,change,named", [
    ("qwen-fp8", {"quant_method": "awq"}, "quant_method='awq'"),
    ("qwen-fp8", {"fmt": "e5m2"}, "fmt='e5m2'"),
    ("qwen-fp8", {"activation_scheme": "static"}, "activation_scheme='static'"),
    ("qwen-fp8", {"weight_block_size": None}, "weight_block_size=None"),
    ("ct-channel", {"config_groups__group_0__input_activations__dynamic": False}, "input_activations"),
    ("ct-channel", {"config_groups__group_0__weights__num_bits": 4}, "weights"),
    ("ct-channel", {"format": "pack-quantized"}, "format='pack-quantized'"),
    ("ct-channel", {"ignore": []}, "lm_head"),
    ("qwen-fp8", {"weight_block_size": [128, 96]}, "weight_block_size=[128, 96]"),
    ("ct-channel", {"config_groups__group_0__output_activations": {"num_bits": 8}},
     "output_activations"),
    ("ct-channel", {"sparsity_config": {"format": "sparse-24"}}, "sparsity_config"),
])
def test_unsupported_quantization_is_refused_naming_it(tmp_path, fp8_paths, fmt, change, named):
    path = _edit_quant_config(fp8_paths[fmt], str(tmp_path / "edited"), **change)
    with pytest.raises(ValueError, match="not supported") as err:
        LLM(path, runtime="inprocess")
    assert named in str(err.value)


def test_an_fp8_tensor_for_a_module_the_config_leaves_unquantized_is_an_error(tmp_path, fp8_paths):
    path = _edit_quant_config(fp8_paths["qwen-fp8"], str(tmp_path / "mislabelled"),
                              modules_to_not_convert=["model.layers.0.mlp.down_proj"])
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj.weight'.*does not fit"):
        LLM(path, runtime="inprocess")


def test_a_full_precision_tensor_for_an_fp8_module_is_an_error(tmp_path, fp8_src):
    kept = "model.layers.1.mlp.down_proj"
    partial = write_fp8_checkpoint(fp8_src, str(tmp_path / "partial"), "qwen-fp8", ignore=(kept,))
    path = _edit_quant_config(partial, str(tmp_path / "unlisted"), modules_to_not_convert=None)
    with pytest.raises(ValueError, match=f"'{kept}.weight'.*does not fit"):
        LLM(path, runtime="inprocess")


def test_a_parent_module_left_unquantized_covers_its_layers(tmp_path, fp8_src):
    kept = ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
            "model.layers.1.mlp.down_proj")
    partial = write_fp8_checkpoint(fp8_src, str(tmp_path / "partial"), "qwen-fp8", ignore=kept)
    path = _edit_quant_config(partial, str(tmp_path / "parent"),
                              modules_to_not_convert=["model.layers.1.mlp"])
    mlp = _runner(path).model.model.layers[1].mlp
    assert mlp.gate_up_proj.weight.dtype == mlp.down_proj.weight.dtype == torch.float32


def test_a_shard_off_the_block_grid_is_an_error(ray_cluster, tmp_path, fp8_src):
    from nvray.models.tiny import build_checkpoint

    src = build_checkpoint(str(tmp_path / "src"), {**FP8_SHAPE, "intermediate_size": 384}, seed=6)
    path = write_fp8_checkpoint(src, str(tmp_path / "fp8"), "qwen-fp8")
    LLM(path, runtime="inprocess").shutdown()  # one rank: 384 columns are three whole blocks
    with pytest.raises(Exception, match="does not split into the checkpoint's 128x128"):
        LLM(path, tensor_parallel_size=2)


def test_unknown_quantization_option_is_refused():
    with pytest.raises(ValueError, match="quantization='int4'"):
        EngineConfig(quantization="int4")
