"""Host time of one eager attention call: ours (``mla_decode_paged``, and the triton backend's
``forward`` after ``plan``) vs FlashInfer's ``run`` after ``plan`` (GPU).

    python benchmarks/bench_mla_host.py [--shapes bf16:32x1:4096,...] [--profile]

Per shape: the median host µs from entering the call to its return (launches are asynchronous,
so this is the CPU's cost of the call; the GPU queue never fills at these sizes), and the
``do_bench`` median of the call (what ``bench_mla.py --defaults`` reports as ``eager``).
``--profile``: cProfile's top functions over 300 calls of ours at the first shape.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_mla import PAGE, SM_SCALE, fi_wrapper  # noqa: E402
from bench_mla_breakdown import default_setup, parse_shapes  # noqa: E402

from mla_spec.kernels.mla import mla_decode_paged  # noqa: E402

SHAPES = ("bf16:32x1:4096,fp8:32x1:4096,bf16:32x1:4096:32,fp8:32x1:4096:32,bf16:32x4:4096,"
          "fp8:128x1:4096,bf16:128x4:4096,fp8:32x1:8192:128")


def host_us(fn, n: int = 300) -> float:
    """Median µs of the host part of ``fn()`` (no sync inside the timed region)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return sorted(ts)[n // 2] * 1e6


def _calls(kvd, h, q, ctx, bs, batch, flat, cfg, sp, dev) -> dict:
    """The timed calls of one shape: the entry point (planned arguments / defaults), the triton
    backend's ``forward`` after ``plan`` (what a model layer calls) and FlashInfer's ``run``."""
    from mla_spec.attention import create_backend
    from mla_spec.forward_batch import ForwardBatch

    pool, r2t, rpis, kv_lens, qn, qp, perm = batch
    rows = rpis[0].tolist()
    fb = (ForwardBatch.decode([ctx] * bs, req_pool_indices=rows, device=dev) if q == 1 else
          ForwardBatch.target_verify([ctx - q] * bs, q, req_pool_indices=rows, device=dev))
    backend = create_backend("triton", num_heads=h, softmax_scale=SM_SCALE, kv_pool=pool,
                             req_to_token=r2t)
    backend.plan(fb)
    _, fi = fi_wrapper(pool, perm[:bs], bs, q, h, ctx, dev, kvd)
    return {
        "ours (planned)": lambda: mla_decode_paged(
            qn, qp, flat, r2t, rpis[0], kv_lens, SM_SCALE, page_size=PAGE, q_len=q,
            num_splits=sp, config=cfg, max_kv=ctx),
        "ours (defaults)": lambda: mla_decode_paged(
            qn, qp, flat, r2t, rpis[0], kv_lens, SM_SCALE, page_size=PAGE, q_len=q),
        "backend forward": lambda: backend.forward(qn, qp, 0, fb),
        "flashinfer": lambda: fi(qn, qp),
    }


def rows(shapes, profile: bool):
    from triton.testing import do_bench

    dev = torch.device("cuda")
    out_rows = []
    for k, (kvd, h, q, ctx, bs) in enumerate(shapes):
        _, _, batch, flat, cfg, sp = default_setup(kvd, h, q, ctx, bs, dev)
        calls = _calls(kvd, h, q, ctx, bs, batch, flat, cfg, sp, dev)
        row = {"shape": f"{'fp8' if kvd != torch.bfloat16 else 'bf16'} {h}x{q} {ctx} bs{bs}"}
        for name, fn in calls.items():
            row[f"{name} host"] = host_us(fn)
            row[f"{name} eager"] = do_bench(fn, warmup=10, rep=40) * 1e3
        print(row, flush=True)
        out_rows.append(row)
        if profile and k == 0:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                calls["ours (planned)"]()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        del batch, calls
        torch.cuda.empty_cache()
    return out_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rs = rows(parse_shapes(args.shapes), args.profile)
    cols = list(rs[0])
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rs:
        print("| " + " | ".join(r[c] if isinstance(r[c], str) else f"{r[c]:.1f}" for c in cols)
              + " |")


if __name__ == "__main__":
    main()
