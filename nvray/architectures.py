"""One table of the architectures nvray serves: for each HF ``architectures`` name, nvray's
model class, the config defaults of the keys its models read, its chat template's tool-call
format and what kind of checkpoint it is.

Plain data (no torch, nothing of ``deployments``): ``nvray.models`` builds its registry from
it, ``nvray.model_config`` its defaults, ``nvray.pooling`` its backbones and the Serve app's
tool parsing (``deployments/apis/tools.py``) its per-architecture format. A new architecture is one
entry here (and its model module).

``Architecture`` fields: ``model`` (``"module:Class"``, imported when a rank builds it),
``config_defaults`` (what transformers' config class defaults to, for the keys nvray's models
read: read off transformers 5.24; ``tests/worker/test_model_config.py`` holds them to the
installed version), ``tool_call_format`` (``hermes``: ``<tool_call>`` JSON blocks, Qwen's;
``qwen3_xml``; ``llama3_json``), ``backbone`` (a bare backbone, an embedding checkpoint saved
through AutoModel: no LM head, no ``model.`` prefix on its tensors; it runs as its causal LM with
the head tied to the embeddings), ``language_model_of`` (a vision-language checkpoint whose
language model nvray serves: its keys live in ``text_config``) and ``drafter`` (a speculative
drafter's checkpoint, not a model to serve on its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_scaling": None, "quantization_config": None, "attention_bias": False,
}
QWEN_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
}


@dataclass(frozen=True)
class Architecture:
    model: str
    config_defaults: dict[str, Any] = field(default_factory=dict)
    tool_call_format: str = "hermes"
    backbone: bool = False
    language_model_of: bool = False
    drafter: bool = False


_QWEN3 = {**QWEN_DEFAULTS, "head_dim": 128}
_QWEN3_MOE = {
    **QWEN_DEFAULTS, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 24, "num_key_value_heads": 4, "head_dim": None,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
_LLAMA = {
    **COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "max_position_embeddings": 2048, "head_dim": None, "mlp_bias": False}
_MISTRAL = {
    **COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "head_dim": None, "sliding_window": 4096}
_GEMMA3 = {
    **COMMON_DEFAULTS, "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None,
    "sliding_window_pattern": 6, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "use_bidirectional_attention": False,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
_QWEN3_5: dict[str, Any] = {
    **COMMON_DEFAULTS, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 32768, "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "layer_types": None,
    "full_attention_interval": 4}
_QWEN3_5_MOE: dict[str, Any] = {
    **_QWEN3_5, "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8, "num_experts": 256}

ARCHITECTURES: dict[str, Architecture] = {
    "Qwen3ForCausalLM": Architecture("nvray.models.qwen3:Qwen3ForCausalLM", _QWEN3),
    "Qwen3Model": Architecture("nvray.models.qwen3:Qwen3ForCausalLM", _QWEN3, backbone=True),
    "Qwen2ForCausalLM": Architecture("nvray.models.qwen3:Qwen2ForCausalLM",
                                     {**QWEN_DEFAULTS, "head_dim": None}),  # hidden // heads
    "Qwen3MoeForCausalLM": Architecture("nvray.models.qwen3_moe:Qwen3MoeForCausalLM",
                                        _QWEN3_MOE),
    "LlamaForCausalLM": Architecture("nvray.models.llama:LlamaForCausalLM", _LLAMA,
                                     tool_call_format="llama3_json"),
    "MistralForCausalLM": Architecture("nvray.models.llama:MistralForCausalLM", _MISTRAL),
    "Gemma3ForCausalLM": Architecture("nvray.models.gemma3:Gemma3ForCausalLM", _GEMMA3),
    "Qwen3_5ForCausalLM": Architecture("nvray.models.qwen3_5:Qwen3_5ForCausalLM", _QWEN3_5,
                                       tool_call_format="qwen3_xml"),
    "Qwen3_5ForConditionalGeneration": Architecture(
        "nvray.models.qwen3_5:Qwen3_5ForCausalLM", _QWEN3_5, tool_call_format="qwen3_xml",
        language_model_of=True),
    "Qwen3_5MoeForCausalLM": Architecture("nvray.models.qwen3_5:Qwen3_5MoeForCausalLM",
                                          _QWEN3_5_MOE, tool_call_format="qwen3_xml"),
    "Qwen3_5MoeForConditionalGeneration": Architecture(
        "nvray.models.qwen3_5:Qwen3_5MoeForCausalLM", _QWEN3_5_MOE,
        tool_call_format="qwen3_xml", language_model_of=True),
    # EAGLE-3 drafters (speculative_config method "eagle3" only): a Llama layer
    "LlamaForCausalLMEagle3": Architecture("nvray.models.eagle3:Eagle3LlamaForCausalLM", _LLAMA,
                                           drafter=True),
    "Eagle3LlamaForCausalLM": Architecture("nvray.models.eagle3:Eagle3LlamaForCausalLM", _LLAMA,
                                           drafter=True),
    # Qwen3.5's MTP head, read from the target's checkpoint (speculative_config method "mtp")
    "Qwen3_5MTP": Architecture("nvray.models.qwen3_5_mtp:Qwen3_5MTP", drafter=True),
}


def names_where(**flags: bool) -> tuple[str, ...]:
    """The architectures whose fields have these values, e.g. ``names_where(backbone=True)``."""
    return tuple(name for name, arch in ARCHITECTURES.items()
                 if all(getattr(arch, key) == value for key, value in flags.items()))
