"""The model with its Triton kernels (fused q/k norms + rotary + KV-cache store, hidden-state
norms with the residual add, gated activation: as on the GPU) against HF.

The model runner turns the kernels on only on the GPU; here they are turned on by hand and run
under Triton's interpreter, so the CPU tier checks that the model wires them right (which
slices of the projection are q, k and v; norms present or not; which norm takes a residual) on
three checkpoints.
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

from oracle import hf_model, random_prompts  # noqa: E402
import kernels  # noqa: E402
from nvray import EngineConfig  # noqa: E402
from nvray.layers.activation import SiluAndMul  # noqa: E402
from nvray.layers.norm import RMSNorm  # noqa: E402
from nvray.step_protocol import SampleSpec, SeqStep, StepInput  # noqa: E402
from nvray.worker.model_runner import ModelRunner  # noqa: E402
from nvray.worker.setup import use_triton_kernels  # noqa: E402

if not importlib.import_module("kernels.qk_norm_rope")._INTERPRET:
    pytest.skip("runs the kernel on CPU tensors: needs TRITON_INTERPRET=1", allow_module_level=True)


def _step(tokens: list[int], start: int, table: list[int]) -> StepInput:
    return StepInput([SeqStep(0, tokens, start, table, SampleSpec(0.0, 1.0, -1, 0.0, None, 0))])


@pytest.mark.parametrize("model", ["tiny_path", "other_qwen3_path", "qwen2_path"])
def test_logits_with_the_triton_kernels_match_hf(model, request):
    path = request.getfixturevalue(model)
    runner = ModelRunner(EngineConfig(model=path, num_kvcache_blocks=8, kvcache_block_size=16), path)
    assert use_triton_kernels(runner.model)  # what the runner does on the GPU
    fused = [m for m in runner.model.modules() if getattr(m, "fused_prologue", None) is not None]
    assert fused, "the model's attention layers take the fused kernel"
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m._norm is kernels.rms_norm for m in norms)  # noqa: SLF001
    acts = [m for m in runner.model.modules() if isinstance(m, SiluAndMul)]
    assert acts and all(m._fn is kernels.silu_and_mul for m in acts)  # noqa: SLF001
    runner.allocate_kv_cache(8)
    prompt = random_prompts(1, 21, 21, seed=5)[0]
    table = [3, 7, 1, 0, 5, 2, 6, 4]
    tokens = list(prompt)
    ours = runner.forward(_step(prompt, 0, table))[0][0]
    for step in range(3):
        with torch.no_grad():
            ref = hf_model(path)(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4, msg=f"step {step}")
        tokens.append(int(ref.argmax()))
        ours = runner.forward(_step([tokens[-1]], len(tokens) - 1, table))[0][0]
