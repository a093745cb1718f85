"""A speculative verification step laid out as its CUDA graph runs it (``verify_q`` rows a
sequence, real tokens first, padding sequences up to the graph's batch size) gives the logits of
the same step run eagerly, for sequences of different draft counts, a plain decode, a short
prompt and a prompt chunk that samples nothing, over shuffled blocks with a table that grows.

On the CPU the graph's region runs eagerly (``StepGraphs``' verification region on the
``InputBuilder``'s static inputs) through the torch attention backend, which reads the lengths
host-side: the test hands it the lengths the graph's device tensors hold."""

from __future__ import annotations

import dataclasses

import torch

from nvray import EngineConfig
from nvray.step_protocol import SampleSpec, SeqStep, StepInput
from nvray.worker.cuda_graph import StepGraphs, graph_capacity
from nvray.worker.inputs import GraphShapes, InputBuilder
from nvray.worker.model_runner import ModelRunner
from oracle import random_prompts

GREEDY = SampleSpec(0.0, 1.0, -1, 0.0, None, 0)
SHAPES = GraphShapes(verify=(1, 2, 4, 8), verify_q=5)
BLOCK = 16


def _with_host_lengths(model):
    """The model's forward, reading a graph region's lengths into the host lists the torch
    backend walks (a CUDA graph's kernels read them on the device)."""
    def forward(ids, positions, meta):
        starts = meta.query_start_loc.tolist()
        meta = dataclasses.replace(meta, query_lens_cpu=[b - a for a, b in zip(starts, starts[1:])],
                                   seq_lens_cpu=meta.seq_lens.tolist())
        return model(ids, positions, meta)
    return forward


def _tables() -> dict[int, list[int]]:
    shuffled = list(range(31, -1, -1))
    return {0: shuffled[0:4], 1: shuffled[4:8], 2: shuffled[8:12], 3: shuffled[12:16],
            4: shuffled[16:20]}


def test_a_verification_step_in_graph_layout_gives_the_eager_logits(tiny_path):
    runner = ModelRunner(EngineConfig(model=tiny_path, num_kvcache_blocks=32,
                                      kvcache_block_size=BLOCK), tiny_path)
    runner.allocate_kv_cache(32)
    tables = _tables()
    prompts = random_prompts(4, 14, 30, seed=21)
    prompts[1] = prompts[1][:15]  # its drafts cross into its second block
    # the context: each sequence's prompt, prefilled eagerly
    runner.forward(StepInput([SeqStep(i, p, 0, tables[i], GREEDY) for i, p in enumerate(prompts)]))
    more = random_prompts(5, 4, 4, seed=22)
    step = StepInput([
        SeqStep(0, more[0][:4], len(prompts[0]), tables[0], GREEDY, num_drafts=3),
        SeqStep(1, more[1][:5], len(prompts[1]), tables[1], GREEDY, num_drafts=4),
        SeqStep(2, more[2][:1], len(prompts[2]), tables[2], GREEDY),  # a plain decode
        SeqStep(3, more[3][:3], len(prompts[3]), tables[3], None),  # a chunk, nothing sampled
        SeqStep(4, more[4][:3], 0, tables[4], GREEDY, num_drafts=1),  # a short new prompt
    ])
    eager, _ = runner.forward(step)
    assert eager is not None and eager.shape[0] == 4 + 5 + 1 + 2

    builder = InputBuilder(BLOCK, runner.max_model_len, 8, graph_capacity(SHAPES),
                           runner.device)
    graphs = StepGraphs(_with_host_lengths(runner.model), builder, SHAPES,
                        (runner.hf_config.hidden_size,), runner.dtype, runner.max_model_len)
    batch = builder.prepare(step, SHAPES)
    assert batch.verify_bs == 8  # five sequences, padded to the graph of 8
    with torch.inference_mode():
        graphs._run_verify(batch.verify_bs)
        hidden = graphs.out[:batch.verify_bs * SHAPES.verify_q]
        logits = runner.model.compute_logits(hidden[batch.sample_idx])
    torch.testing.assert_close(logits, eager, atol=2e-5, rtol=1e-5)


def test_steps_the_verification_graphs_cannot_hold_run_elsewhere(tiny_path):
    builder = InputBuilder(BLOCK, 64, 8, graph_capacity(SHAPES), torch.device("cpu"))
    tables = _tables()
    too_long = StepInput([SeqStep(0, [1] * 6, 0, tables[0], GREEDY, num_drafts=5)])
    assert builder.prepare(too_long, SHAPES).verify_bs == 0  # six tokens: over verify_q
    crowded = StepInput([SeqStep(i, [1, 2], 3, tables[i % 5], GREEDY, num_drafts=1)
                         for i in range(9)])
    assert builder.prepare(crowded, SHAPES).verify_bs == 0  # nine sequences: over 8
    # padded to 5 positions, the context would pass max_model_len's last block (64)
    near_end = StepInput([SeqStep(0, [1, 2], 61, tables[0], GREEDY, num_drafts=1)])
    assert builder.prepare(near_end, SHAPES).verify_bs == 0
    fits = StepInput([SeqStep(0, [1, 2], 59, tables[0], GREEDY, num_drafts=1)])
    assert builder.prepare(fits, SHAPES).verify_bs == 1


def test_a_hybrids_verification_step_in_graph_layout_gives_the_eager_logits_and_state(
        family_path):
    """Qwen3.5 (linear-attention layers with a state per slot): the same step in graph layout
    gives the eager logits, leaves the same states (a plain decode's and a prompt chunk's
    written, the padding's nowhere) and the same held rows (drafting chunks', a new prompt's
    from position 0 among them)."""
    path = family_path("qwen3_5")
    config = EngineConfig(model=path, num_kvcache_blocks=32, kvcache_block_size=BLOCK,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    runner = ModelRunner(config, path)
    runner.allocate_kv_cache(32, state_rows=8)
    tables = _tables()
    prompts = random_prompts(4, 14, 30, seed=23)
    runner.forward(StepInput([SeqStep(i, p, 0, tables[i], GREEDY, state_slot=i)
                              for i, p in enumerate(prompts)]))
    more = random_prompts(5, 5, 5, seed=24)
    step = StepInput([
        SeqStep(0, more[0][:4], len(prompts[0]), tables[0], GREEDY, state_slot=0, num_drafts=3),
        SeqStep(1, more[1][:5], len(prompts[1]), tables[1], GREEDY, state_slot=1, num_drafts=4),
        SeqStep(2, more[2][:1], len(prompts[2]), tables[2], GREEDY, state_slot=2),  # a decode
        SeqStep(3, more[3][:3], len(prompts[3]), tables[3], None, state_slot=3),  # a chunk
        SeqStep(4, more[4][:3], 0, tables[4], GREEDY, state_slot=4, num_drafts=2),  # new prompt
    ])
    layers = runner.state_layers
    before = [[t.clone() for t in (*layer.state_tensors(), layer.held_mixed, layer.held_conv,
                                   layer.held_g, layer.held_beta)] for layer in layers]

    def states():
        return [[t[:5].clone() for t in layer.state_tensors()]
                + [t[:5 * 5].clone() for t in (layer.held_mixed, layer.held_conv, layer.held_g,
                                               layer.held_beta)] for layer in layers]

    eager, _ = runner.forward(step)
    eager_states = states()
    for layer, saved in zip(layers, before):  # back to the states before the step
        for tensor, old in zip((*layer.state_tensors(), layer.held_mixed, layer.held_conv,
                                layer.held_g, layer.held_beta), saved):
            tensor.copy_(old)
    builder = InputBuilder(BLOCK, runner.max_model_len, 8, graph_capacity(SHAPES),
                           runner.device, has_state=True, held_rows=5)
    graphs = StepGraphs(_with_host_lengths(runner.model), builder, SHAPES,
                        (runner.hf_config.hidden_size,), runner.dtype, runner.max_model_len)
    batch = builder.prepare(step, SHAPES)
    assert batch.verify_bs == 8
    with torch.inference_mode():
        graphs._run_verify(batch.verify_bs)
        hidden = graphs.out[:batch.verify_bs * SHAPES.verify_q]
        logits = runner.model.compute_logits(hidden[batch.sample_idx])
    torch.testing.assert_close(logits, eager, atol=2e-5, rtol=1e-5)
    for ours, theirs in zip(states(), eager_states):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
