"""nvray on the GPU, Qwen3-0.6B shape, bf16, against HF transformers (fp32 and bf16 on the same
weights): logits of a prefill batch and of decode steps replayed from CUDA graphs, and greedy
continuations through ``LLM`` in-process and on Ray. Run with ``pytest -m gpu tests/gpu``."""

from __future__ import annotations

import pytest
import torch

from gpu_oracle import check_greedy_near_argmax, hf_logits, wait_gpu_memory_below
from nvray import LLM, EngineConfig, SamplingParams
from nvray.step_protocol import SampleSpec, SeqStep, StepInput
from oracle import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.xdist_group("model"),  # its module fixture, built once
]

GREEDY_SPEC = SampleSpec(0.0, 1.0, -1, 0.0, None, 0)
VOCAB = 10000  # prompt ids, as in the benchmark workload


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def runner(qwen3_06b_path):
    from nvray.worker.model_runner import ModelRunner
    from nvray.worker.startup import prepare_kv_cache

    config = EngineConfig(model=qwen3_06b_path, max_model_len=1024, max_num_seqs=16,
                          num_kvcache_blocks=160)
    r = ModelRunner(config, qwen3_06b_path)
    prepare_kv_cache(r, 160)
    assert r.graphs is not None and r.graph_sizes == [1, 2, 4, 8, 16]
    yield r
    r.close()


def test_prefill_and_graph_decode_logits_match_hf_within_bf16_noise(runner, qwen3_06b_path):
    lens = [5, 37, 130, 300]
    prompts = [random_prompts(1, n, n, seed=i, vocab=VOCAB)[0] for i, n in enumerate(lens)]
    tables = [list(range(20 * i + 19, 20 * i - 1, -1)) for i in range(4)]  # shuffled blocks
    step = StepInput([SeqStep(i, p, 0, tables[i], GREEDY_SPEC) for i, p in enumerate(prompts)])
    seqs = [list(p) for p in prompts]
    replays = runner.num_graph_replays
    for decode_step in range(4):  # the prefill, then 3 decode steps (graph of batch size 4)
        ours = runner.forward(step)[0]
        assert ours is not None and torch.isfinite(ours).all()
        assert runner.num_graph_replays - replays == decode_step  # decodes of 4 replay the graph of 4
        next_step = []
        for i, ids in enumerate(seqs):
            ref = hf_logits(qwen3_06b_path, ids, torch.float32)[-1]
            hf16 = hf_logits(qwen3_06b_path, ids, torch.bfloat16)[-1]
            err, hf_err = rel_err(ours[i], ref), rel_err(hf16, ref)
            assert err <= 2 * hf_err + 1e-3, (f"seq {i} step {decode_step}: nvray bf16 rel err "
                                              f"{err:.4f} vs HF bf16 {hf_err:.4f}")
            token = int(ref.argmax())
            next_step.append(SeqStep(i, [token], len(ids), tables[i], GREEDY_SPEC))
            ids.append(token)
        step = StepInput(next_step)


def test_decode_batch_padded_into_a_larger_graph_matches_eager(runner):
    """3 sequences replay the graph of 4 (one padding row); same logits as an eager forward."""
    prompts = [random_prompts(1, n, n, seed=40 + n, vocab=VOCAB)[0] for n in (17, 64, 200)]
    tables = [list(range(80 + 20 * i, 100 + 20 * i)) for i in range(3)]
    prefill = StepInput([SeqStep(10 + i, p, 0, tables[i], GREEDY_SPEC) for i, p in enumerate(prompts)])
    first = runner.forward(prefill)[0].argmax(-1).tolist()
    decode = StepInput([SeqStep(10 + i, [first[i]], len(p), tables[i], GREEDY_SPEC)
                        for i, p in enumerate(prompts)])
    graphed = runner.forward(decode)[0].clone()
    graphs, runner.graphs = runner.graphs, None  # the same step, eager
    try:
        eager = runner.forward(decode)[0]
    finally:
        runner.graphs = graphs
    assert torch.isfinite(graphed).all()
    for g, e in zip(graphed, eager):
        assert rel_err(g, e.float()) < 2e-2


@pytest.mark.parametrize("runtime", ["inprocess", pytest.param("ray", marks=pytest.mark.xdist_group("ray"))])
def test_greedy_batch_is_oracle_argmax_up_to_bf16_noise(qwen3_06b_path, runtime, request):
    if runtime == "ray":
        request.getfixturevalue("gpu_ray")
    used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    prompts = random_prompts(8, 3, 300, seed=1, vocab=VOCAB)
    llm = LLM(qwen3_06b_path, runtime=runtime, max_model_len=1024, max_num_seqs=32,
              num_kvcache_blocks=512)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
        wait_gpu_memory_below(used + (256 << 20))
    rates = [check_greedy_near_argmax(qwen3_06b_path, p, o.token_ids)["fp32_argmax_rate"]
             for p, o in zip(prompts, outs)]
    print(f"{runtime}: exact fp32-argmax rate per prompt {rates}")
    assert sum(rates) / len(rates) > 0.8
