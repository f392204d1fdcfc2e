"""TP collectives measured over NCCL: all-reduce of activations, all-gather of logits.

What the projection (``benchmarks/projection.py``) otherwise estimates: DeepSeek-V3 at TP N runs two
all-reduces of the ``[rows, 7168]`` bf16 hidden state per layer (rows = bs * q_len) and one
all-gather of the sampled rows' logits (``[rows, 129280 / N]`` bf16 per rank). This benchmark
starts N ranks with :func:`mla_spec.runtime.launch.launch` (NCCL, one GPU each) and times
:func:`~mla_spec.distributed.tp_all_reduce` / :func:`~mla_spec.distributed.tp_all_gather`:

- eager: ``--inner`` back-to-back calls after a barrier, per call (host launch cost included);
- graph: ``--graph-iters`` calls captured in one CUDA graph, a few replays back to back, per
  call (what a served forward pays inside its graphs).

Each rank first checks the all-reduce and all-gather results against the host (integer-valued
data: exact in bf16). Per size: median over ``--repeats``, then the max over ranks. The table
puts the projection's estimate (``allreduce_us`` / ``allgather_us`` on ``NVLINK4_H200``) beside
the measurement; its JSON (``$OUT/bench_allreduce.json``, ``--json PATH``) is what
``projection.load_measured_link`` and ``bench_layer.py --allreduce-json`` read.

    python benchmarks/bench_allreduce.py                    # every visible GPU
    python benchmarks/bench_allreduce.py --world 2
    python benchmarks/bench_allreduce.py --device cpu --world 2   # gloo smoke test, no graphs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import projection as proj  # noqa: E402  (benchmarks/projection.py)

HIDDEN = 7168
VOCAB = 129280
AR_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
AG_ROWS = (1, 4, 32, 128)
SMOKE_AR_ROWS = (1, 4, 16)
SMOKE_AG_ROWS = (1, 4)


def _rank_data(rank: int, shape, dtype) -> torch.Tensor:
    """Small integers (exact in bf16 and in any summation order), the same on every host."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def _check(rank, world, device, dtype) -> None:
    """tp_all_reduce / tp_all_gather equal the sum / concatenation computed on the host."""
    from mla_spec.distributed import tp_all_gather, tp_all_reduce

    for shape in ((3, HIDDEN), (5, 129)):
        x = _rank_data(rank, shape, dtype).to(device)
        want = sum(_rank_data(r, shape, torch.float32) for r in range(world)).to(dtype)
        got = tp_all_reduce(x.clone(), world).cpu()
        if not torch.equal(got, want):
            raise AssertionError(f"rank {rank}: all-reduce {tuple(shape)} {dtype} is wrong")
        got = tp_all_gather(x, world).cpu()
        want = torch.cat([_rank_data(r, shape, dtype) for r in range(world)], dim=-1)
        if not torch.equal(got, want):
            raise AssertionError(f"rank {rank}: all-gather {tuple(shape)} {dtype} is wrong")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_us(call, device, repeats: int, n: int, per: int) -> float:
    """Median over ``repeats`` of (µs for ``n`` calls of ``call``) / ``per``, every repeat
    starting together on all ranks (a barrier between two device syncs)."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e6 / per)
    return statistics.median(times)


def _eager_us(fn, device, inner: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    return _timed_us(fn, device, repeats, inner, inner)


def _graph_us(fn, device, iters: int, repeats: int, replays: int = 5):
    """Per-call time inside a replayed CUDA graph of ``iters`` calls; ``(us or None, error)``.
    Every rank agrees whether its capture worked before any replay (a rank replaying alone
    would wait forever for its peers)."""
    import torch.distributed as dist

    err = None
    graph = torch.cuda.CUDAGraph()
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
        torch.cuda.current_stream(device).wait_stream(stream)
        _sync(device)
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    except Exception as e:  # noqa: BLE001 - reported in the table
        err = f"{type(e).__name__}: {e}"[:200]
    ok = torch.tensor([0.0 if err else 1.0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() < 1.0:
        return None, err or "capture failed on another rank"
    graph.replay()  # warm-up replay
    us = _timed_us(graph.replay, device, repeats, replays, replays * iters)
    del graph
    return us, None


def _rank_bench(rank, world, ar_rows, ag_rows, inner, repeats, graph_iters, graphs) -> dict:
    import torch.distributed as dist

    from mla_spec.distributed import rank_device, tp_all_gather, tp_all_reduce

    device = rank_device(rank, dist.get_backend())
    for dtype in (torch.bfloat16, torch.float32):
        _check(rank, world, device, dtype)
    out = {"allreduce": [], "allgather": []}
    shard = VOCAB // world
    for kind, rows_list in (("allreduce", ar_rows), ("allgather", ag_rows)):
        for rows in rows_list:
            if kind == "allreduce":
                x = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device=device)
                fn = lambda x=x: tp_all_reduce(x, world)  # noqa: E731
            else:
                x = torch.zeros(rows, shard, dtype=torch.bfloat16, device=device)
                fn = lambda x=x: tp_all_gather(x, world)  # noqa: E731
            eager = _eager_us(fn, device, inner, repeats)
            graph, err = None, None
            if graphs and device.type == "cuda":
                graph, err = _graph_us(fn, device, graph_iters, repeats)
            out[kind].append({"rows": rows, "eager_us": eager, "graph_us": graph,
                              "graph_error": err})
    return out


def _merge(per_rank: list[dict], world: int) -> dict:
    """Max over ranks of each median; bytes and the projection's estimate beside it."""
    shard = VOCAB // world
    res = {}
    for kind in ("allreduce", "allgather"):
        rows_out = []
        for i, r0 in enumerate(per_rank[0][kind]):
            rows = r0["rows"]
            if kind == "allreduce":
                nbytes = rows * HIDDEN * 2
                est = proj.allreduce_us(nbytes, world)
            else:
                nbytes = rows * shard * world * 2  # the gathered result
                est = proj.allgather_us(nbytes, world)
            eager = max(p[kind][i]["eager_us"] for p in per_rank)
            gs = [p[kind][i]["graph_us"] for p in per_rank]
            graph = max(gs) if all(g is not None for g in gs) else None
            errs = [p[kind][i]["graph_error"] for p in per_rank if p[kind][i]["graph_error"]]
            best = graph if graph is not None else eager
            rows_out.append({"rows": rows, "bytes": nbytes, "eager_us": eager, "graph_us": graph,
                             "estimate_us": est, "ratio": best / est if est else None,
                             "graph_error": errs[0] if errs else None})
        res[kind] = rows_out
    return res


def format_table(res: dict, world: int) -> str:
    lines = []
    for kind, shape in (("allreduce", f"[rows, {HIDDEN}] bf16"),
                        ("allgather", f"[rows, {VOCAB // world}] bf16 per rank")):
        lines.append(f"{kind} over {world} ranks, {shape}; estimate = benchmarks/projection.py "
                     f"on {proj.NVLINK4_H200.name}; ratio = measured (graph, else eager) / est.")
        lines.append(f"{'rows':>5} {'bytes':>10} {'eager us':>9} {'graph us':>9} "
                     f"{'estimate us':>11} {'ratio':>6}")
        for r in res[kind]:
            g = f"{r['graph_us']:9.2f}" if r["graph_us"] is not None else f"{'-':>9}"
            ratio = f"{r['ratio']:6.2f}" if r["ratio"] is not None else f"{'-':>6}"
            lines.append(f"{r['rows']:>5} {r['bytes']:>10} {r['eager_us']:9.2f} {g} "
                         f"{r['estimate_us']:11.2f} {ratio}")
        errs = {r["graph_error"] for r in res[kind] if r["graph_error"]}
        lines += [f"  graph: {e}" for e in sorted(errs)]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, choices=("cuda", "cpu"),
                   help="cuda (NCCL, default when GPUs are visible) or cpu (gloo smoke test)")
    p.add_argument("--world", type=int, default=None,
                   help="ranks (default: every visible GPU; 2 on CPU)")
    p.add_argument("--ar-rows", default=None, help="comma list of all-reduce rows")
    p.add_argument("--ag-rows", default=None, help="comma list of all-gather rows")
    p.add_argument("--inner", type=int, default=20, help="eager calls per timing")
    p.add_argument("--repeats", type=int, default=10, help="timings per size (median)")
    p.add_argument("--graph-iters", type=int, default=20, help="collectives per CUDA graph")
    p.add_argument("--no-graphs", action="store_true", help="eager only")
    p.add_argument("--run-timeout-s", type=float, default=240.0,
                   help="end the run (RankFailedError) if the ranks take longer")
    p.add_argument("--json", default=None, help="also write the JSON here")
    return p.parse_args(argv)


def _ints(s, default):
    return tuple(int(v) for v in s.split(",")) if s else default


def main(argv=None) -> dict:
    from mla_spec.runtime.launch import launch

    a = parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        n = torch.cuda.device_count()
        world = a.world or n
        if world < 2 or world > n:
            raise SystemExit(f"--world {world}: needs 2..{n} GPUs ({n} visible)")
        backend, graphs = "nccl", not a.no_graphs
        ar_rows, ag_rows = _ints(a.ar_rows, AR_ROWS), _ints(a.ag_rows, AG_ROWS)
    else:
        world = a.world or 2
        if world < 2:
            raise SystemExit(f"--world {world}: needs >= 2 ranks")
        backend, graphs = "gloo", False
        ar_rows, ag_rows = _ints(a.ar_rows, SMOKE_AR_ROWS), _ints(a.ag_rows, SMOKE_AG_ROWS)
        a.inner, a.repeats = min(a.inner, 4), min(a.repeats, 3)
    t0 = time.perf_counter()
    per_rank = launch(_rank_bench, world, backend=backend, run_timeout_s=a.run_timeout_s,
                      args=(ar_rows, ag_rows, a.inner, a.repeats, a.graph_iters, graphs))
    res = _merge(per_rank, world)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    res["meta"] = {"world": world, "device": name, "backend": backend, "graphs": graphs,
                   "torch": torch.__version__, "inner": a.inner, "repeats": a.repeats,
                   "graph_iters": a.graph_iters, "hidden": HIDDEN, "vocab": VOCAB,
                   "nccl": ".".join(map(str, torch.cuda.nccl.version()))
                   if device == "cuda" else None,
                   "env": {k: os.environ.get(k) for k in
                           ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                            "NVSHMEM_DISABLE_NVLS")},
                   "seconds": time.perf_counter() - t0,
                   "command": " ".join(["python benchmarks/bench_allreduce.py",
                                        *(argv if argv is not None else sys.argv[1:])])}
    text = format_table(res, world)
    print(f"bench_allreduce: {name} x{world}, {backend}, torch {torch.__version__}, "
          f"{'CUDA graphs + eager' if graphs else 'eager only'}; median of {a.repeats}, max "
          f"over ranks ({res['meta']['seconds']:.1f} s)\n")
    print(text)
    blob = json.dumps(res, indent=1)
    paths = [Path(a.json)] if a.json else []
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / "bench_allreduce.json")
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(blob)
        print(f"wrote {p}")
    return res


if __name__ == "__main__":
    main()
