"""A model's tokenizer and its end-of-sequence ids, read from the checkpoint directory.

The one place nvray loads a tokenizer. ``load_tokenizer`` is the engine's: a
``nvray.lean_tokenizer.LeanTokenizer`` over a byte-level BPE ``tokenizer.json`` (Qwen's, Llama
3's: a fraction of a second, no transformers import), else transformers' ``AutoTokenizer``.
``load_hf_tokenizer`` is always transformers' (what ``LLM.tokenizer`` gives users, and what
xgrammar reads a vocabulary from). The engine's driver, the offline ``LLM`` and a Serve replica
that formats log-probabilities load the same files. Nothing here touches the engine or Ray.
"""

from __future__ import annotations

import json
import os
from typing import Any


def load_tokenizer(model_path: str) -> Any:
    if os.path.exists(os.path.join(model_path, "tokenizer.json")):
        from nvray.lean_tokenizer import LeanTokenizer  # noqa: PLC0415

        tokenizer = LeanTokenizer(model_path)
        if tokenizer.byte_level:
            return tokenizer
    return load_hf_tokenizer(model_path)


def load_hf_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(model_path)


def eos_token_ids(model_path: str, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer, de-duplicated."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(model_path, name)
        if os.path.exists(file):
            with open(file) as f:
                value = json.load(f).get("eos_token_id")
            ids.extend(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
