"""Qwen3-MoE with FP8 experts: a Qwen-format block-scaled FP8 checkpoint (experts e4m3 in
128x128 blocks, ``weight_scale_inv``, the rest left in full precision as its
``modules_to_not_convert`` says) gives the logits HF transformers gives on the same weights
dequantized — the experts compute with exactly those weights (the kernel upcasts each tile), so
in fp32 the match is tight; ``quantization="fp8"`` on the full-precision checkpoint quantizes the
experts the same way as they load (equal logits to the FP8 checkpoint's); at TP=2 the experts'
blocks shard on block edges; and a width that does not split into blocks is refused by name."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp8_checkpoints import quantize_block
from hf_checkpoints import write_hf_checkpoint
from oracle import hf_greedy, hf_model, random_prompts
from nvray import LLM, EngineConfig
from nvray.step_protocol import SampleSpec, SeqStep, StepInput
from nvray.worker.model_runner import ModelRunner

SHAPE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
         "hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
         "max_position_embeddings": 512}
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def _fp8_and_dequantized(src: str, fp8_dst: str, deq_dst: str) -> None:
    """The FP8 checkpoint (experts quantized) and the same weights dequantized, in fp32."""
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fp8, deq = {}, {}
    for name, w in tensors.items():
        if _EXPERT.search(name):
            q, scale = quantize_block(w)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
            deq[name] = q.float() * full
        else:
            fp8[name] = deq[name] = w
    for dst, weights in ((fp8_dst, fp8), (deq_dst, deq)):
        shutil.copytree(src, dst, dirs_exist_ok=True)
        save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "re:.*self_attn.*", r"re:.*mlp\.gate$"]}
    with open(os.path.join(fp8_dst, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory, tiny_path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8-moe")
    src = write_hf_checkpoint(str(root / "src"), SHAPE, tiny_path, seed=11)
    paths = {"src": src, "fp8": str(root / "fp8"), "dequantized": str(root / "deq")}
    _fp8_and_dequantized(src, paths["fp8"], paths["dequantized"])
    return paths


def _logits(path: str, prompt: list[int], **options) -> torch.Tensor:
    runner = ModelRunner(EngineConfig(model=path, num_kvcache_blocks=16, **options), path)
    runner.allocate_kv_cache(16)
    spec = SampleSpec(0.0, 1.0, -1, 0.0, None, 0)
    return runner.forward(StepInput([SeqStep(0, prompt, 0, list(range(16)), spec)]))[0][0]


def test_an_fp8_checkpoint_computes_with_its_dequantized_experts(moe_paths):
    prompt = random_prompts(1, 40, 40, seed=2)[0]
    ours = _logits(moe_paths["fp8"], prompt)
    with torch.no_grad():
        ref = hf_model(moe_paths["dequantized"])(torch.tensor([prompt])).logits[0, -1]
        full = hf_model(moe_paths["src"])(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert (full - ref).abs().max() > 1e-3  # the experts really are FP8: not the source's


def _experts(path: str, **options) -> list:
    runner = ModelRunner(EngineConfig(model=path, num_kvcache_blocks=16, **options), path)
    return [layer.mlp.experts for layer in runner.model.model.layers]


def test_fp8_on_the_fly_quantizes_the_experts_as_the_checkpoint_did(moe_paths):
    on_the_fly = _experts(moe_paths["src"], quantization="fp8")
    stored = _experts(moe_paths["fp8"])
    for ours, theirs in zip(on_the_fly, stored):
        assert ours.w13_weight.dtype == torch.float8_e4m3fn
        for a, b in ((ours.w13_weight, theirs.w13_weight), (ours.w2_weight, theirs.w2_weight),
                     *zip(ours._scales(), theirs._scales())):
            assert torch.equal(a.float(), b.float())


def test_fp8_experts_greedy_at_tp2_equal_tp1(ray_cluster, moe_paths):
    prompts = random_prompts(2, 10, 40, seed=4)
    from nvray import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tp2 = LLM(moe_paths["fp8"], tensor_parallel_size=2, max_model_len=256)
    try:
        two = tp2.generate(prompts, greedy, use_tqdm=False)
    finally:
        tp2.shutdown()
    for prompt, out in zip(prompts, two):
        assert out.token_ids == hf_greedy(moe_paths["dequantized"], prompt, 8)


def test_an_expert_width_that_does_not_split_into_blocks_is_refused(tmp_path, moe_paths):
    path = str(tmp_path / "narrow")
    shutil.copytree(moe_paths["fp8"], path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["moe_intermediate_size"] = 192
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    from nvray.model_config import load_model_config
    from nvray.models import model_class_for
    from nvray.quantization import quant_config_for

    hf = load_model_config(path)
    with torch.device("meta"), pytest.raises(ValueError, match="moe_intermediate_size per rank of 192"):
        model_class_for(hf)(hf, quant_config_for(hf, None))
