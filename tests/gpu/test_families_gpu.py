"""The model families on the GPU with the Triton kernels (the fused MoE, windowed attention,
Qwen3.5's linear-attention decode and, where fla-core is installed, its chunked prefill)
and CUDA graphs, against HF transformers on the same random weights: in float32, logits of a
prefill batch and of graph-replayed decode steps equal HF's (relative error 2e-3: the kernels
compute what the reference does; in bf16 these 64-wide models' rounding noise differs from HF's
by up to 2.5x, so bf16 is judged by tokens); in bf16, greedy continuations through ``LLM`` that
are fp32 argmaxes up to bf16 noise (Gemma 3's prompts run far past its window). Run with
``pytest -m gpu tests/gpu``."""

from __future__ import annotations

import pytest
import torch

from gpu_oracle import check_greedy_near_argmax, hf_logits
from hf_checkpoints import HYBRID_SHAPES, SHAPES, write_hf_checkpoint
from nvray import LLM, EngineConfig, SamplingParams
from nvray.step_protocol import SampleSpec, SeqStep, StepInput
from oracle import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY_SPEC = SampleSpec(0.0, 1.0, -1, 0.0, None, 0)


GPU_SHAPES = {**SHAPES, **{k: v for k, v in HYBRID_SHAPES.items() if "text_config" not in v}}


@pytest.fixture(scope="module", params=list(GPU_SHAPES))
def family_path(request, tmp_path_factory):
    from nvray.models.tiny import tiny_model_path

    target = str(tmp_path_factory.mktemp(request.param))
    return write_hf_checkpoint(target, GPU_SHAPES[request.param], tiny_model_path(), seed=5)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def test_prefill_and_graph_decode_logits_match_hf_in_float32(family_path):
    from nvray.worker.model_runner import ModelRunner
    from nvray.worker.startup import num_kvcache_blocks, prepare_kv_cache

    # no prefill graphs: this test's prefill is a batch (the hybrids' test below replays them)
    config = EngineConfig(model=family_path, max_model_len=512, max_num_seqs=4,
                          num_kvcache_blocks=128, dtype="float32", max_prefill_graph_tokens=0)
    runner = ModelRunner(config, family_path)
    try:
        # as an engine starts: the kernels compiled ahead, side by side, then the cache
        prepare_kv_cache(runner, num_kvcache_blocks(runner))
        assert runner.graphs is not None
        prompts = [random_prompts(1, n, n, seed=i)[0] for i, n in enumerate([5, 37, 130, 200])]
        # 32 shuffled blocks each: a block-table entry per group for each logical block (Gemma's
        # global and local layers are two groups, kv_layout.py)
        tables = [list(range(32 * i + 31, 32 * i - 1, -1)) for i in range(4)]
        # each sequence its own state slot (Qwen3.5's linear attention; ignored elsewhere)
        step = StepInput([SeqStep(i, p, 0, tables[i], GREEDY_SPEC, state_slot=i)
                          for i, p in enumerate(prompts)])
        seqs = [list(p) for p in prompts]
        for decode_step in range(4):
            ours = runner.forward(step)[0]
            assert ours is not None and torch.isfinite(ours).all()
            next_step = []
            for i, ids in enumerate(seqs):
                ref = hf_logits(family_path, ids, torch.float32)[-1]
                err = rel_err(ours[i], ref)
                assert err <= 2e-3, f"seq {i} step {decode_step}: rel err {err:.5f}"
                ids.append(int(ref.argmax()))
                next_step.append(SeqStep(i, [ids[-1]], len(ids) - 1, tables[i], GREEDY_SPEC,
                                         state_slot=i))
            step = StepInput(next_step)
        assert runner.num_graph_replays >= 3
    finally:
        runner.close()


def test_greedy_continuations_are_fp32_argmaxes_up_to_bf16_noise(family_path):
    prompts = random_prompts(8, 10, 300, seed=21)
    # An MoE router's near-ties pick other experts under other bf16 rounding (HF's and ours
    # differ in order): a token then differs by far more than the noise at its position, though
    # each computes its experts right. MoE families run in fp32 here (the fp32 oracle exactly).
    moe = "moe" in family_path
    llm = LLM(family_path, runtime="inprocess", max_model_len=512, max_num_seqs=8,
              num_kvcache_blocks=512, dtype="float32" if moe else "bfloat16")
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        check_greedy_near_argmax(family_path, prompt, out.token_ids)


def test_a_hybrids_one_sequence_chunks_replay_prefill_graphs_and_match_hf(family_path):
    """Qwen3.5's one-sequence prefill chunks (40 tokens, then 60 resuming from the state the
    first left) replay prefill CUDA graphs padded to 64 rows; the logits of each chunk's last
    token and of a decode step equal HF's in float32."""
    if "qwen3_5" not in family_path:
        pytest.skip("the hybrids' padded prefill graphs")
    from nvray.worker.model_runner import ModelRunner
    from nvray.worker.startup import num_kvcache_blocks, prepare_kv_cache

    config = EngineConfig(model=family_path, max_model_len=512, max_num_seqs=4,
                          num_kvcache_blocks=64, dtype="float32", max_prefill_graph_tokens=64)
    runner = ModelRunner(config, family_path)
    try:
        prepare_kv_cache(runner, num_kvcache_blocks(runner))
        prompt = random_prompts(1, 100, 100, seed=8)[0]
        table = list(range(31, -1, -1))
        ids, replays = list(prompt), runner.num_graph_replays
        for start, end in ((0, 40), (40, 100), (100, 101)):
            if end == 101:
                ids.append(int(hf_logits(family_path, ids, torch.float32)[-1].argmax()))
            step = StepInput([SeqStep(0, ids[start:end], start, table, GREEDY_SPEC,
                                      state_slot=2)])
            ours = runner.forward(step)[0]
            ref = hf_logits(family_path, ids[:end], torch.float32)[-1]
            err = rel_err(ours[0], ref)
            assert err <= 2e-3, f"tokens {start}..{end}: rel err {err:.5f}"
        assert runner.num_graph_replays - replays == 3, "two prefill graphs and a decode graph"
    finally:
        runner.close()
