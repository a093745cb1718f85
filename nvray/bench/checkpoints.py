"""The benchmarks' checkpoints: Qwen3-shaped models with random bf16 weights, built once.

``random_qwen3_checkpoint(path, shape)`` writes (or finds) a checkpoint of one of
``QWEN3_SHAPES`` at ``path``; ``default_checkpoint(shape)`` is the one in the temp dir that the
benchmarks use without ``--model``. Throughput does not depend on weight values with
``ignore_eos``, so no real weights are needed.
"""

from __future__ import annotations

from typing import Any

# Qwen3-0.6B's and Qwen3-8B's shapes (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-8B). As in the
# real checkpoints, the model's 151936 vocabulary rows are a little more than the tokenizer's
# 151669 tokens, so the LM head, the sampler and the detokenizer cost what they cost with the
# real model.
QWEN3_0_6B_SHAPE: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True}
QWEN3_8B_SHAPE: dict[str, Any] = {
    **QWEN3_0_6B_SHAPE, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "tie_word_embeddings": False}
QWEN3_SHAPES: dict[str, dict[str, Any]] = {"0.6b": QWEN3_0_6B_SHAPE, "8b": QWEN3_8B_SHAPE}
QWEN3_VOCAB, QWEN3_TOKENIZER_VOCAB = 151936, 151669


def random_qwen3_checkpoint(path: str, shape: str = "0.6b", std: float = 0.2) -> str:
    """A Qwen3 checkpoint of the named shape (``QWEN3_SHAPES``) with random bf16 weights at
    ``path`` (built once)."""
    import os  # noqa: PLC0415

    from nvray.models.tiny import build_checkpoint  # noqa: PLC0415

    if shape not in QWEN3_SHAPES:
        raise ValueError(f"unknown Qwen3 shape {shape!r}; choose from {sorted(QWEN3_SHAPES)}")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    return build_checkpoint(path, QWEN3_SHAPES[shape], seed=0, vocab_size=QWEN3_VOCAB,
                            tokenizer_vocab_size=QWEN3_TOKENIZER_VOCAB, dtype="bfloat16",
                            std=std)


def default_checkpoint(shape: str = "0.6b") -> str:
    """The benchmarks' default model: a Qwen3-shaped random checkpoint in the temp dir."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    path = os.path.join(tempfile.gettempdir(), f"nvray-qwen3-{shape}-random")
    return random_qwen3_checkpoint(path, shape)
