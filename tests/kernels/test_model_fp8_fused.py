"""An FP8 model with its Triton kernels: the norms and the gated activation quantize their
outputs for the FP8 projections they feed (``rms_norm_fp8`` / ``silu_and_mul_fp8``), and the
model must compute what it computes when each projection quantizes its own input.

The oracle is the same model and kernels with the fusion off (the layers' ``quantize_for``
cleared before the kernels are chosen): both paths quantize the same rounded values with the
same arithmetic, so under Triton's interpreter (CPU) the logits must agree to float32 rounding;
compiled (GPU), where a value may land one e4m3 step away now and then, to 2% of the largest
logit. Per-block checkpoints (Qwen's format, 128-column activation groups) and per-channel ones
(on-the-fly, per-token scales) both run.
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

from fp8_checkpoints import FP8_SHAPE, write_fp8_checkpoint  # noqa: E402
from oracle import random_prompts  # noqa: E402
from nvray import EngineConfig  # noqa: E402
from nvray.layers.activation import SiluAndMul  # noqa: E402
from nvray.layers.norm import RMSNorm  # noqa: E402
from nvray.quantization.fp8_math import Fp8Activation  # noqa: E402
from nvray.step_protocol import SampleSpec, SeqStep, StepInput  # noqa: E402
from nvray.worker.model_runner import ModelRunner  # noqa: E402
from nvray.worker.setup import use_triton_kernels  # noqa: E402

INTERPRET = importlib.import_module("kernels.rms_norm")._INTERPRET
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("runs the kernels on CPU tensors: needs TRITON_INTERPRET=1", allow_module_level=True)


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory) -> str:
    from nvray.models.tiny import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("fused-src")), FP8_SHAPE, seed=11)


def _runner(path: str, fused: bool, **options) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=path, num_kvcache_blocks=8, kvcache_block_size=16,
                                      **options), path)
    if not fused:
        for module in runner.model.modules():
            if isinstance(module, (RMSNorm, SiluAndMul)):
                module.quantize_for = None
    assert use_triton_kernels(runner.model)  # what the runner does on the GPU
    runner.allocate_kv_cache(8)
    return runner


def _logits(runner: ModelRunner, prompt: list[int], steps: int) -> list[torch.Tensor]:
    spec, table = SampleSpec(0.0, 1.0, -1, 0.0, None, 0), [3, 7, 1, 0, 5, 2, 6, 4]
    tokens, out = list(prompt), []
    logits = runner.forward(StepInput([SeqStep(0, tokens, 0, table, spec)]))[0][0]
    for _ in range(steps):
        out.append(logits)
        tokens.append(int(logits.argmax()))
        logits = runner.forward(StepInput([SeqStep(0, [tokens[-1]], len(tokens) - 1, table,
                                                   spec)]))[0][0]
    return out


@pytest.mark.parametrize("fmt", ["qwen-fp8", "on-the-fly"])
def test_fused_activation_quantization_changes_no_logit(fmt, fp8_src, tmp_path):
    if fmt == "on-the-fly":
        path, options = fp8_src, {"quantization": "fp8"}
    else:
        path, options = write_fp8_checkpoint(fp8_src, str(tmp_path / fmt), fmt), {}
    fused, plain = _runner(path, True, **options), _runner(path, False, **options)
    layer = fused.model.model.layers[0]
    seen = []
    for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act_fn):
        module.register_forward_hook(lambda _m, _i, out: seen.append(
            out[0] if isinstance(out, tuple) and not isinstance(out, Fp8Activation) else out))
    prompt = random_prompts(1, 19, 19, seed=3)[0]
    for step, (got, want) in enumerate(zip(_logits(fused, prompt, 3), _logits(plain, prompt, 3))):
        # compiled, a value may land one e4m3 step away now and then (see test_norm_activation)
        tol = dict(atol=1e-5, rtol=1e-5) if INTERPRET else dict(atol=0.02 * float(want.abs().max()), rtol=0)
        torch.testing.assert_close(got, want, **tol, msg=f"step {step}")
    assert seen and all(isinstance(out, Fp8Activation) for out in seen), \
        "the norms and the activation before FP8 layers hand them quantized inputs"
    want_groups = 1 if fmt == "on-the-fly" else FP8_SHAPE["hidden_size"] // 128
    assert seen[0].scale.shape[1] == want_groups
