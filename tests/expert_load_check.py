"""The expert-parallel load an engine reports (stats() and /metrics), checked against what its
token counts and the checkpoint's config imply."""

from __future__ import annotations

from typing import Any


def check_expert_load(stats: dict[str, Any], path: str, num_requests: int) -> None:
    """Every token the ranks computed went to top_k experts in each sparse layer (transformers'
    rule for which are), counted once, on the rank holding the expert."""
    import transformers  # noqa: PLC0415

    cfg = transformers.AutoConfig.from_pretrained(path)
    sparse = sum(1 for i in range(cfg.num_hidden_layers)
                 if i not in (cfg.mlp_only_layers or []) and (i + 1) % cfg.decoder_sparse_step == 0)
    computed = (stats["prompt_tokens"] - stats["prefix_cache_hit_tokens"]
                + stats["generation_tokens"])  # at most one computed token short a request
    per_rank = stats["expert_pairs_by_rank"]
    total = per_rank["0"] + per_rank["1"]
    assert (computed - num_requests) * cfg.num_experts_per_tok * sparse <= total
    assert total <= computed * cfg.num_experts_per_tok * sparse, (total, computed, sparse)
    assert per_rank["0"] > 0 and per_rank["1"] > 0
    assert sum(stats["expert_pairs_by_expert"]) == total
    assert len(stats["expert_pairs_by_expert"]) == cfg.num_experts
    assert stats["expert_load_imbalance"] == round(max(per_rank.values()) / (total / 2), 4)
    from deployments.ingress.metrics import render_metrics  # noqa: PLC0415

    text = render_metrics({None: stats}, "m")
    for rank, pairs in per_rank.items():
        assert f'nvray_expert_pairs_total{{model_name="m",rank="{rank}"}} {pairs}' in text
    assert f'nvray_expert_load_imbalance{{model_name="m"}} {stats["expert_load_imbalance"]}' in text
