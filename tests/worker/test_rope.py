"""Rope as transformers computes it: the inverse frequencies and attention factor of every
supported type (default, linear, llama3, YaRN with its options, partial rotary) equal
transformers' own rope functions on the same config; a partial rotary turns the first part of
each head only; and YaRN end to end — a stock checkpoint with ``hf_overrides`` turning YaRN on
gives HF's logits at positions past the original length, a length refused without it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from nvray.layers.rotary import RotaryEmbedding, inv_freq_of, rope_spec_of

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
TYPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 8.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    "yarn": YARN,
    "yarn, mscale and mscale_all_dim": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn, attention_factor, betas, no truncation": {**YARN, "attention_factor": 1.3,
                                                     "beta_fast": 16, "beta_slow": 2,
                                                     "truncate": False},
    "default, partial rotary": {"rope_type": "default", "partial_rotary_factor": 0.5},
    "yarn, partial rotary": {**YARN, "partial_rotary_factor": 0.25},
}


def _hf_config(params: dict):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=2048,
                       rope_parameters={**params, "rope_theta": 10000.0})


def _hf_inv_freq(cfg) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.stablelm.modeling_stablelm import StableLmRotaryEmbedding

    kind = cfg.rope_parameters["rope_type"]
    if kind == "default":  # StableLM's: a default rope that reads partial_rotary_factor
        return StableLmRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[kind](cfg, None)


@pytest.mark.parametrize("name", TYPES)
def test_inverse_frequencies_and_attention_factor_match_transformers(name):
    cfg = _hf_config(dict(TYPES[name]))
    theirs, their_factor = _hf_inv_freq(cfg)
    ours, our_factor = inv_freq_of(rope_spec_of(cfg))
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(their_factor)


def test_a_partial_rotary_turns_the_first_dims_and_passes_the_rest():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = _hf_config(dict(TYPES["default, partial rotary"]))
    spec = rope_spec_of(cfg)
    rope = RotaryEmbedding(64, 300, spec)
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    positions = torch.tensor([0, 3, 17, 150, 299])
    ours_q, ours_k = rope(positions, q, k)
    inv_freq, _ = _hf_inv_freq(cfg)
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    rot = spec.rotary_dim
    hf_q, hf_k = apply_rotary_pos_emb(q[..., :rot].transpose(0, 1), k[..., :rot].transpose(0, 1),
                                      cos, sin, unsqueeze_dim=0)
    torch.testing.assert_close(ours_q, torch.cat([hf_q.transpose(0, 1), q[..., rot:]], -1))
    torch.testing.assert_close(ours_k, torch.cat([hf_k.transpose(0, 1), k[..., rot:]], -1))


# The tiny Qwen3, told its rope was trained to 64 positions and scaled 4x by YaRN
YARN_OVERRIDES = {"max_position_embeddings": 64,
                  "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 64}}


@pytest.fixture(scope="module")
def yarn_oracle_path(tmp_path_factory, tiny_path) -> str:
    """The tiny checkpoint with the overrides written into its config.json (HF's copy)."""
    path = str(tmp_path_factory.mktemp("tiny-yarn"))
    for name in os.listdir(tiny_path):
        shutil.copy(os.path.join(tiny_path, name), path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, **YARN_OVERRIDES}, f)
    return path


def test_yarn_through_hf_overrides_matches_hf_past_the_original_length(tiny_path, yarn_oracle_path):
    from oracle import hf_model, random_prompts
    from nvray import LLM, SamplingParams

    prompt = random_prompts(1, 150, 150, seed=4)[0]  # past the 64 "original" positions
    llm = LLM(tiny_path, runtime="inprocess", hf_overrides=YARN_OVERRIDES, max_model_len=256)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                    logprobs=5), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    hf, tokens = hf_model(yarn_oracle_path), list(prompt)
    for step, token in enumerate(out.token_ids):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1]
        ref = torch.log_softmax(logits, -1)
        assert token == int(ref.argmax()), f"step {step}"
        top = out.logprobs[step]
        for tok, lp in zip(top.top_ids, top.top_logprobs):
            assert lp == pytest.approx(float(ref[tok]), abs=2e-4)
        tokens.append(token)


def test_a_length_past_the_native_one_needs_rope_scaling(tiny_path):
    from nvray import EngineConfig
    from nvray.model_config import load_model_config
    from nvray.worker.setup import resolve_max_model_len

    plain = load_model_config(tiny_path, {"max_position_embeddings": 64})
    with pytest.raises(ValueError, match="max_model_len=256 exceeds .*needs rope scaling"):
        resolve_max_model_len(EngineConfig(max_model_len=256), plain)
    scaled = load_model_config(tiny_path, YARN_OVERRIDES)
    assert resolve_max_model_len(EngineConfig(max_model_len=256), scaled) == 256
    assert resolve_max_model_len(EngineConfig(), scaled) == 256  # the default: rope's reach
    with pytest.raises(ValueError, match="rope scaling's reach of 256"):
        resolve_max_model_len(EngineConfig(max_model_len=257), scaled)
