"""Structured outputs on the GPU (Qwen3-0.6B shape, bf16, Qwen3's vocabulary of 151,936): rows
under a JSON schema, filled in xgrammar's batch matcher and masked by its Triton kernel, give
output that validates, with overlapped steps and without; the unconstrained rows of the same
batches stay oracle argmaxes (no mask leaks into them); no matcher outlives its request."""

from __future__ import annotations

import json
import re

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


WEATHER = {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
           "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_tool_calls_at_temperature_1_parse_as_calls_on_qwen3s_vocabulary(qwen3_06b_path, choice):
    """40 seeds at temperature 1 under the tool-call constraint (Qwen3's vocabulary, the GPU
    mask kernel): every complete call is a call whose arguments strict JSON readers accept."""
    from deployments.apis.tools import NamedToolChoice, Tool, parse_tool_calls, tool_constraint

    tools = [Tool.model_validate({"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER}})]
    tool_choice = (NamedToolChoice.model_validate({"type": "function", "function": {
        "name": "get_weather"}}) if choice == "named" else choice)
    constraint = tool_constraint(tools, tool_choice, parallel=True)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400,
                             structured_outputs=constraint) for i in range(40)]
    used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    llm = LLM(qwen3_06b_path, runtime="inprocess", max_model_len=2048, max_num_seqs=64,
              num_kvcache_blocks=4096)
    try:
        outs = llm.generate(random_prompts(40, 5, 100, seed=3, vocab=10000), params,
                            use_tqdm=False)
    finally:
        llm.shutdown()
        wait_gpu_memory_below(used + (256 << 20))
    for out in outs:
        content, calls = parse_tool_calls(out.text)
        assert not re.search(r"<tool_call>.*?</tool_call>", content or "", re.DOTALL), out.text
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
        if choice != "auto":
            assert calls or out.finish_reason == "length", out.text[-300:]
