"""Model building blocks: tensor-parallel linear layers, embeddings, norms, rotary, attention.

Each layer takes its shard by the tensor-parallel rank and size (``tp.py``); attention reads and
writes the paged KV cache through one backend chosen once per runner (triton, flash_attn or
torch). Nothing here knows Ray, the engine or the step protocol.
"""
