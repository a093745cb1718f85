"""The model with its fused Triton prologue (q/k norms + rotary, as on the GPU) against HF.

The model runner turns the kernel on only on the GPU; here it is turned on by hand and runs
under Triton's interpreter, so the CPU tier checks that the model wires it right (which
slices of the projection are q, k and v; norms present or not) on three checkpoints.
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

from oracle import hf_model, random_prompts  # noqa: E402
from nvray import EngineConfig  # noqa: E402
from nvray.engine.step_input import SampleSpec, SeqStep, StepInput  # noqa: E402
from nvray.worker.model_runner import ModelRunner  # noqa: E402

if not importlib.import_module("kernels.qk_norm_rope")._INTERPRET:
    pytest.skip("runs the kernel on CPU tensors: needs TRITON_INTERPRET=1", allow_module_level=True)


def _step(tokens: list[int], start: int, table: list[int]) -> StepInput:
    return StepInput([SeqStep(0, tokens, start, table, SampleSpec(0.0, 1.0, -1, 0.0, None, 0))])


@pytest.mark.parametrize("model", ["tiny_path", "other_qwen3_path", "qwen2_path"])
def test_logits_with_the_fused_prologue_match_hf(model, request):
    path = request.getfixturevalue(model)
    runner = ModelRunner(EngineConfig(model=path, num_kvcache_blocks=8, kvcache_block_size=16), path)
    runner._use_triton_kernels()  # noqa: SLF001 - what the runner does on the GPU
    fused = [m for m in runner.model.modules() if getattr(m, "fused_prologue", None) is not None]
    assert fused, "the model's attention layers take the fused kernel"
    runner.allocate_kv_cache(8)
    prompt = random_prompts(1, 21, 21, seed=5)[0]
    table = [3, 7, 1, 0, 5, 2, 6, 4]
    tokens = list(prompt)
    ours = runner.forward_logits(_step(prompt, 0, table))[0]
    for step in range(3):
        with torch.no_grad():
            ref = hf_model(path)(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4, msg=f"step {step}")
        tokens.append(int(ref.argmax()))
        ours = runner.forward_logits(_step([tokens[-1]], len(tokens) - 1, table))[0]
