"""Gated DeltaNet: the linear-attention mixer of Qwen3.5's hybrid layers, with its per-sequence
state.

A layer projects each token to q, k (``linear_num_key_heads`` heads of ``linear_key_head_dim``),
v and an output gate z (``linear_num_value_heads`` heads of ``linear_value_head_dim``), a decay
input a and a write strength b per value head. q, k and v go through a causal depthwise
convolution over time (kernel ``linear_conv_kernel_dim``, SiLU), q and k are L2-normalised (q
scaled by ``dk ** -0.5``), and each value head keeps a ``[dk, dv]`` matrix state S updated per
token by the gated delta rule::

    S <- exp(g) * S;   S <- S + k (beta * (v - S^T k))^T;   o = S^T q
    g = -exp(A_log) * softplus(a + dt_bias),   beta = sigmoid(b)

(a value head reads key head ``h // (nv / nk)``). The output is RMS-normalised per head, scaled
by ``weight`` and gated by ``silu(z)``, then projected back (``out_proj``, row-parallel).

**State.** A sequence's whole history lives in two fixed-size tensors per layer: the last
``K - 1`` conv inputs ``[conv_dim, K - 1]`` (compute dtype) and S ``[nv, dk, dv]`` (float32).
The model runner allocates them per *state slot* (``conv_state`` / ``ssm_state``, first dim
the slot; ``allocate_state``); the engine gives each running sequence a slot
(``BlockManager``), which reaches this layer as ``AttentionMetadata.state_slots`` (one per
sequence; -1, or any slot past the end, is the last row: a scratch row for a CUDA graph's
padding and the start-up warm-up). A sequence whose chunk starts at position 0 starts from zero
state whatever its slot holds, so a slot is reused without clearing; a chunk that starts later
resumes from its slot (chunked prefill carries the state across chunks).

**Held chunks** (speculative decoding: a state cannot be rolled back to a rejected draft). A
chunk the metadata marks held (``AttentionMetadata.state_held_at``: each of its tokens' row in
the layer's held buffers, ``slot * R + j``) reads its slot's state as any chunk does but does
not write its final state back: its tokens' conv inputs and outputs, decays and write
strengths are kept in the held buffers (``R`` rows a slot, ``allocate_state(held_rows=R)``)
instead. Once the engine knows how many of them it kept (the sequence's next chunk starts
there), ``commit_held`` applies the first ``count`` of them to the slot
(``kernels/gdn_commit.py`` on the GPU; ``commit_reference`` in torch).

**Compute.** Prefill chunks: one conv over all of a step's chunks, then the chunked form of the
rule (fla-core's varlen kernel on the GPU where it is installed, else sequence by sequence in
torch); with speculation, a step whose chunks are all at most R tokens (verification) runs
the rule token by token instead (``kernels/gdn_rows.py``; ``rows_reference``); a step of decodes only (one token per sequence) runs one batched recurrent update with
no host-side loop (on the GPU ``kernels/gdn_decode.py``, in place), which a CUDA graph can
capture. The torch forms are ``layers/gated_delta_rule.py``.

**Tensor parallelism** splits the heads: each rank holds ``nk / tp`` key heads and ``nv / tp``
value heads (their projections' rows, conv channels, ``A_log`` and ``dt_bias`` entries, and
their state); ``out_proj`` is row-parallel.
"""

from __future__ import annotations

import importlib.util
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nvray.layers.attention import AttentionMetadata
from nvray.layers.gated_delta_rule import (CHUNK, ConvIndex, batched_causal_conv,
                                           chunked_gated_delta, commit_reference, conv_index,
                                           decode_reference, padded_conv_index, rows_reference,
                                           short_conv_reference, split_heads)
from nvray.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from nvray.layers.tp import PartialSum, divide, tp_rank, tp_size
from nvray.quantization import Fp8Config

class FusedColumnParallelLinear(MergedColumnParallelLinear):
    """Column-parallel parts stored as ONE checkpoint tensor (``in_proj_qkv``: q, k, v rows
    one after the other): each part is sharded over the ranks on its own."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        if args:
            return super().weight_loader(param, loaded, *args)
        full = sum(self.output_sizes)
        step = loaded.shape[0] * 1.0 / full  # rows of ``loaded`` per output feature (scales)
        if int(step * full) != loaded.shape[0] or (step != 1 and step * min(self.output_sizes) % 1):
            raise ValueError(f"expected {full} output rows, checkpoint has {loaded.shape[0]}")
        start = 0
        for part, size in enumerate(self.output_sizes):
            rows = int(size * step)
            super().weight_loader(param, loaded.narrow(0, start, rows), part)
            start += rows


class DepthwiseConvWeight(nn.Module):
    """The causal conv's weight, ``[channels, K]`` on this rank (checkpoints store
    ``[conv_dim, 1, K]``), its channels the q, k, v parts sharded like ``in_proj_qkv``."""

    def __init__(self, part_sizes: list[int], kernel: int) -> None:
        super().__init__()
        self.part_sizes = part_sizes
        local = [divide(n, tp_size(), "linear attention channels") for n in part_sizes]
        self.weight = nn.Parameter(torch.empty(sum(local), kernel), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        loaded = loaded.reshape(loaded.shape[0], -1)
        if tuple(loaded.shape) != (sum(self.part_sizes), param.shape[1]):
            raise ValueError(f"expected shape {(sum(self.part_sizes), 1, param.shape[1])}, "
                             f"checkpoint has {tuple(loaded.shape)}")
        src = dst = 0
        for size in self.part_sizes:
            local = size // tp_size()
            param.data[dst:dst + local] = loaded[src + tp_rank() * local:src + (tp_rank() + 1) * local]
            src, dst = src + size, dst + local


def _head_sharded(num_heads: int, init: float) -> nn.Parameter:
    """A per-value-head vector (``A_log``, ``dt_bias``), this rank's heads."""
    local = divide(num_heads, tp_size(), "linear_num_value_heads")
    param = nn.Parameter(torch.full((local,), init), requires_grad=False)

    def load(p: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
        if tuple(loaded.shape) != (num_heads,):
            raise ValueError(f"expected shape {(num_heads,)}, checkpoint has {tuple(loaded.shape)}")
        p.data.copy_(loaded.narrow(0, tp_rank() * local, local))

    param.weight_loader = load  # type: ignore[attr-defined]
    return param


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the rule's output, scaled by ``weight`` then gated by ``silu(z)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (see the module docstring); ``forward(positions, x, meta)``
    as an attention layer's."""

    def __init__(self, cfg: Any, quant: Fp8Config | None, prefix: str) -> None:
        super().__init__()
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if nv % nk:
            raise ValueError(f"linear_num_value_heads={nv} is not a multiple of "
                             f"linear_num_key_heads={nk}")
        self.num_k_heads = divide(nk, tp_size(), "linear_num_key_heads")
        self.num_v_heads = divide(nv, tp_size(), "linear_num_value_heads")
        self.head_k_dim, self.head_v_dim = dk, dv
        self.kernel = cfg.linear_conv_kernel_dim
        parts = [nk * dk, nk * dk, nv * dv]

        def quant_for(module: str) -> Fp8Config | None:  # the checkpoint module's, FP8 or not
            return quant.for_modules([f"{prefix}.{module}"]) if quant is not None else None

        self.in_proj_qkv = FusedColumnParallelLinear(
            cfg.hidden_size, parts, quant=quant_for("in_proj_qkv"))
        self.in_proj_z = ColumnParallelLinear(cfg.hidden_size, nv * dv,
                                              quant=quant_for("in_proj_z"))
        self.in_proj_b = ColumnParallelLinear(cfg.hidden_size, nv)
        self.in_proj_a = ColumnParallelLinear(cfg.hidden_size, nv)
        self.conv1d = DepthwiseConvWeight(parts, self.kernel)
        self.A_log = _head_sharded(nv, 0.0)
        self.dt_bias = _head_sharded(nv, 1.0)
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(nv * dv, cfg.hidden_size,
                                          quant=quant_for("out_proj"))
        self.conv_dim = self.conv1d.weight.shape[0]
        self.conv_state = torch.empty(0)  # [rows, conv_dim, K-1]: allocate_state
        self.ssm_state = torch.empty(0)  # [rows, nv, dk, dv] float32
        self.held_rows = 0  # R: rows a slot holds of a held chunk (speculative decoding)
        self.held_mixed = torch.empty(0)  # [rows * R, conv_dim]: a held token's conv input
        self.held_conv = torch.empty(0)  # [rows * R, conv_dim]: its conv output (SiLU'd)
        self.held_g = torch.empty(0)  # [rows * R, nv] float32: its log-decay
        self.held_beta = torch.empty(0)  # [rows * R, nv] float32: its write strength
        self._decode_fn = decode_reference  # use_triton_kernels(): kernels/gdn_decode.py
        self._commit_fn = commit_reference  # use_triton_kernels(): kernels/gdn_commit.py
        self._rows_fn = rows_reference  # use_triton_kernels(): kernels/gdn_rows.py
        self._short_conv_fn = short_conv_reference  # use_triton_kernels(): gdn_short_conv.py
        self._chunk_rule: Any = None  # use_triton_kernels(): fla-core's, where installed

    def use_triton_kernels(self) -> None:
        """GPU only: a decode step as two Triton kernels updating the slots in place; prefill
        chunks of 16-bit activations through fla-core's varlen chunked kernel where fla-core is
        installed (its float32 dots run in TF32, about 1e-3 relative: a float32 layer keeps the
        torch rule, exact as nvray's own kernels are in float32)."""
        import kernels  # noqa: PLC0415 - GPU-only import

        if self.head_k_dim & (self.head_k_dim - 1) == 0:
            self._decode_fn = kernels.gdn_decode
            self._commit_fn = kernels.gdn_commit
            self._rows_fn = kernels.gdn_rows
            self._short_conv_fn = kernels.gdn_short_conv
        if importlib.util.find_spec("fla") is not None:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: PLC0415

            self._chunk_rule = chunk_gated_delta_rule

    # ----------------------------------------------------------------- state
    def state_bytes(self, dtype: torch.dtype, held_rows: int = 0) -> int:
        """One slot's state on this rank (conv inputs in ``dtype``, S in float32), and its
        ``held_rows`` rows of a held chunk."""
        conv = self.conv_dim * (self.kernel - 1) * dtype.itemsize
        held = held_rows * (2 * self.conv_dim * dtype.itemsize + 2 * self.num_v_heads * 4)
        return conv + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4 + held

    def allocate_state(self, rows: int, dtype: torch.dtype, device: torch.device,
                       held_rows: int = 0) -> None:
        self.conv_state = torch.zeros(rows, self.conv_dim, self.kernel - 1, dtype=dtype,
                                      device=device)
        self.ssm_state = torch.zeros(rows, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                     dtype=torch.float32, device=device)
        self.held_rows = held_rows
        self.held_mixed = torch.zeros(rows * held_rows, self.conv_dim, dtype=dtype, device=device)
        self.held_conv = torch.zeros(rows * held_rows, self.conv_dim, dtype=dtype, device=device)
        self.held_g = torch.zeros(rows * held_rows, self.num_v_heads, device=device)
        self.held_beta = torch.zeros(rows * held_rows, self.num_v_heads, device=device)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.conv_state, self.ssm_state]

    # --------------------------------------------------------------- forward
    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor | PartialSum:
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x)
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        assert meta.state_slots is not None, "a linear-attention layer needs state slots"
        if meta.is_decode_only:
            core = self._decode(mixed, g, beta, positions, meta)
        else:
            core = self._prefill(mixed, g, beta, meta)
        heads = core.reshape(-1, self.head_v_dim)
        out = self.norm(heads, z.reshape(-1, self.head_v_dim)).view(x.shape[0], -1)
        return self.out_proj(out)

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One token per sequence, batched (no host loop: CUDA-graph safe)."""
        return self._decode_fn(mixed, self.conv_state, self.conv1d.weight, g, beta,
                               self.ssm_state, meta.state_slots, positions, self.num_k_heads,
                               self.head_k_dim, self.head_v_dim)

    def _prefill(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Chunks of any lengths: the conv over all of them at once, then the rule (fla's
        kernel where it is installed and the layer runs 16-bit on the GPU, else sequence by
        sequence in torch); each slot's states read where its chunk resumes, written after. The chunks'
        layout is made once per step (``PrefillLayout``); a prefill CUDA graph's padding rows
        neither decay nor write the state (g = 0, beta = 0)."""
        # fla-core's kernel for 16-bit layers only: its float32 dots are TF32 (use_triton_kernels)
        fla = self._chunk_rule is not None and mixed.dtype != torch.float32
        layout = meta.once_per_step("gated_deltanet", lambda: PrefillLayout.of(
            meta, self.kernel, self.conv_state.shape[0], fla, self.held_rows))
        rows, resumes, written = layout.rows, layout.resumes, layout.written
        if layout.real is not None:
            g, beta = g * layout.real, beta * layout.real
        if layout.short:
            return self._short_chunks(mixed, g, beta, meta, layout)
        conv, conv_final = batched_causal_conv(
            mixed, self.conv_state.index_select(0, rows) * resumes, self.conv1d.weight,
            layout.lens, layout.conv)
        if layout.held_at is not None:  # held chunks: their rows kept, their slots as they were
            self._hold(mixed, conv, g, beta, layout.held_at)
        self.conv_state.index_copy_(0, written, conv_final)
        initial = self.ssm_state.index_select(0, rows) * resumes.unsqueeze(-1)
        if fla:
            out, final = self._fla_rule(conv, g, beta, initial, layout)
        else:
            out, final = self._torch_rule(conv, g, beta, initial, layout.lens)
        self.ssm_state.index_copy_(0, written, final)
        return out

    def _short_chunks(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      meta: AttentionMetadata, layout: "PrefillLayout") -> torch.Tensor:
        """Speculation's short chunks (verification steps): the conv, the held rows kept and
        the new windows in one kernel, then the rule token by token (no 64-token padding)."""
        rows, written, resumes = layout.rows, layout.written, layout.resumes.view(-1)
        conv = self._short_conv_fn(mixed, self.conv_state, self.conv1d.weight, rows, written,
                                   resumes, meta.query_start_loc, layout.real_lens,
                                   layout.held_at, self.held_mixed, self.held_conv)
        if layout.held_at is not None:
            self.held_g.index_copy_(0, layout.held_at, g)
            self.held_beta.index_copy_(0, layout.held_at, beta)
        return self._rows_fn(conv, g, beta, self.ssm_state, rows, written, resumes,
                             meta.query_start_loc, self.num_k_heads, self.head_k_dim,
                             self.head_v_dim)

    def _hold(self, mixed: torch.Tensor, conv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              held_at: torch.Tensor) -> None:
        """Keep the held tokens' conv inputs and outputs, decays and write strengths at their
        held rows (``PrefillLayout.held_at``; a token not held: the scratch row's last)."""
        assert self.held_rows, "held rows were not allocated"
        for buffer, rows_of_step in ((self.held_mixed, mixed), (self.held_conv, conv),
                                     (self.held_g, g), (self.held_beta, beta)):
            buffer.index_copy_(0, held_at, rows_of_step.to(buffer.dtype))

    def commit_held(self, slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor
                    ) -> None:
        """Apply each slot's first ``count`` held rows to its state (``starts``: the held
        chunk's first position; at 0 the state starts from zero); int32 [N] each."""
        self._commit_fn(self.held_mixed, self.held_conv, self.held_g, self.held_beta,
                        self.conv_state, self.ssm_state, slots, starts, counts, self.held_rows,
                        self.num_k_heads, self.head_k_dim, self.head_v_dim)

    def _torch_rule(self, conv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = split_heads(conv, self.num_k_heads, self.num_v_heads, self.head_k_dim,
                               self.head_v_dim)
        out = v.new_empty(v.shape)
        final = torch.empty_like(initial)
        start = 0
        for i, n in enumerate(lens):
            end = start + n
            out[start:end], final[i] = chunked_gated_delta(q[start:end], k[start:end],
                                                           v[start:end], g[start:end],
                                                           beta[start:end], initial[i])
            start = end
        return out.to(conv.dtype), final

    def _fla_rule(self, conv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial: torch.Tensor, layout: "PrefillLayout"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        # no offsets (a CUDA graph's layout): the step's rows are one chunk (a prefill graph's)
        assert layout.cu_seqlens is not None or len(layout.lens) == 1, \
            "fla-core's rule over a graph layout of several chunks"
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = conv.split([key_dim, key_dim, conv.shape[1] - 2 * key_dim], -1)
        out, final = self._chunk_rule(
            q.reshape(1, -1, self.num_k_heads, self.head_k_dim),
            k.reshape(1, -1, self.num_k_heads, self.head_k_dim),
            v.reshape(1, -1, self.num_v_heads, self.head_v_dim), g=g.unsqueeze(0),
            beta=beta.unsqueeze(0), initial_state=initial, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=layout.cu_seqlens,
            cu_seqlens_cpu=layout.cu_seqlens_cpu, chunk_indices=layout.chunk_indices)
        return out[0], final


class PrefillLayout(NamedTuple):
    """A prefill step's chunks as every linear-attention layer of the step reads them, made
    once (``AttentionMetadata.once_per_step``) with no device sync: their lengths, each
    chunk's state row, whether it resumes a state, the conv buffer's layout, and the varlen
    arguments of fla-core's kernel (int64 offsets on the device and the host, and its 64-token
    chunk indices). In a CUDA graph (a prefill graph's one sequence, or a verification graph's
    sequences, each padded to the graph's query length; no host lists) everything is built on
    the device, ``real`` marks the token rows, and fla-core runs a prefill graph's chunk as a
    batch of one. A step of speculation's short chunks (``short``: every chunk at most the
    held rows) takes the short path, which needs neither the conv buffer's layout nor
    fla-core's arguments."""

    lens: list[int]
    rows: torch.Tensor  # [N] long: each chunk's state row (-1 slots: the scratch row)
    resumes: torch.Tensor  # [N, 1, 1] bool: the chunk starts past position 0
    conv: ConvIndex | None  # None on the short path
    real: torch.Tensor | None = None  # [T, 1]: 1 on tokens, 0 on padding (a graph's)
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    chunk_indices: torch.Tensor | None = None
    real_lens: torch.Tensor | None = None  # [N]: each chunk's tokens (before a graph's padding)
    written: torch.Tensor | None = None  # [N] long: each chunk's row for its final state
    held_at: torch.Tensor | None = None  # [T] long: each token's held row (held chunks only)
    short: bool = False  # every chunk at most the held rows: GatedDeltaNet._short_chunks

    @classmethod
    def of(cls, meta: AttentionMetadata, kernel: int, state_rows: int, fla: bool,
           held_rows: int = 0) -> "PrefillLayout":
        """The layout, and where the step holds chunks (``state_held_at``): each token's row
        in the held buffers of ``held_rows`` rows a state row (-1: the last) and each chunk's
        row for its final state (a held chunk's: the scratch row)."""
        short = bool(held_rows) and meta.max_query_len <= held_rows
        layout = cls._chunks(meta, kernel, state_rows, fla and not short, short)
        if meta.state_held_at is None:
            return layout._replace(written=layout.rows)
        held = meta.state_held_at[meta.query_start_loc[:-1].long()] >= 0
        return layout._replace(written=torch.where(held, state_rows - 1, layout.rows),
                               held_at=meta.state_held_at.long() % (state_rows * held_rows))

    @classmethod
    def _chunks(cls, meta: AttentionMetadata, kernel: int, state_rows: int, fla: bool,
                short: bool) -> "PrefillLayout":
        assert meta.state_slots is not None
        rows = meta.state_slots.long() % state_rows  # -1: the scratch row
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        resumes = (meta.seq_lens > query_lens).view(-1, 1, 1)
        if meta.padded_rows or not meta.query_lens_cpu:  # a CUDA graph's padded sequences
            length, real, num = meta.max_query_len, meta.real_tokens(), rows.shape[0]
            padding = length - real.view(num, length).sum(1)
            conv = None if short else padded_conv_index(length, kernel, padding)
            return cls([length] * num, rows, resumes, conv, real.unsqueeze(-1).float(),
                       real_lens=length - padding, short=short)
        lens, device = meta.query_lens_cpu, meta.query_start_loc.device
        conv = None if short else conv_index(lens, kernel, device)
        layout = cls(lens, rows, resumes, conv, real_lens=query_lens, short=short)
        if not fla:
            return layout
        from fla.ops.utils.index import prepare_chunk_indices  # noqa: PLC0415

        cu_cpu = torch.tensor([0, *lens], dtype=torch.long).cumsum(0)
        cu = cu_cpu.to(device)
        return layout._replace(cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                               chunk_indices=prepare_chunk_indices(cu, CHUNK, cu_seqlens_cpu=cu_cpu))
