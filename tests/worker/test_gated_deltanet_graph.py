"""A Gated DeltaNet layer's prefill chunk as a prefill CUDA graph runs it: one sequence padded
to the graph's length, its host-side lengths unknown (``PrefillLayout``'s device-built layout).
The token rows' outputs and the state the chunk leaves in its slot equal an eager run of the
same chunk unpadded (the padding neither decays nor writes the state; the conv keeps the last
inputs before it), from a resumed state and from position 0, for chunks shorter than the
conv's window too. On the CPU: the layout is device code either way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nvray.layers.attention import AttentionMetadata
from nvray.layers.gated_deltanet import GatedDeltaNet
from nvray.layers.tp import finish

CFG = SimpleNamespace(hidden_size=32, rms_norm_eps=1e-6, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4)
SLOT, GRAPH_LEN = 1, 16


def _layer() -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(CFG, None, "model.layers.0.linear_attn")
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape) * 0.3)
    layer.allocate_state(3, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        layer.conv_state.copy_(torch.randn(layer.conv_state.shape))
        layer.ssm_state.copy_(torch.randn(layer.ssm_state.shape) * 0.1)
    return layer


def _meta(start: int, rows: int, real: int, host_lists: bool) -> AttentionMetadata:
    slots = torch.tensor([*range(real), *[-1] * (rows - real)])
    return AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0, rows], dtype=torch.int32),
        seq_lens=torch.tensor([start + rows], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32), max_query_len=rows,
        max_seq_len=start + rows, query_lens_cpu=[rows] if host_lists else [],
        seq_lens_cpu=[start + rows] if host_lists else [],
        state_slots=torch.tensor([SLOT], dtype=torch.int32))


def _run(layer: GatedDeltaNet, x: torch.Tensor, start: int, meta: AttentionMetadata
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    positions = torch.arange(start, start + x.shape[0])
    with torch.no_grad():
        out = finish(layer(positions, x, meta))
    return out, layer.conv_state[SLOT].clone(), layer.ssm_state[SLOT].clone()


@pytest.mark.parametrize("start,tokens", [(20, 10), (20, 2), (0, 5), (7, 16)])
def test_a_padded_chunk_in_graph_form_equals_the_chunk_run_eager(start, tokens):
    x = torch.randn(GRAPH_LEN, CFG.hidden_size)
    eager = _run(_layer(), x[:tokens], start, _meta(start, tokens, tokens, host_lists=True))
    padded = _run(_layer(), x, start, _meta(start, GRAPH_LEN, tokens, host_lists=False))
    torch.testing.assert_close(padded[0][:tokens], eager[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[1], eager[1], msg="the conv's last inputs")
    torch.testing.assert_close(padded[2], eager[2], atol=1e-5, rtol=1e-5, msg="the state S")


def test_a_float32_layer_keeps_the_exact_torch_rule_where_fla_cores_kernel_is_set():
    """fla-core's chunked kernel computes float32 inputs with TF32 dots (about 1e-3 relative:
    Qwen3.5's float32 logits then left the GPU tier's 2e-3 bound in some runs): a float32 layer
    prefills through the torch rule even where ``use_triton_kernels`` set fla-core's."""
    x, start = torch.randn(10, CFG.hidden_size), 20
    exact = _run(_layer(), x, start, _meta(start, 10, 10, host_lists=True))
    layer = _layer()
    layer._chunk_rule = _tf32_kernel
    ours = _run(layer, x, start, _meta(start, 10, 10, host_lists=True))
    for got, want in zip(ours, exact):
        torch.testing.assert_close(got, want)


def _tf32_kernel(*args: object, **kwargs: object) -> None:
    raise AssertionError("fla-core's TF32 kernel ran for a float32 layer")
