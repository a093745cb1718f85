"""The fused MoE kernel against a per-expert loop (CUDA only), at Qwen3-30B-A3B's MoE layer
(128 experts, top-8, hidden 2048, expert width 768, bf16) and a range of batch sizes.

Both compute the same layer from the same routing (random router logits, softmax, top-8,
renormalised): ``fused`` is ``kernels.fused_moe``; ``loop`` is ``nvray.layers.moe.moe_experts_ref``
(one expert at a time: gather its tokens, two GEMMs, scatter-add), what the layer ran before the
kernel. GPU time per call is the median of CUDA-event-timed calls after warm-up (the loop's
host syncs included: it needs each expert's token count on the host). Also reported: the bytes
the fused call must read (the experts its tokens pick, ``experts_touched``) over its time.

Run ``python -m nvray.bench.fused_moe`` (prints JSON lines).
"""

from __future__ import annotations

import json
import statistics

import torch

E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def _median_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench(batches=(1, 16, 64, 256, 1024, 4096)) -> list[dict]:
    from kernels import fused_moe
    from nvray.bench.floor import experts_touched
    from nvray.layers.moe import moe_experts_ref, route

    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, HIDDEN, device=dev, dtype=dtype, generator=gen) * 0.02
    w2 = torch.randn(E, HIDDEN, INTER, device=dev, dtype=dtype, generator=gen) * 0.02
    rows = []
    for batch in batches:
        x = torch.randn(batch, HIDDEN, device=dev, dtype=dtype, generator=gen)
        logits = torch.randn(batch, E, device=dev, generator=gen)
        weights, ids = route(logits, TOP_K, True, dtype)
        fused = _median_ms(lambda: fused_moe(x, w13, w2, weights.float(), ids))
        loop = _median_ms(lambda: moe_experts_ref(x, w13, w2, weights, ids))
        diff = (fused_moe(x, w13, w2, weights.float(), ids).float()
                - moe_experts_ref(x, w13, w2, weights, ids).float()).abs().max().item()
        read = experts_touched(E, TOP_K, batch) * 3 * HIDDEN * INTER * 2
        rows.append({"batch": batch, "fused_ms": round(fused, 3), "loop_ms": round(loop, 3),
                     "speedup": round(loop / fused, 2),
                     "fused_weight_gb_per_s": round(read / fused / 1e6, 1),
                     "max_abs_diff": diff})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    bench()
