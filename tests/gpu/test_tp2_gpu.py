"""Tensor parallelism on two GPUs (P2P all-reduce, NCCL): a TP=2 engine on a Qwen3-0.6B-shaped bf16 checkpoint,
with overlapped steps (rank 0 broadcasts its sampled ids to rank 1 on the device) and CUDA
graphs, picks greedy tokens that are the oracle's argmaxes up to bf16 noise, through prefill
chunks, prefix hits and decode. Skips on a machine with fewer than two GPUs."""

from __future__ import annotations

import pytest
import torch

from gpu_oracle import check_greedy_near_argmax, wait_gpu_memory_below
from nvray import LLM, SamplingParams
from oracle import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    pytest.mark.gpu_alone,  # every GPU of the machine
]


def test_tp2_greedy_tokens_are_oracle_argmaxes_with_overlap(gpu_ray, qwen3_06b_path):
    prompts = random_prompts(12, 20, 700, seed=8, vocab=10000)
    prompts.append(prompts[2][:300] + [11, 12, 13])  # a cached prefix, once the first has run
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    llm = LLM(qwen3_06b_path, tensor_parallel_size=2, max_model_len=1024,
              max_num_batched_tokens=512, max_num_seqs=16, gpu_memory_utilization=0.5)
    try:
        first = llm.generate(prompts[:-1], params, use_tqdm=False)
        last = llm.generate(prompts[-1:], params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
        wait_gpu_memory_below(used + (256 << 20))
    assert last[0].num_cached_tokens >= 288 and stats["prefix_cache_hit_tokens"] >= 288
    assert stats["parallelism"]["all_reduce"].startswith("p2p"), stats["parallelism"]
    for prompt, out in zip(prompts, first + last):
        assert len(out.token_ids) == 24
        check_greedy_near_argmax(qwen3_06b_path, prompt, out.token_ids)


def test_a_tp2_serve_replica_answers_openai_requests(gpu_ray, qwen3_06b_path):
    """One Serve replica whose engine spans both GPUs (NCCL), through Serve's HTTP proxy on
    127.0.0.1: a completion, and a chat answer streamed (SSE) equal to the same request not
    streamed. (The GPU machine has no ``openai`` package: its HTTP API is spoken directly;
    the openai client itself is exercised by the CPU tier.)"""
    import json
    import socket

    import requests
    from ray import serve

    from deployments import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # no prefix cache: the streamed request recomputes the prompt exactly as the first did
    # (a cache hit changes the bf16 arithmetic, and a random model's near-ties with it)
    serve.run(build_app({"model": qwen3_06b_path, "tensor_parallel_size": 2,
                         "max_model_len": 1024, "gpu_memory_utilization": 0.5,
                         "enable_prefix_caching": False}),
              name="tp2", route_prefix="/")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        model = requests.get(f"{base}/models", timeout=60).json()["data"][0]["id"]
        done = requests.post(f"{base}/completions", timeout=120, json={
            "model": model, "prompt": "Hello, nvray", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}).json()
        assert done["usage"]["completion_tokens"] == 16
        assert done["choices"][0]["finish_reason"] == "length"
        chat = {"model": model, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me about tensor parallelism."}]}
        whole = requests.post(f"{base}/chat/completions", json=chat, timeout=120).json()
        assert whole["usage"]["completion_tokens"] == 24
        streamed = ""
        with requests.post(f"{base}/chat/completions", json={**chat, "stream": True},
                           stream=True, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        streamed += choice["delta"].get("content") or ""
        assert streamed == whole["choices"][0]["message"]["content"]
    finally:
        serve.delete("tp2")
        serve.shutdown()


def test_p2p_all_reduce_sums_equal_nccl_at_odd_and_decode_sizes():
    """The P2P one-shot and two-shot (staged through symmetric memory, a size that is no
    multiple of the ranks' alignment included, in CUDA graphs for the timing) sum what NCCL
    sums, on two GPUs; the all-reduce fused into the add + RMSNorm gives what NCCL's all-reduce
    then the norm give, bit for bit (two ranks: one rounding of the same sum), at an odd count
    of calls a graph too."""
    from nvray.bench.allreduce import bench_allreduce

    result = bench_allreduce(2, hidden=1000, rows=(1, 3, 37, 256), calls=5, replays=2)
    for row in result["rows"]:
        assert row["one_shot_max_abs_diff"] <= 0.0625, row  # bf16: the same sum, other order
        assert row["two_shot_max_abs_diff"] <= 0.0625, row
        assert row["fused_norm_max_abs_diff"] == 0, row


def test_expert_parallel_moe_with_graphs_gives_oracle_tokens_and_counts_real_tokens_only(
        gpu_ray, tmp_path):
    """Expert parallelism on two GPUs (each rank holds half the experts, fused MoE kernel, P2P
    all-reduce fused into the norms, CUDA graphs whose padded rows route too): greedy tokens
    are the fp32 oracle's argmaxes, and the expert load counts each computed token's pairs
    once (three sequences decode in a graph of four rows: padding counted would exceed it)."""
    from expert_load_check import check_expert_load
    from hf_checkpoints import SHAPES, write_hf_checkpoint
    from nvray.models.tiny import tiny_model_path

    path = write_hf_checkpoint(str(tmp_path), SHAPES["qwen3-moe-mixed"], tiny_model_path(),
                               seed=5)
    prompts = random_prompts(3, 10, 16, seed=23)
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, max_model_len=256,
              dtype="float32", num_kvcache_blocks=512, max_num_seqs=8)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40,
                                                    ignore_eos=True), use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert stats["parallelism"]["expert_parallel"]
    assert stats["parallelism"]["all_reduce"].startswith("p2p"), stats["parallelism"]
    for prompt, out in zip(prompts, outs):
        check_greedy_near_argmax(path, prompt, out.token_ids)
    check_expert_load(stats, path, num_requests=len(prompts))


@pytest.mark.parametrize("dispatch", ["compiled", "actor_calls"])
def test_pp2_greedy_tokens_are_oracle_argmaxes_with_graphs_and_preemption(
        gpu_ray, qwen3_06b_path, dispatch):
    """Two pipeline stages, one per GPU (activations over NCCL, each stage's decode steps in
    CUDA graphs that read the received activations): greedy tokens are the oracle's argmaxes
    through prefill chunks, prefix hits, decode and preemption (a cache too small for all)."""
    prompts = random_prompts(12, 20, 700, seed=9, vocab=10000)
    prompts.append(prompts[2][:300] + [11, 12, 13])  # a cached prefix, once the first has run
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    llm = LLM(qwen3_06b_path, pipeline_parallel_size=2, max_model_len=1024,
              max_num_batched_tokens=512, max_num_seqs=16, num_kvcache_blocks=200,
              ray_dispatch=dispatch)
    try:
        first = llm.generate(prompts[:-1], params, use_tqdm=False)
        last = llm.generate(prompts[-1:], params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
        wait_gpu_memory_below(used + (256 << 20))
    assert last[0].num_cached_tokens >= 288
    assert stats["num_preemptions"] > 0
    assert stats["parallelism"]["pipeline_parallel_size"] == 2
    for prompt, out in zip(prompts, first + last):
        assert len(out.token_ids) == 24
        check_greedy_near_argmax(qwen3_06b_path, prompt, out.token_ids)
