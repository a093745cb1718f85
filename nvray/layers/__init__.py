"""Model building blocks: tensor-parallel linear layers, embeddings, norms, rotary, attention."""
