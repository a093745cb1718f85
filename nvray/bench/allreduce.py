"""``python -m nvray.bench allreduce``: the tensor-parallel all-reduce at decode and prefill
sizes: NCCL against the P2P one-shot and two-shot over symmetric memory
(``nvray/layers/p2p_allreduce.py``), as the engine runs them (staged through the shared buffer
and copied back). One process per GPU, bf16 ``[rows, hidden]`` messages; each method is
captured in a CUDA graph of ``calls`` all-reduces, and a call's time is a replay's median
(of ``replays``) over ``calls``. Each size also checks the P2P sums against NCCL's on the
same input (``max_abs_diff``). ``nccl_norm`` / ``fused_norm``: the all-reduce followed by the
residual add and RMSNorm the decoder runs after it (``kernels.rms_norm``), against the P2P
all-reduce fused into the norm's kernel (``P2pAllReduce.reduce_add_norm``), with the difference
of their outputs. Run on a machine with two or more GPUs.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
from typing import Any, Callable

from nvray.bench.cli_args import sizes

ROWS = (1, 32, 256, 1024, 2048, 8192)


def bench_allreduce(world_size: int | None = None, hidden: int = 4096,
                    rows: tuple[int, ...] = ROWS, calls: int = 20,
                    replays: int = 10) -> dict[str, Any]:
    import torch  # noqa: PLC0415
    import torch.multiprocessing as mp  # noqa: PLC0415

    world = world_size or torch.cuda.device_count()
    if world < 2:
        raise SystemExit("allreduce: needs two or more GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(_rank, args=(world, _free_port(), hidden, rows, calls, replays, out),
                 nprocs=world)
        with open(out) as f:
            results = json.load(f)
    return {"benchmark": "allreduce", "world_size": world, "hidden": hidden, "dtype": "bfloat16",
            "device": torch.cuda.get_device_name(), "rows": results}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, hidden: int, rows: tuple[int, ...], calls: int,
          replays: int, out: str) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from nvray.layers.p2p_allreduce import create_p2p_all_reduce  # noqa: PLC0415

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    try:
        max_bytes = max(rows) * hidden * 2 + (1 << 20)
        p2p = create_p2p_all_reduce(torch.bfloat16, device, max_bytes)
        gen = torch.Generator(device).manual_seed(rank)
        results = []
        for n in rows:
            x = torch.randn(n, hidden, dtype=torch.bfloat16, device=device, generator=gen)
            row: dict[str, Any] = {"rows": n, "bytes": x.numel() * 2}
            methods: dict[str, Callable[[torch.Tensor], Any]] = {"nccl": dist.all_reduce}
            if p2p is not None and p2p.fits(x, any_size=True):
                methods["one_shot"] = lambda t: p2p(t, "one_shot")
                methods["two_shot"] = lambda t: p2p(t, "two_shot")
                row["engine_path"] = p2p.path_for(x)
            for name, fn in methods.items():
                row[f"{name}_us"] = round(_graph_us(fn, x.clone(), calls, replays), 1)
            ref = x.clone()
            dist.all_reduce(ref)
            for name in ("one_shot", "two_shot"):
                if name in methods:
                    got = x.clone()
                    methods[name](got)
                    row[f"{name}_max_abs_diff"] = (got.float() - ref.float()).abs().max().item()
            if p2p is not None and p2p.fits_fused(x, any_size=True):
                row.update(_norm_rows(p2p, x, calls, replays))
            results.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _norm_rows(p2p: Any, x: Any, calls: int, replays: int) -> dict[str, Any]:
    """The all-reduce then the add + RMSNorm, unfused (NCCL) and fused (P2P): times and the
    largest difference of the normed outputs and of the new residuals."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import kernels  # noqa: PLC0415

    hidden = x.shape[1]
    gen = torch.Generator(x.device).manual_seed(7)  # the same residual and weight on every rank
    residual = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=gen)
    weight = 1 + 0.5 * torch.randn(hidden, dtype=x.dtype, device=x.device, generator=gen)

    def unfused(t: Any) -> Any:
        dist.all_reduce(t)
        return kernels.rms_norm(t, weight, 1e-6, residual)

    def fused(t: Any) -> Any:
        return p2p.reduce_add_norm(t, residual, weight, 1e-6)

    row = {"nccl_norm_us": round(_graph_us(unfused, x.clone(), calls, replays), 1),
           "fused_norm_us": round(_graph_us(fused, x.clone(), calls, replays,
                                            after=p2p.end_forward), 1)}
    want, got = unfused(x.clone()), fused(x.clone())
    p2p.end_forward()
    row["fused_norm_max_abs_diff"] = max((g.float() - w.float()).abs().max().item()
                                         for g, w in zip(got, want))
    return row


def _graph_us(fn: Callable[[Any], Any], x: Any, calls: int, replays: int,
              after: Callable[[], Any] = lambda: None) -> float:
    """Microseconds per call of ``fn(x)``, ``calls`` of them captured in one CUDA graph
    (then ``after()``, as a model's forward ends)."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
        after()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
        after()
    dist.barrier()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def add_arguments(p: Any) -> None:
    p.add_argument("--world-size", type=int, default=None, help="GPUs (default: all)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))


def run(args: Any) -> dict[str, Any]:
    return bench_allreduce(args.world_size, args.hidden, sizes(args.rows, "--rows"))
