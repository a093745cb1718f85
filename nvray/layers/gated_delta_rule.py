"""The gated delta rule and the causal conv of Gated DeltaNet linear attention, in torch: the
CPU path and the references of the GPU kernels (``layers/gated_deltanet.py`` is the layer;
``kernels/gdn_decode.py`` the decode step's kernels, held to ``decode_reference``).

- ``batched_causal_conv``: the depthwise causal conv (SiLU after) of several chunks at once,
  each after its sequence's previous inputs (laid out by ``conv_index``, once per step);
- ``chunked_gated_delta``: the rule over one sequence in 64-token chunks (one triangular solve
  per chunk), from a given state; ``recurrent_gated_delta``: one token of each of B sequences;
- ``decode_reference``: a decode step of B sequences against their state slots, in place;
- ``rows_reference``: short chunks of several sequences through the recurrent rule, token by
  token (speculative decoding's verified chunks; ``kernels/gdn_rows.py``'s contract);
- ``commit_reference``: the first ``count`` rows of each slot's held chunk applied to its state
  (speculative decoding; ``kernels/gdn_commit.py``'s contract).

All compute in float32 what transformers' ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` and ``causal_conv1d_*`` compute.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class ConvIndex(NamedTuple):
    """Where ``batched_causal_conv``'s buffer holds each chunk's previous inputs and tokens
    (the same for every layer of a step: ``conv_index`` makes it once)."""

    token_at: torch.Tensor  # [T] the buffer row of each token
    state_at: torch.Tensor  # [N * (K-1)] the rows of each chunk's previous inputs
    last_at: torch.Tensor  # [N * (K-1)] the rows of each chunk's last K-1 inputs (its new state)
    rows: int


def conv_index(lens: list[int], kernel: int, device: torch.device) -> ConvIndex:
    """The buffer layout of chunks of ``lens`` tokens: each after its K-1 previous inputs.
    Computed on the host and moved in one copy (no device sync)."""
    n, k = len(lens), kernel
    lens_t = torch.tensor(lens, dtype=torch.long)
    starts = torch.cumsum(lens_t, 0) - lens_t + torch.arange(n) * (k - 1)
    token_at = (torch.arange(int(lens_t.sum()))
                + (torch.repeat_interleave(torch.arange(n), lens_t) + 1) * (k - 1))
    state_at = (starts.unsqueeze(1) + torch.arange(k - 1)).flatten()
    last_at = (starts.unsqueeze(1) + lens_t.unsqueeze(1) + torch.arange(k - 1)).flatten()
    moved = torch.cat([token_at, state_at, last_at]).to(device).split(
        [len(token_at), len(state_at), len(last_at)])
    return ConvIndex(*moved, int(lens_t.sum()) + n * (k - 1))


def padded_conv_index(length: int, kernel: int, padding: torch.Tensor) -> ConvIndex:
    """The buffer layout of N chunks of ``length`` rows each whose last ``padding[i]`` rows (a
    device tensor [N], or a scalar for one chunk: a CUDA graph's padding) are not tokens: each
    chunk's new state is the K-1 inputs before its padding. Built on the device
    (capturable)."""
    k, device = kernel, padding.device
    padding = padding.reshape(-1)
    span = length + k - 1  # a chunk's K-1 previous inputs, then its rows
    base = (torch.arange(padding.shape[0], device=device) * span).unsqueeze(1)
    ahead = torch.arange(k - 1, device=device)
    token_at = (base + (k - 1) + torch.arange(length, device=device)).flatten()
    last_at = (base + (length - padding).unsqueeze(1) + ahead).flatten()
    return ConvIndex(token_at, (base + ahead).flatten(), last_at, padding.shape[0] * span)


def batched_causal_conv(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor,
                        lens: list[int], index: ConvIndex | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal conv (SiLU after) of N chunks at once: ``x`` [T, C] holds the
    chunks one after the other (``lens``), ``prev`` [N, C, K-1] their previous inputs. Each
    chunk is laid out after its K-1 previous inputs in one buffer (``index``, default
    ``conv_index(lens)``), one conv runs over all of it, and the outputs at the chunks' tokens
    are kept (a window never reaches into the chunk before). Returns SiLU(conv) [T, C] and each
    chunk's new last K-1 inputs [N, C, K-1]."""
    n, k = len(lens), weight.shape[1]
    index = index or conv_index(lens, k, x.device)
    buffer = x.new_zeros(index.rows, x.shape[1])
    buffer[index.state_at] = prev.to(x.dtype).transpose(1, 2).flatten(0, 1)
    buffer[index.token_at] = x
    out = F.conv1d(buffer.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1),
                   groups=weight.shape[0])[0]  # [C, len - K + 1]: window ending at i + K - 1
    final = buffer[index.last_at].view(n, k - 1, -1).transpose(1, 2)
    return F.silu(out[:, index.token_at - (k - 1)]).t().to(x.dtype), final


def chunked_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, in chunks. q, k [L, H, dk] (normalised, q
    scaled), v [L, H, dv], g and beta [L, H], state [H, dk, dv]; all float32. Returns the
    outputs [L, H, dv] and the final state.

    Within a chunk with cumulative log-decay c_i, the updates u_i = beta_i (v_i - S'_i^T k_i)
    satisfy (I + A) U = beta V - beta exp(c) K S0 with A_ij = beta_i exp(c_i - c_j) k_i.k_j
    (j < i): one unit-triangular solve per chunk instead of a loop over its tokens."""
    length = q.shape[0]
    pad = -length % chunk
    if pad:  # padding rows write nothing (k = 0, beta = 0) and decay nothing (g = 0)
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    n = q.shape[0] // chunk
    # [H, n, C, d]
    q, k, v = (t.view(n, chunk, *t.shape[1:]).permute(2, 0, 1, 3) for t in (q, k, v))
    g, beta = (t.view(n, chunk, -1).permute(2, 0, 1) for t in (g, beta))  # [H, n, C]
    c = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is taken as 1 (unitriangular)
    updates = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False,
                                            unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, k_beta * c.exp().unsqueeze(-1),
                                               upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * c.exp().unsqueeze(-1)
    k_to_end = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    chunk_decay = c[..., -1].exp()  # [H, n]
    out = torch.empty_like(v)
    for i in range(n):
        u = updates[:, i] - state_keys[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ u
        state = state * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.permute(1, 2, 0, 3).reshape(n * chunk, *out.shape[:1], out.shape[-1])[:length], state


def recurrent_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, state: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, H, dk], v [B, H, dv], g, beta [B, H],
    state [B, H, dk, dv]; float32. Returns the outputs [B, H, dv] and the new states."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k.unsqueeze(-1)).sum(-2)
    delta = (v - remembered) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(-2), state


def split_heads(conv_out: torch.Tensor, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's output [N, conv_dim] -> q, k [N, nv, dk] (normalised, q scaled; key heads
    repeated for their value heads) and v [N, nv, dv], float32."""
    key_dim = num_k_heads * head_k_dim
    q, k, v = conv_out.float().split([key_dim, key_dim, conv_out.shape[1] - 2 * key_dim], -1)
    group = num_v_heads // num_k_heads
    q, k = (l2_normalize(t.view(-1, num_k_heads, head_k_dim)).repeat_interleave(group, dim=1)
            for t in (q, k))
    return q * head_k_dim ** -0.5, k, v.view(-1, num_v_heads, head_v_dim)


def decode_reference(mixed: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor, ssm_state: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor, num_k_heads: int,
                     head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """A decode step of B sequences in torch, batched (``kernels/gdn_decode.py``'s contract):
    the token's conv over its slot's last inputs and the rule's update of its slot's S, both
    written back; a sequence at position 0 starts from zero state."""
    rows = slots.long() % conv_state.shape[0]
    keep = (positions > 0).view(-1, 1, 1)
    prev = conv_state.index_select(0, rows) * keep
    window = torch.cat([prev, mixed.unsqueeze(-1).to(prev.dtype)], dim=-1)  # [B, C, K]
    conv = F.silu((window.to(conv_weight.dtype) * conv_weight).sum(-1))
    conv_state.index_copy_(0, rows, window[:, :, 1:])
    q, k, v = split_heads(conv.to(mixed.dtype), num_k_heads, ssm_state.shape[1], head_k_dim,
                           head_v_dim)
    state = ssm_state.index_select(0, rows) * keep.unsqueeze(-1)
    out, state = recurrent_gated_delta(q, k, v, g, beta, state)
    ssm_state.index_copy_(0, rows, state)
    return out.to(mixed.dtype)


def commit_reference(held_mixed: torch.Tensor, held_conv: torch.Tensor, held_g: torch.Tensor,
                     held_beta: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                     slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                     held_rows: int, num_k_heads: int, head_k_dim: int, head_v_dim: int) -> None:
    """Apply the first ``counts[i]`` held rows of slot ``slots[i]`` to its state, in place
    (``kernels/gdn_commit.py``'s contract). A slot's R held rows sit at ``slot * R ..``:
    ``held_mixed`` [rows * R, C] the tokens' conv inputs, ``held_conv`` their conv outputs
    (SiLU'd), ``held_g`` / ``held_beta`` [rows * R, HV]. The conv window becomes the last K - 1
    of the old window and the kept inputs; S takes the kept tokens' updates in order. A chunk
    that started at position 0 (``starts``) starts from zero state. An entry of count 0 does
    nothing (a CUDA graph's padding)."""
    kept = counts > 0
    slots, starts, counts = slots[kept], starts[kept], counts[kept]
    rows, channels, r = slots.long(), held_mixed.shape[1], held_rows
    resumes = (starts > 0).view(-1, 1, 1)
    old = conv_state.index_select(0, rows) * resumes  # [N, C, K-1]
    kept = held_mixed.view(-1, r, channels).index_select(0, rows).transpose(1, 2)
    line = torch.cat([old, kept.to(old.dtype)], dim=-1)  # [N, C, K-1+R]
    window = counts.long().view(-1, 1) + torch.arange(old.shape[-1], device=old.device)
    conv_state.index_copy_(0, rows, line.gather(2, window.unsqueeze(1).expand(-1, channels, -1)))
    conv = held_conv.view(-1, r, channels).index_select(0, rows)
    g, beta = (t.view(-1, r, t.shape[-1]).index_select(0, rows) for t in (held_g, held_beta))
    state = ssm_state.index_select(0, rows) * resumes.unsqueeze(-1)
    for j in range(r):
        _, k, v = split_heads(conv[:, j], num_k_heads, ssm_state.shape[1], head_k_dim, head_v_dim)
        _, stepped = recurrent_gated_delta(k, k, v, g[:, j], beta[:, j], state)
        state = torch.where((counts > j).view(-1, 1, 1, 1), stepped, state)
    ssm_state.index_copy_(0, rows, state)


def short_conv_reference(mixed: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         read_rows: torch.Tensor, write_rows: torch.Tensor, resumes: torch.Tensor,
                         query_start_loc: torch.Tensor, real_lens: torch.Tensor,
                         held_at: torch.Tensor | None, held_mixed: torch.Tensor,
                         held_conv: torch.Tensor) -> torch.Tensor:
    """The causal conv (SiLU after) of N short chunks (``kernels/gdn_short_conv.py``'s
    contract) through ``batched_causal_conv``: chunk i's rows (``query_start_loc``) after the
    window of row ``read_rows[i]`` (zero where ``resumes[i]`` is false), its new window (the
    last K - 1 inputs of its first ``real_lens[i]`` rows) stored at ``write_rows[i]``, each
    row's input and output kept at its ``held_at`` row too. Returns the outputs [T, C]."""
    starts = query_start_loc.long()
    lens = (starts[1:] - starts[:-1]).tolist()
    kernel = weight.shape[1]
    prev = conv_state.index_select(0, read_rows.long()) * resumes.view(-1, 1, 1)
    index = conv_index(lens, kernel, mixed.device)
    # each chunk's new window: the K - 1 buffer rows before its padding (a chunk's rows start
    # K - 1 rows after its window's, and each window takes K - 1 rows of the buffer)
    window_at = starts[:-1] + torch.arange(len(lens), device=mixed.device) * (kernel - 1)
    last_at = window_at.unsqueeze(1) + real_lens.long().unsqueeze(1) + torch.arange(
        kernel - 1, device=mixed.device)
    out, final = batched_causal_conv(mixed, prev, weight, lens,
                                     index._replace(last_at=last_at.flatten()))
    conv_state.index_copy_(0, write_rows.long(), final.to(conv_state.dtype))
    if held_at is not None:
        held_mixed.index_copy_(0, held_at.long(), mixed.to(held_mixed.dtype))
        held_conv.index_copy_(0, held_at.long(), out.to(held_conv.dtype))
    return out


def rows_reference(conv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   ssm_state: torch.Tensor, read_rows: torch.Tensor, write_rows: torch.Tensor,
                   resumes: torch.Tensor, query_start_loc: torch.Tensor, num_k_heads: int,
                   head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """N chunks (``query_start_loc`` [N+1]) of conv outputs ``conv`` [T, conv_dim] through the
    rule token by token (``kernels/gdn_rows.py``'s contract): chunk i starts from S of row
    ``read_rows[i]`` (zero where ``resumes[i]`` is false) and leaves its final S in row
    ``write_rows[i]``. Returns the outputs [T, HV, dv] in conv's dtype."""
    num_v_heads = ssm_state.shape[1]
    q, k, v = split_heads(conv, num_k_heads, num_v_heads, head_k_dim, head_v_dim)
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    state = ssm_state.index_select(0, read_rows.long()) * resumes.view(-1, 1, 1, 1)
    out = v.new_zeros(v.shape)
    for j in range(int(lens.max()) if lens.numel() else 0):
        live = (lens > j).nonzero().view(-1)
        at = starts[live] + j
        o, stepped = recurrent_gated_delta(q[at], k[at], v[at], g[at], beta[at], state[live])
        state[live] = stepped
        out[at] = o
    ssm_state.index_copy_(0, write_rows.long(), state)
    return out.to(conv.dtype)
