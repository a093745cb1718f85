"""The GEMM warm-up runs every distinct linear layer at the row counts steps use, and the LM head
at every row count a step can sample (``nvray/worker/gemm_warmup.py``)."""

from __future__ import annotations

import pytest
import torch

from nvray import EngineConfig
from nvray.layers.linear import LinearBase
from nvray.worker.gemm_warmup import token_counts, warm_gemms
from nvray.worker.model_runner import ModelRunner


@pytest.mark.parametrize("max_tokens", [1, 7, 256, 257, 300, 2049, 16384, 16385])
def test_token_counts_cover_small_counts_and_bound_the_gaps(max_tokens):
    counts = token_counts(max_tokens)
    assert counts == sorted(set(counts)), "ascending, no repeats"
    assert counts[0] == 1 and counts[-1] == max_tokens
    assert counts[:min(256, max_tokens)] == list(range(1, min(256, max_tokens) + 1))
    gaps = [b - a for a, b in zip(counts, counts[1:])]
    assert max(gaps, default=1) <= 128
    assert all(gap <= 8 for a, gap in zip(counts, gaps) if a < 2048)


def test_default_budget_warms_a_few_hundred_counts():
    assert 500 < len(token_counts(16384)) < 1000


def test_warm_gemms_runs_each_distinct_layer_and_the_head(qwen2_path):
    """Qwen2: biased qkv, so one layer per class and shape; 2 layers share each."""
    runner = ModelRunner(EngineConfig(model=qwen2_path, num_kvcache_blocks=16), qwen2_path)
    model = runner.model
    seen: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            module.register_forward_hook(
                lambda mod, args, out, name=name: seen.setdefault(name, []).append(args[0].shape[0]))
    head_rows: list[int] = []
    compute_logits = model.compute_logits

    def recording_logits(hidden: torch.Tensor) -> torch.Tensor | None:
        assert hidden.is_contiguous()
        head_rows.append(hidden.shape[0])
        return compute_logits(hidden)

    model.compute_logits = recording_logits
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    runs = warm_gemms(model, runner.hf_config.hidden_size, max_tokens=300, max_rows=12)

    kinds = {name.split(".")[-1] for name in seen}
    assert kinds == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert all(name.startswith("model.layers.0.") for name in seen), "one layer per shape"
    assert all(rows == token_counts(300) for rows in seen.values())
    assert head_rows == list(range(1, 13))
    assert runs == 4 * len(token_counts(300)) + 12
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
