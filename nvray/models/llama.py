"""Llama 3.x (``LlamaForCausalLM``: 3.1/3.2/3.3, llama3 rope scaling, the tied embeddings of
the 1B/3B) and Mistral (``MistralForCausalLM``: every layer windowed by ``sliding_window`` where
the config sets one): the shared decoder of ``decoder.py``, without q/k norms, qkv and MLP bias
as the config's ``attention_bias`` / ``mlp_bias`` say."""

from __future__ import annotations

from nvray.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    qk_norm = False


class MistralForCausalLM(CausalLM):
    qk_norm = False
