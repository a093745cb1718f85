"""Test helpers for Qwen3.5's MTP head: a random head added to an HF-written Qwen3.5 checkpoint
(``mtp.*`` tensors as the released checkpoints name them, ``mtp_num_hidden_layers: 1``), an echo
variant (a target that repeats its last token and a head that proposes the token it reads), and
the oracle of its drafts: the target's final hidden states from HF transformers
(``last_hidden_state``), the head's layer HF's own ``Qwen3_5DecoderLayer`` (on MoE targets
``Qwen3_5MoeDecoderLayer``, its experts stored one by one as checkpoints store them) and norms,
``fc`` a matmul, over the whole sequence at once (no cache)."""

from __future__ import annotations

import json
import os
import shutil

import torch

_ZERO_OUT = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def _hf_config(path: str):  # noqa: ANN202
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    return getattr(cfg, "text_config", cfg)


def _hf_module(cfg):  # noqa: ANN001, ANN202
    """HF's modelling module of the target's family (dense or MoE Qwen3.5)."""
    if getattr(cfg, "num_experts", 0):
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf
    else:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    return hf


def _mtp_layer(cfg):  # noqa: ANN001, ANN202
    """HF's decoder layer of the head: a full-attention layer of the target's shape (its MLP
    the target's: routed and shared experts on MoE)."""
    hf = _hf_module(cfg)
    cfg = type(cfg).from_dict({**cfg.to_dict(), "layer_types": ["full_attention"],
                               "num_hidden_layers": 1})
    cfg._attn_implementation = "eager"
    layer = getattr(hf, "Qwen3_5MoeDecoderLayer", None) or hf.Qwen3_5DecoderLayer
    return layer(cfg, 0), cfg


def _checkpoint_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's in-memory layer tensors under the names checkpoints store: fused experts
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) one by one."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e, w in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


def _layer_state(layer, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The layer's state dict from the stored tensors (experts stacked back as HF holds them)."""
    state = {}
    for name, t in layer.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            t = torch.stack([torch.cat([stored[f"{base}{e}.gate_proj.weight"],
                                        stored[f"{base}{e}.up_proj.weight"]]) for e in range(len(t))])
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            t = torch.stack([stored[f"{base}{e}.down_proj.weight"] for e in range(len(t))])
        else:
            t = stored[name]
        state[name] = t
    return state


def write_mtp_checkpoint(path: str, target_path: str, seed: int, echo: bool = False,
                         noise: float = 0.0) -> str:
    """A copy of the Qwen3.5 checkpoint at ``target_path`` with a random one-layer MTP head.
    ``echo``: the target's output projections zero and its LM head its embeddings (it repeats
    its last token, and its final state at a position is that token's normed embedding), and
    the head's projections zero too with ``fc`` passing that state on (``noise``: with random
    weights of that scale added): it proposes the token the target's state holds, so every
    draft is right (some, with noise) only where the stored states and the chained outputs
    are."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(target_path, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(seed)
    layer, _ = _mtp_layer(_hf_config(path))
    hidden = text["hidden_size"]
    random = {name: torch.randn(t.shape, generator=g) * 0.1 for name, t in layer.state_dict().items()}
    tensors = {f"mtp.layers.0.{name}": t for name, t in _checkpoint_names(random).items()}
    tensors.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.1,
                    **{f"mtp.{n}.weight": torch.randn(hidden, generator=g) * 0.1
                       for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    if echo:
        embed_name = next(n for n in weights if n.endswith("embed_tokens.weight"))
        for name, t in [*weights.items(), *tensors.items()]:
            if name.endswith(_ZERO_OUT):
                t.zero_()
        head = next((n for n in weights if n.endswith("lm_head.weight")), None)
        if head is not None:
            weights[head] = weights[embed_name].clone()
        fc = torch.zeros(hidden, 2 * hidden)
        fc[:, hidden:] = torch.eye(hidden)
        tensors["mtp.fc.weight"] = fc + noise * torch.randn(fc.shape, generator=g)
    save_file({**weights, **{k: v.contiguous() for k, v in tensors.items()}}, file)
    return path


def reference_mtp_drafts(path: str, tokens: list[int], k: int) -> list[int]:
    """The k greedy drafts the head proposes after ``tokens`` (its rows: token p at position
    p - 1 with the target's final hidden state there; then each draft with the row before's
    normed output)."""
    from safetensors.torch import load_file

    from oracle import hf_model

    target = hf_model(path)
    w = {n.removeprefix("mtp."): t for n, t in load_file(os.path.join(path, "model.safetensors")).items()
         if n.startswith("mtp.")}
    layer, cfg = _mtp_layer(_hf_config(path))
    layer.load_state_dict(_layer_state(layer, {n.removeprefix("layers.0."): t for n, t in w.items()
                                               if n.startswith("layers.0.")}))
    hf = _hf_module(cfg)
    norm_class = getattr(hf, "Qwen3_5MoeRMSNorm", None) or hf.Qwen3_5RMSNorm
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        norms[name].weight.data.copy_(w[f"{name}.weight"])
    decoder = getattr(target.model, "language_model", target.model)
    embed = target.get_input_embeddings()
    with torch.no_grad():
        hidden = decoder(torch.tensor([tokens])).last_hidden_state[0]  # [n, H], normed
        rows_tok, rows_hidden, drafts = list(tokens[1:]), list(hidden[:-1].unbind(0)), []
        for _ in range(k):
            n = len(rows_tok)
            x = torch.cat([norms["pre_fc_norm_embedding"](embed(torch.tensor(rows_tok))),
                           norms["pre_fc_norm_hidden"](torch.stack(rows_hidden))], dim=-1)
            x = (x @ w["fc.weight"].T)[None]
            positions = torch.arange(n)[None]
            rope = decoder.rotary_emb(x, positions[None].expand(3, 1, n))
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = norms["norm"](layer(x, position_embeddings=rope, attention_mask=mask,
                                      position_ids=positions))[0]
            draft = int(target.lm_head(out[-1]).argmax())
            drafts.append(draft)
            rows_tok.append(draft)
            rows_hidden.append(out[-1])
    return drafts
