"""ModelRunner: one tensor-parallel rank — model shard, paged KV cache, step execution.

Lifecycle: build and load the model; ``num_kvcache_blocks()`` says how many blocks fit this
rank's memory budget (the control plane takes the minimum over ranks); ``allocate_kv_cache(n)``
creates the cache; then ``execute(step)`` runs one scheduled batch and, on rank 0, returns the
sampled token ids (other ranks return []).
"""

from __future__ import annotations

from typing import Any

import torch

from nvray.config import EngineConfig
from nvray.engine.step_input import StepInput
from nvray.layers.attention import AttentionMetadata, select_backend
from nvray.layers.tp import tp_rank
from nvray.loader import load_model
from nvray.models import model_class_for
from nvray.worker.sampler import sample

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is visible")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """'auto': the checkpoint's dtype, except fp32 runs as bf16 on GPU and 16-bit as fp32 on CPU."""
    if name != "auto":
        return _DTYPES[name]
    ckpt = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or torch.float32
    ckpt = _DTYPES.get(ckpt, torch.float32) if isinstance(ckpt, str) else ckpt
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


def load_hf_config(model_path: str) -> Any:
    from transformers import AutoConfig  # noqa: PLC0415

    return AutoConfig.from_pretrained(model_path)


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    limit = hf_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                         f"max_position_embeddings={limit}")
    return config.max_model_len


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.hf_config = load_hf_config(model_path)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.block_size = config.kvcache_block_size
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.model = self._build_model(model_path)
        self.attention_layers = self.model.attention_layers()
        backend = select_backend(config.attention_backend, self.device)
        for layer in self.attention_layers:
            layer.backend = backend
        self.num_blocks = 0

    def _build_model(self, model_path: str) -> torch.nn.Module:
        torch.manual_seed(self.config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class_for(self.hf_config)(self.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_model(model, model_path)
        return model.eval()

    # ----------------------------------------------------------------- KV cache
    @property
    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_token = 2 * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize
        return len(self.attention_layers) * self.block_size * per_token

    def num_kvcache_blocks(self) -> int:
        """How many KV blocks this rank can hold (before the minimum over ranks)."""
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        if self.device.type == "cpu":
            budget = int(self.config.cpu_kvcache_space_gib * 2**30)
        else:
            budget = self._gpu_kv_budget()
        num_blocks = budget // self.kv_block_bytes
        needed = -(-self.max_model_len // self.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"KV cache too small: {budget / 2**30:.2f} GiB holds {num_blocks} blocks of "
                f"{self.block_size} tokens, but one max_model_len={self.max_model_len} sequence "
                f"needs {needed}; raise gpu_memory_utilization/cpu_kvcache_space_gib or lower "
                "max_model_len")
        return num_blocks

    def _gpu_kv_budget(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        torch.cuda.synchronize(self.device)
        used_by_engine = torch.cuda.memory_reserved(self.device)
        used_by_others = total - free - used_by_engine
        return int(total * self.config.gpu_memory_utilization) - used_by_others - used_by_engine

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        for layer in self.attention_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # -------------------------------------------------------------------- step
    def prepare_inputs(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens = [], []
        for s in step.seqs:
            n, start, table = len(s.token_ids), s.start_pos, s.block_table
            input_ids.extend(s.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
        max_blocks = max(len(s.block_table) for s in step.seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in step.seqs]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta

    @torch.inference_mode()
    def forward_logits(self, step: StepInput) -> torch.Tensor | None:
        """Logits [S, V] of the rows to sample (rank 0; None elsewhere)."""
        ids, pos, meta = self.prepare_inputs(step)
        hidden = self.model(ids, pos, meta)
        last = meta.query_start_loc[1:].long() - 1
        rows = [i for i, s in enumerate(step.seqs) if s.sample is not None]
        return self.model.compute_logits(hidden[last[rows]])

    @torch.inference_mode()
    def execute(self, step: StepInput) -> list[int]:
        logits = self.forward_logits(step)
        if tp_rank() != 0 or logits is None or logits.shape[0] == 0:
            return []
        specs = [s.sample for s in step.seqs if s.sample is not None]
        return sample(logits, specs).tolist()  # type: ignore[arg-type]
