"""Pooling: embeddings and reranker scores from the engine's pooled rows.

A pooling request is a prompt prefilled and nothing generated: ``SamplingParams(max_tokens=0,
pool=...)`` (the engine's side: ``nvray/step_protocol.py``). It takes no decode slot: it
finishes in the step that prefills its prompt's last token, batched with whatever else runs.
Its prompt is tokenized as the checkpoint's own pipeline does (special tokens added: an
embedding model's tokenizer may end it with EOS).

- **embed** (``embed_params``): the pooled row is the final hidden state of the prompt's last
  token (last-token pooling, Qwen3-Embedding's); ``to_embedding`` keeps its first
  ``dimensions`` values (Matryoshka truncation) and L2-normalises it.
- **score** (``score_params``): a Qwen3-Reranker-style judge. ``reranker_prompt`` writes the
  query, the document and an instruction into the reranker's prompt, which asks for "yes" or
  "no"; the pooled row is the logits of those two tokens at the answer's position, and
  ``to_score`` the probability of "yes" between the two.

``PoolingTask.of(model_path)`` reads what a checkpoint is for: an embedding checkpoint (a
sentence-transformers ``modules.json`` with a Pooling module, or a bare ``Qwen3Model``
backbone) is ``embed``, with last-token pooling (other pooling modes are refused by name) and
normalisation as its ``Normalize`` module says; anything else ``generate``. A reranker is a
causal LM: an app serves one with ``task="score"``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np

from nvray.architectures import names_where
from nvray.sampling_params import SamplingParams

Task = Literal["generate", "embed", "score"]
_BACKBONES = names_where(backbone=True)  # embedding checkpoints (nvray/architectures.py)

# Qwen3-Reranker's prompt (its model card's format): a judge that answers "yes" or "no"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_RERANK_HEAD = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
                "the Query and the Instruct provided. Note that the answer can only be \"yes\" "
                "or \"no\".<|im_end|>\n<|im_start|>user\n")
_RERANK_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_TOKENS = ("yes", "no")


def embed_params() -> SamplingParams:
    return SamplingParams(max_tokens=0, pool=())


def score_params(yes_id: int, no_id: int) -> SamplingParams:
    return SamplingParams(max_tokens=0, pool=(yes_id, no_id))


def to_embedding(pooled: list[float], dimensions: int | None = None,
                 normalize: bool = True) -> list[float]:
    """A pooled hidden state as an embedding: its first ``dimensions`` values, L2-normalised
    (in numpy: a Python loop over a thousand values per row would cost more than the row's
    share of the prefill)."""
    if dimensions is not None:
        if not 1 <= dimensions <= len(pooled):
            raise ValueError(f"dimensions={dimensions} is invalid: must be in [1, "
                             f"{len(pooled)}] (the model's hidden size)")
        pooled = pooled[:dimensions]
    if not normalize:
        return list(pooled)
    vector = np.asarray(pooled, dtype=np.float64)
    norm = float(np.sqrt(vector @ vector)) or 1.0
    return (vector / norm).tolist()


def to_score(pooled: list[float]) -> float:
    """P("yes") between "yes" and "no", from their logits."""
    yes, no = pooled
    return 1.0 / (1.0 + math.exp(no - yes))


def reranker_prompt(query: str, document: str, instruction: str | None = None) -> str:
    return (f"{_RERANK_HEAD}<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}{_RERANK_TAIL}")


def rerank_token_ids(spellings: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The ids of "yes" and "no" from how the engine's tokenizer spells ``RERANK_TOKENS``."""
    if len(spellings) != len(RERANK_TOKENS) or any(len(ids) != 1 for ids in spellings):
        raise ValueError(f"the tokenizer does not spell {RERANK_TOKENS} as one token each: "
                         "not a Qwen3-Reranker-style checkpoint")
    return spellings[0][0], spellings[1][0]


@dataclass(frozen=True)
class PoolingTask:
    task: Task
    normalize: bool = True  # embed: L2-normalise (the checkpoint's Normalize module)

    @classmethod
    def of(cls, model_path: str) -> PoolingTask:
        modules = _read_json(os.path.join(model_path, "modules.json"))
        if isinstance(modules, list):
            kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules
                     if isinstance(m, dict)}
            if "Pooling" in kinds:
                _check_last_token(model_path, kinds["Pooling"].get("path", ""))
                return cls("embed", normalize="Normalize" in kinds)
        config = _read_json(os.path.join(model_path, "config.json")) or {}
        if set(config.get("architectures") or ()) & set(_BACKBONES):
            return cls("embed")
        return cls("generate")


def _check_last_token(model_path: str, module_path: str) -> None:
    pooling = _read_json(os.path.join(model_path, module_path, "config.json")) or {}
    modes = [k.removeprefix("pooling_mode_") for k, v in pooling.items()
             if k.startswith("pooling_mode_") and v]
    if modes and modes != ["lasttoken"]:
        raise ValueError(f"{model_path}: pooling {modes} is not supported: nvray pools the "
                         "last token (pooling_mode_lasttoken, Qwen3-Embedding's)")


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
