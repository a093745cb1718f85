"""The throughput workload's physical floors (nvray/bench/floor.py): design.md's bandwidth floor
against its figures (KV per token 112 KiB for Qwen3-0.6B and 144 KiB for 8B; the bench
workload's floor ≈ 26.6k output tok/s for the 0.6B shape on an H100 at 3.0 TB/s, and issue 10's
≈ 17.3k for the 8B shape on an H200 at 4.3 TB/s), and both floors on a workload small enough to
work out by hand."""

import pytest

from nvray.bench.checkpoints import QWEN3_SHAPES, QWEN3_VOCAB
from nvray.bench.floor import (floor_output_tok_per_s, kv_bytes_per_token, measured_bandwidth,
                               roofline_output_tok_per_s)
from nvray.bench.throughput import bench_workload
from nvray.models.tiny import TINY_CONFIG, _hf_config


def _config(shape: str) -> dict:
    cfg = _hf_config("Qwen3ForCausalLM", {**TINY_CONFIG, **QWEN3_SHAPES[shape]}, QWEN3_VOCAB, [0])
    return {**cfg, "dtype": "bfloat16"}


def _floor(shape: str, tb_per_s: float, tp: int = 1) -> float:
    prompts, params = bench_workload(256)
    return floor_output_tok_per_s(_config(shape), [len(p) for p in prompts],
                                  [p.max_tokens for p in params], tb_per_s, tp)


@pytest.mark.parametrize(("shape", "kib"), [("0.6b", 112), ("8b", 144)])
def test_kv_bytes_per_token(shape: str, kib: int) -> None:
    assert kv_bytes_per_token(_config(shape)) == kib * 1024


@pytest.mark.parametrize(("shape", "tb_per_s", "expected"), [("0.6b", 3.0, 26_600),
                                                             ("8b", 4.3, 17_300)])
def test_bench_workload_floor(shape: str, tb_per_s: float, expected: float) -> None:
    assert _floor(shape, tb_per_s) == pytest.approx(expected, rel=0.005)


def test_tensor_parallel_ranks_share_the_bytes() -> None:
    assert _floor("8b", 4.3, tp=2) == pytest.approx(2 * _floor("8b", 4.3))


def test_bandwidth_by_device_name() -> None:
    assert measured_bandwidth("NVIDIA H100 80GB HBM3") == 3.0
    assert measured_bandwidth("NVIDIA H200") == 4.3
    assert measured_bandwidth("cpu") is None


# one decoder layer: q/k/v/o 4*8 + 4*4, MLP 3*4*8 -> 144 linear parameters; LM head 10*4 = 40;
# bf16: 368 weight bytes per decode step; KV: 1 layer * 1 head * 2 dims * (k, v) * 2 B = 8 B/token
_HAND = {"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2, "vocab_size": 10,
         "dtype": "bfloat16"}


@pytest.mark.parametrize(("flop_per_s", "seconds"), [
    # compute-bound steps: prefill 2 * (144 * 10 + 40) / 0.5 = 5920 s; each step reads
    # 8 B per context token, then max(368 B / 1 B/s, 2 * 184 FLOP / 0.5 FLOP/s = 736 s)
    (0.5, 5920 + (88 + 736) + (96 + 736)),
    # bandwidth-bound steps: prefill 1480 s; max(368 s, 184 s)
    (2.0, 1480 + (88 + 368) + (96 + 368)),
])
def test_floors_worked_by_hand(flop_per_s: float, seconds: float) -> None:
    # one prompt of 10 tokens, 3 output tokens: decode steps read 11 and 12 context tokens.
    # At 1 byte/s, the bandwidth floor: 2 * 368 + (11 + 12) * 8 = 920 s.
    one_byte = 1e-12  # TB/s
    assert floor_output_tok_per_s(_HAND, [10], [3], one_byte) == pytest.approx(3 / 920)
    peak = flop_per_s * 1e-12  # TFLOP/s
    assert roofline_output_tok_per_s(_HAND, [10], [3], one_byte, peak) == pytest.approx(3 / seconds)
    assert roofline_output_tok_per_s(_HAND, [10], [3], one_byte, peak, 2) == pytest.approx(6 / seconds)


def _moe(**change) -> dict:
    from nvray.bench.checkpoints import FAMILY_SHAPES

    return {**FAMILY_SHAPES["qwen3-30b-a3b"], "dtype": "bfloat16", **change}


def test_an_moe_step_reads_the_experts_its_tokens_pick() -> None:
    from nvray.bench.floor import experts_touched, weight_bytes_per_step

    assert experts_touched(128, 8, 1) == pytest.approx(8)
    assert experts_touched(128, 8, 1024) == pytest.approx(128)
    # one token reads what a dense model with 8 experts' width of MLP (and the router) reads
    h, moe_inter = 2048, 768
    dense = _moe(num_experts=0, intermediate_size=8 * moe_inter)
    router = 48 * h * 128 * 2
    assert weight_bytes_per_step(_moe(), batch=1) == weight_bytes_per_step(dense) + router
    # a big batch reads every expert: more than one token, and no more than the checkpoint
    everything = weight_bytes_per_step(_moe())
    assert weight_bytes_per_step(_moe(), batch=1) < weight_bytes_per_step(_moe(), batch=256)
    assert weight_bytes_per_step(_moe(), batch=4096) == everything


def test_a_windowed_layer_reads_at_most_its_window() -> None:
    from nvray.bench.checkpoints import FAMILY_SHAPES

    gemma = {**FAMILY_SHAPES["gemma3-12b"], "dtype": "bfloat16"}
    full = {**gemma, "sliding_window": 10 ** 9}  # a window nothing reaches past
    short = [500] * 8, [20] * 8  # contexts within the 1,024-token window: the same floor
    assert floor_output_tok_per_s(gemma, *short, 3.0) == pytest.approx(
        floor_output_tok_per_s(full, *short, 3.0))
    long = [8000] * 8, [20] * 8  # five layers in six read 1,024 of 8,000 tokens: faster
    assert floor_output_tok_per_s(gemma, *long, 3.0) > 1.5 * floor_output_tok_per_s(full, *long, 3.0)


# a hybrid of one linear-attention and one gated full-attention layer (Qwen3.5's layout):
# attention 4*(4 + 4 gate + 2*2) + 4*4 = 64; linear attention 4*(2*2 + 4) + 4*4 (z) + 2*4*2
# (a, b) + 4*4 (out) = 80; MLPs 2 * 96: 336 linear parameters, LM head 40: 752 B a step in bf16;
# KV 8 B per context token (the attention layer only); state per sequence: S 2*2*2 float32 =
# 32 B and the conv's last 2 inputs of 8 channels in bf16 = 32 B, read and written: 128 B a step
_HYBRID = {**_HAND, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
           "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 2,
           "linear_value_head_dim": 2, "linear_conv_kernel_dim": 3}


def test_a_hybrid_step_reads_the_attention_layers_kv_and_every_sequences_state() -> None:
    # one prompt of 10 tokens, 3 output tokens: 2 * 752 + (11 + 12) * 8 + 2 * 128 = 1944 B
    assert floor_output_tok_per_s(_HYBRID, [10], [3], 1e-12) == pytest.approx(3 / 1944)
    assert kv_bytes_per_token(_HYBRID) == 8
