"""Test helpers for EAGLE-3: a random drafter checkpoint in the format EAGLE-3's authors publish
(``LlamaForCausalLMEagle3``: ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), and
the oracle of its drafts: the target's features from HF transformers (``output_hidden_states``:
entry i is the stream entering layer i) and the drafter's layer written out here in plain torch,
over the whole sequence at once (no cache)."""

from __future__ import annotations

import json
import os

import torch


def write_eagle3_checkpoint(path: str, target_path: str, seed: int, *, draft_vocab: int | None = None,
                            aux_ids: list[int] | None = None, own_embeddings: bool = False,
                            max_position_embeddings: int = 2048, echo: float = 0.0,
                            speculators: bool = False) -> str:
    """A random one-layer EAGLE-3 drafter for the target at ``target_path`` (its hidden size and
    vocabulary). ``draft_vocab``: a draft vocabulary of that many target ids (a random sorted
    subset, mapped back by ``d2t``), else the target's own. ``echo``: ``fc`` passes the first
    feature on at that scale and the LM head is the target's embeddings, so the drafter leans
    towards repeating the token its row's feature holds (the random attention and MLP decide
    the rest: drafts of an echo target right part of the time). ``speculators``: the
    ``speculators`` library's format instead (the layer's config in ``transformer_layer_config``,
    tensors ``layers.0.*``, ``norm_before_residual`` true)."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(target_path, "config.json")) as f:
        target = json.load(f)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads, head_dim, inter = 4, 2, hidden // 4, 2 * hidden
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm() -> torch.Tensor:
        return 1.0 + rand(hidden)

    draft = draft_vocab or vocab
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": norm(), "lm_head.weight": rand(draft, hidden, std=1.0),
    }
    ids = torch.arange(vocab)
    if draft_vocab:
        ids = torch.randperm(vocab, generator=g)[:draft].sort().values
        tensors["d2t"] = ids - torch.arange(draft)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    if own_embeddings:
        tensors["embed_tokens.weight"] = rand(vocab, hidden, std=1.0)
    if echo:
        embed = load_file(os.path.join(target_path, "model.safetensors"))["model.embed_tokens.weight"]
        tensors["fc.weight"][:, :hidden] += echo * torch.eye(hidden)
        tensors["lm_head.weight"] = embed[ids] / embed.std()
    os.makedirs(path, exist_ok=True)
    if speculators:
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    layer = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
             "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
             "num_hidden_layers": 1, "vocab_size": vocab, "rms_norm_eps": 1e-6,
             "rope_theta": 10000.0, "max_position_embeddings": max_position_embeddings,
             "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32"}
    if speculators:
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer, "draft_vocab_size": draft,
                  "target_hidden_size": hidden,
                  "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]}}
        if aux_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux_ids
    else:
        config = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": draft}
        if aux_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids,
                                      "use_aux_hidden_state": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def write_echo_target(path: str, target_path: str) -> str:
    """The target at ``target_path`` made to repeat its last token (every ``o_proj`` and
    ``down_proj`` zero: each position's stream stays its token's embedding, which the tied LM
    head scores highest), written as a checkpoint HF transformers reads."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(target_path, path)
    weights = load_file(os.path.join(target_path, "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    save_file(weights, os.path.join(path, "model.safetensors"))
    return path


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated) of ``x`` [T, heads, dim]."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * inv[None]  # [T, dim/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = x[..., :dim // 2], x[..., dim // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _layer(w: dict, cfg: dict, tokens: torch.Tensor, hidden: torch.Tensor,
           embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter over rows 0..T-1 (row r at position r): (normed, prenorm) [T, H]."""
    heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    positions = torch.arange(tokens.shape[0])
    normed = _rms(hidden, w["midlayer.hidden_norm.weight"])
    if cfg.get("norm_before_residual"):
        hidden = normed  # the residual starts from the normed state
    x = torch.cat([_rms(embed[tokens], w["midlayer.input_layernorm.weight"]), normed], dim=-1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(-1, heads, dim)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(-1, kv_heads, dim)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
    q, k = _rope(q, positions, cfg["rope_theta"]), _rope(k, positions, cfg["rope_theta"])
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / dim ** 0.5
    causal = torch.ones(len(positions), len(positions), dtype=torch.bool).tril()
    attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
    residual = hidden + attn.flatten(1) @ w["midlayer.self_attn.o_proj.weight"].T
    h = _rms(residual, w["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(h @ w["midlayer.mlp.gate_proj.weight"].T)
           * (h @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
    prenorm = residual + mlp
    return _rms(prenorm, w["norm.weight"]), prenorm


def reference_drafts(target_path: str, eagle_path: str, tokens: list[int], k: int,
                     aux_ids: list[int]) -> list[int]:
    """The k greedy drafts an EAGLE-3 drafter proposes after ``tokens`` (its rows: token p at
    position p - 1 with the target's feature there; then each draft with the row before's
    prenorm state)."""
    from safetensors.torch import load_file

    from oracle import hf_model

    target = hf_model(target_path)
    w = {k.replace("layers.0.", "midlayer."): v
         for k, v in load_file(os.path.join(eagle_path, "model.safetensors")).items()}
    with open(os.path.join(eagle_path, "config.json")) as f:
        cfg = json.load(f)
    if "transformer_layer_config" in cfg:  # the speculators format
        cfg = {**cfg["transformer_layer_config"],
               "norm_before_residual": cfg.get("norm_before_residual", True)}
    embed = w.get("embed_tokens.weight", target.get_input_embeddings().weight.detach())
    with torch.no_grad():
        streams = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        features = torch.cat([streams[i][0] for i in aux_ids], dim=-1)  # [n, 3H]
        rows_tok = list(tokens[1:])
        rows_hidden = list((features[:-1] @ w["fc.weight"].T).unbind(0))
        drafts = []
        for _ in range(k):
            normed, prenorm = _layer(w, cfg, torch.tensor(rows_tok), torch.stack(rows_hidden), embed)
            draft = int((normed[-1] @ w["lm_head.weight"].T).argmax())
            draft += int(w["d2t"][draft]) if "d2t" in w else 0
            drafts.append(draft)
            rows_tok.append(draft)
            rows_hidden.append(prenorm[-1])
    return drafts
