"""Helpers shared by the Serve tests: the app's max_model_len, greedy params, /metrics reads,
a checkpoint scripted to think then answer."""

from __future__ import annotations

import re

import requests

from nvray import SamplingParams

MAX_MODEL_LEN = 512


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def metric(base_url: str, name: str, **labels: str) -> float:
    """The first sample of /metrics' family ``name`` whose labels include ``labels``."""
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    for label_text, value in re.findall(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"{name} {labels or ''} not in /metrics")


def assert_counters_balance(base_url: str) -> None:
    """An idle engine: every request it accepted has finished, once (stop, length, abort or
    error)."""
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    finished = sum(float(v) for v in re.findall(r"^nvray_requests_finished_total\{[^}]*\} (\S+)$",
                                                text, re.M))
    assert metric(base_url, "nvray_requests_accepted_total") == finished


# the "thinker" app (conftest.thinker_url): its model answers MESSAGES with REASONING, CONTENT
SYSTEM, USER = "Be terse.", "Hello there!"
REASONING, CONTENT = "The quick fox", "Hello world!"
THINKER_MODEL, THINKER_KEY, THINKER_LEN = "acme/scripted-thinker", "thinker-key", 8192
PICK_SCHEMA = {"type": "object", "required": ["n"], "additionalProperties": False,
               "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}


def thinker_script() -> tuple[list[dict], str, str]:
    return ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
            REASONING, CONTENT)


def build_scripted_thinker(path: str, messages: list[dict], reasoning: str, content: str,
                           max_len: int) -> str:
    """A Qwen3 checkpoint at ``path`` whose greedy answer to ``messages`` (rendered by its chat
    template) is ``<think>reasoning</think>content`` then EOS: each token of that chain is
    its own embedding direction, which the LM head maps to its successor."""
    import torch
    from safetensors.torch import load_file, save_file

    from nvray.models.tiny import build_checkpoint
    from nvray.tokenizer import load_hf_tokenizer

    build_checkpoint(path, {"tie_word_embeddings": False, "max_position_embeddings": max_len})
    tok = load_hf_tokenizer(path)
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True),
                        add_special_tokens=False)
    ids = tok.convert_tokens_to_ids
    chain = [prompt[-1], ids("<think>"), *tok.encode(reasoning, add_special_tokens=False),
             ids("</think>"), *tok.encode(content, add_special_tokens=False), ids("<|im_end|>")]
    assert len(set(chain)) == len(chain), "each token of the chain needs a single successor"
    weights = load_file(f"{path}/model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()  # the residual stream stays the current token's embedding
    weights["model.norm.weight"].fill_(1.0)
    weights["lm_head.weight"].zero_()
    for dim, (token, successor) in enumerate(zip(chain, chain[1:])):
        weights["model.embed_tokens.weight"][token] = torch.nn.functional.one_hot(
            torch.tensor(dim), weights["model.embed_tokens.weight"].shape[1]).float()
        weights["lm_head.weight"][successor, dim] = 10.0
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path
