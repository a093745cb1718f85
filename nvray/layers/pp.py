"""Pipeline-parallel stage facts and the activations sent between stages.

With ``pipeline_parallel_size=P`` the engine's ranks form P stages of ``tensor_parallel_size``
ranks each: global rank r is tensor-parallel rank ``r % tp`` of stage ``r // tp``. A stage holds
a contiguous run of the decoder's layers (``stage_layers``: as even as the layer count allows,
the earlier stages taking one more where it does not divide), the first stage the embeddings,
the last the final norm and the LM head; the last stage's first rank samples. Between stages
each rank sends its hidden states and residual, as one ``[tokens, 2, hidden]`` tensor, to the
rank of the same tensor-parallel index in the next stage (``send_to_next`` /
``recv_from_prev``: point-to-point over the engine's process group, NCCL on the GPU, gloo on
the CPU). ``set_pipeline`` is called by the runtime before the model is built; without it there
is one stage. Inside ``tp.collectives_off()`` nothing is sent or received (each rank then
works on its own, as the tensor-parallel collectives do).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nvray.layers.tp import collectives_on

_stage = 0
_num_stages = 1
_stride = 1  # global ranks between a rank and its peer in the next stage (= tensor_parallel_size)


def set_pipeline(stage: int, num_stages: int, tensor_parallel_size: int) -> None:
    global _stage, _num_stages, _stride
    assert 0 <= stage < num_stages, f"stage {stage} of {num_stages}"
    _stage, _num_stages, _stride = stage, num_stages, tensor_parallel_size


def pp_size() -> int:
    return _num_stages


def pp_stage() -> int:
    return _stage


def is_first_stage() -> bool:
    return _stage == 0


def is_last_stage() -> bool:
    return _stage == _num_stages - 1


def stage_layers(num_layers: int, stage: int | None = None, num_stages: int | None = None
                 ) -> range:
    """The layer indices of ``stage`` (this rank's by default) among ``num_layers``."""
    stage = _stage if stage is None else stage
    num_stages = _num_stages if num_stages is None else num_stages
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's "
                         f"{num_layers} layers (each stage needs one at least)")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def send_to_next(x: torch.Tensor) -> None:
    """Send this stage's output ``[tokens, 2, hidden]`` to the next stage (queued on the GPU)."""
    if collectives_on():
        dist.send(x, dst=dist.get_rank() + _stride)


def recv_from_prev(into: torch.Tensor) -> torch.Tensor:
    """Receive the previous stage's output into ``into`` (contiguous); returns it."""
    if collectives_on():
        dist.recv(into, src=dist.get_rank() - _stride)
    return into
