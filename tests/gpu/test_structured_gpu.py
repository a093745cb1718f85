"""Structured outputs on the GPU (Qwen3-0.6B shape, bf16, Qwen3's vocabulary of 151,936): rows
under a JSON schema, filled in xgrammar's batch matcher and masked by its Triton kernel, give
output that validates, with overlapped steps and without; the unconstrained rows of the same
batches stay oracle argmaxes (no mask leaks into them); no matcher outlives its request."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from gpu_oracle import check_greedy_near_argmax, wait_gpu_memory_below
from nvray import LLM, SamplingParams
from nvray.bench.structured import RECORDS_SCHEMA
from oracle import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_schema_rows_validate_and_free_rows_stay_argmaxes(qwen3_06b_path, overlap):
    # 40 constrained rows: more than the batch matcher's threshold (32) at first, fewer as
    # they finish; 24 greedy free rows beside them
    prompts = random_prompts(64, 5, 200, seed=8, vocab=10000)
    constrained = [SamplingParams(temperature=0.6, seed=i, max_tokens=1024,
                                  structured_outputs={"json": RECORDS_SCHEMA}) for i in range(40)]
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 24
    used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    llm = LLM(qwen3_06b_path, runtime="inprocess", max_model_len=2048, max_num_seqs=64,
              num_kvcache_blocks=4096, overlap_scheduling=overlap)
    try:
        outs = llm.generate(prompts, constrained + free, use_tqdm=False)
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)  # carries the release
        assert not llm.engine.executor.runner.grammar_masks.matchers
    finally:
        llm.shutdown()
        wait_gpu_memory_below(used + (256 << 20))
    for out in outs[:40]:
        assert out.finish_reason == "stop", out.text[-200:]
        jsonschema.validate(json.loads(out.text), RECORDS_SCHEMA)
    for prompt, out in list(zip(prompts, outs))[40:43]:
        check_greedy_near_argmax(qwen3_06b_path, prompt, out.token_ids)
