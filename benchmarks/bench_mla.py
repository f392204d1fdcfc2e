"""MLA attention over the paged cache: our Triton kernels vs FlashInfer, in the same run (GPU).

    python benchmarks/bench_mla.py [--check] [--sweep] [--table] [--quick]

``--check``: every backend x mode x {bf16, fp8} at DeepSeek dims against the torch oracle, plus
a CUDA-graph replay. ``--sweep``: tile configs / splits / fp8 MMA at a few shapes. ``--table``:
the shapes of h200-measured.md (H 32 / 128, q 1 / 4, bf16 / fp8, (bs, ctx) in (1,4k), (32,4k),
(128,8k), (64,32k)), page size 64, pages in random order: µs, KV GB/s, TFLOP/s, ratio; eager
(``triton.testing.do_bench``, median, L2 flushed) and, at batch 1, inside a replayed CUDA graph
rotating over enough KV copies to defeat the 60 MB L2. Writes JSON / markdown to $OUT if set.
"Ours" here is the generic kernel (``mla_decode``); the paged fast path that the triton backend
uses on Hopper is swept and tabled beside FlashInfer by ``benchmarks/sweep_mla.py``.
``--defaults``: the same grid as the backend runs it on Hopper (``mla_decode_paged`` with the
``paged_choice`` defaults: the Triton, CUDA and wgmma kernels), per call in a replayed CUDA
graph and eagerly, FlashInfer in the same run (``bench_mla_breakdown``'s rows: µs, FI/ours,
TB/s, TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mla_spec.attention import create_backend  # noqa: E402
from mla_spec.attention.synthetic import ALL_MODES, make_scene  # noqa: E402
from mla_spec.attention.trtllm_mla import reference_trtllm_kernel  # noqa: E402
from mla_spec.kernels.mla import MLAKernelConfig, mla_decode, pick_num_splits  # noqa: E402
from mla_spec.quant.fp8 import FP8_DTYPE  # noqa: E402

SM_SCALE = 0.1352338
DV, DPE, PAGE = 512, 64, 64
SHAPES = [(1, 4096), (32, 4096), (128, 8192), (64, 32768)]
CONFIGS = {
    16: [MLAKernelConfig(16, 64, 4, 2), MLAKernelConfig(32, 64, 4, 2)],
    32: [MLAKernelConfig(32, 64, 4, 2), MLAKernelConfig(32, 32, 4, 3)],
    128: [MLAKernelConfig(64, 64, 8, 2), MLAKernelConfig(64, 32, 4, 3)],
}


def _cands(rows):
    return CONFIGS[16 if rows <= 16 else 32 if rows <= 32 else 128]


# ---------------------------------------------------------------------------------------------
def check(dev, heads=(16, 128), prefix=(0, 1, 700, 3000, 63), dims=(DV, DPE), page=PAGE):
    """Backends x modes x dtypes vs the oracle at DeepSeek dims; prints max errors."""
    print("== check: backends x modes x kv dtype vs torch oracle (dims 512/64, page 64)")
    res = []
    for h in heads:
        for kvd in (torch.bfloat16, FP8_DTYPE, torch.float32):
            for mode in ALL_MODES:
                sc = make_scene(mode, list(prefix), [1, 4, 2, 3, 1], num_heads=h,
                                num_draft_tokens=4, kv_dtype=kvd,
                                q_dtype=torch.float32 if kvd == torch.float32 else torch.bfloat16,
                                page_size=page, device=dev, k_scale=0.8, v_scale=0.8, seed=h,
                                kv_lora_rank=dims[0], qk_rope_head_dim=dims[1])
                kw = dict(num_heads=h, softmax_scale=SM_SCALE, kv_pool=sc.pool,
                          req_to_token=sc.req_pool)
                ref = create_backend("torch", **kw).forward(sc.q_nope, sc.q_pe, 0, sc.batch)
                scale = ref.float().abs().max().item() + 1e-6 if ref.numel() else 1.0
                for name, extra in (("triton", {}), ("triton", {"fp8_dot": 1}), ("triton",
                                    {"num_splits": 7}), ("flashinfer", {}),
                                    ("trtllm", {"kernel": reference_trtllm_kernel})):
                    if extra.get("fp8_dot") and kvd != FP8_DTYPE:
                        continue
                    if name == "flashinfer" and dev.type != "cuda":
                        continue
                    try:
                        be = create_backend(name, **kw, **extra)
                        why = be.supports(mode, kvd)
                        if why:
                            continue
                        o = be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
                        err = (o.float() - ref.float()).abs().max().item() if o.numel() else 0.0
                        ok = bool(torch.isfinite(o).all())
                        tag = f"{name}{extra}"[:40]
                        res.append((h, str(kvd)[6:], mode.name, tag, err / scale, ok))
                    except Exception as e:  # report and go on
                        print(f"H={h} {kvd} {mode.name} {name}{extra}: FAIL {type(e).__name__}: "
                              f"{str(e)[:300]}", flush=True)
    summary = {}
    for _h, kd, _mode, tag, err, ok in res:
        k = (kd, tag)
        summary[k] = max(summary.get(k, 0.0), err if ok else float("inf"))
    for (kd, tag), err in sorted(summary.items()):
        print(f"  max rel err {kd:14s} {tag:28s} {err:.2e}", flush=True)
    if dev.type != "cuda":
        return res
    # CUDA graph replay of the triton backend
    sc = make_scene(ALL_MODES[1], [100, 2000], [4, 4], num_heads=32, num_draft_tokens=4,
                    kv_dtype=FP8_DTYPE, q_dtype=torch.bfloat16, page_size=PAGE, device=dev)
    be = create_backend("triton", num_heads=32, softmax_scale=SM_SCALE, kv_pool=sc.pool,
                        req_to_token=sc.req_pool)
    be.plan(sc.batch)
    eager = be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
    torch.cuda.current_stream().wait_stream(s)
    out = torch.empty_like(eager)
    with torch.cuda.graph(g):
        be.forward(sc.q_nope, sc.q_pe, 0, sc.batch, out=out)
    g.replay()
    torch.cuda.synchronize()
    print("graph replay == eager:", torch.equal(out, eager), flush=True)
    return res


# ---------------------------------------------------------------------------------------------
def build(h, q, bs, ctx, kvd, dev, replicas):
    """Pool with ``replicas`` disjoint copies of a (bs, ctx) batch, pages in random order."""
    from mla_spec.kv_cache import MLATokenToKVPool

    ppr = -(-ctx // PAGE)
    num_pages = replicas * bs * ppr
    pool = MLATokenToKVPool(1, num_pages, PAGE, kvd, dev)
    buf = pool.kv_buffer[0]
    for i in range(0, num_pages, 4096):
        j = min(num_pages, i + 4096)
        x = torch.randn((j - i, PAGE, DV + DPE), device=dev)
        buf[i:j] = x.to(kvd) if kvd != FP8_DTYPE else x.clamp(-448, 448).to(kvd)
    perm = torch.randperm(num_pages, device=dev).view(replicas * bs, ppr)
    pos = torch.arange(ctx, device=dev)
    r2t = (perm[:, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)  # [replicas*bs, ctx]
    rpis = [torch.arange(r * bs, (r + 1) * bs, device=dev) for r in range(replicas)]
    kv_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    qn = torch.randn(bs * q, h, DV, device=dev, dtype=torch.bfloat16)
    qp = torch.randn(bs * q, h, DPE, device=dev, dtype=torch.bfloat16)
    return pool, r2t, rpis, kv_lens, qn, qp, perm


def fi_wrapper(pool, perm_rows, bs, q, h, ctx, dev, kvd, graph=False):
    import flashinfer.mla

    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    ppr = perm_rows.shape[1]
    qo = torch.arange(bs + 1, device=dev, dtype=torch.int32) * q
    kv_indptr = torch.arange(bs + 1, device=dev, dtype=torch.int32) * ppr
    kv_indices = perm_rows.reshape(-1).int().contiguous()
    kv_len = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    if graph:
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            ws, use_cuda_graph=True, qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=kv_indices,
            kv_len_arr=kv_len, backend="auto")
    else:
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="auto")
    w.plan(qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=kv_indices,
           kv_len_arr=kv_len, num_heads=h,
           head_dim_ckv=DV, head_dim_kpe=DPE, page_size=PAGE, causal=q > 1, sm_scale=SM_SCALE,
           q_data_type=torch.bfloat16, kv_data_type=kvd)
    kv = pool.kv_buffer[0]
    ckv, kpe = kv[..., :DV], kv[..., DV:]
    kw = {"ckv_scale": 1.0, "kpe_scale": 1.0} if kvd == FP8_DTYPE else {}
    return w, (lambda qn, qp: w.run(qn, qp, ckv, kpe, **kw))


def graph_time(fns, reps=20):
    """µs per call of ``fns`` (a list rotated through) inside one replayed CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(max(1, reps // len(fns))):
            for f in fns:
                f()
    n = max(1, reps // len(fns)) * len(fns)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(times)[len(times) // 2]


def add_rates(row, bs, q, h, ctx, kv_bytes):
    """Add to ``row`` GB/s (KV read once) and TF/s of each of its times (``ours_us``, ``fi_us``,
    ``ours_graph_us``, ``fi_graph_us``) and ``ratio`` = FlashInfer / ours (eager)."""
    flops = 2.0 * bs * q * h * ctx * (DV + DPE + DV)
    for k in ("ours_us", "fi_us", "ours_graph_us", "fi_graph_us"):
        if k in row:
            row[k.replace("_us", "_GBs")] = kv_bytes / row[k] / 1e3
            row[k.replace("_us", "_TFs")] = flops / row[k] / 1e6
    if "ours_us" in row and "fi_us" in row:
        row["ratio"] = row["fi_us"] / row["ours_us"]


def ours_fn(pool, r2t, rpi, kv_lens, qn, qp, q, cfg, splits, fp8_dot, ctx):
    flat = pool.kv_buffer[0].view(-1, DV + DPE)
    return lambda: mla_decode(qn, qp, flat, r2t, rpi, kv_lens, SM_SCALE, q_len=q,
                              num_splits=splits, fp8_dot=fp8_dot, config=cfg, max_kv=ctx)


def measure(h, q, bs, ctx, kvd, dev, cands, graph=False, fi=True, splits_list=(None,)):
    from triton.testing import do_bench

    kv_bytes = bs * ctx * (DV + DPE) * (1 if kvd == FP8_DTYPE else 2)
    reps = max(1, min(64, math.ceil(250e6 / kv_bytes))) if graph else 1
    pool, r2t, rpis, kv_lens, qn, qp, perm = build(h, q, bs, ctx, kvd, dev, reps)
    row = {"kv": str(kvd)[6:], "H": h, "q": q, "bs": bs, "ctx": ctx,
           "kv_mb": kv_bytes / 1e6}
    best = None
    f8 = (0, 1) if kvd == FP8_DTYPE else (0,)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for cfg in cands:
        mb = -(-(h * q) // cfg.block_m)
        for sp in splits_list:
            splits = sp or pick_num_splits(bs, mb, ctx, cfg.block_n, sms)
            for fd in f8:
                try:
                    fn = ours_fn(pool, r2t, rpis[0], kv_lens, qn, qp, q, cfg, splits, fd, ctx)
                    t = do_bench(fn, warmup=10, rep=40)
                except Exception as e:
                    print(f"   cfg {cfg} fp8_dot={fd}: FAIL {type(e).__name__} {str(e)[:200]}")
                    continue
                tag = f"m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}" \
                      f"/sp{splits}/f8{fd}"
                if best is None or t < best[0]:
                    best = (t, tag, cfg, splits, fd)
    if best:
        row["ours_us"] = best[0] * 1e3
        row["ours_cfg"] = best[1]
    if fi:
        try:
            w, run = fi_wrapper(pool, perm[: bs], bs, q, h, ctx, dev, kvd)
            row["fi_us"] = do_bench(lambda: run(qn, qp), warmup=10, rep=40) * 1e3
        except Exception as e:
            print(f"   flashinfer FAIL {type(e).__name__}: {str(e)[:300]}")
    if graph and best:
        fns = [ours_fn(pool, r2t, rpi, kv_lens, qn, qp, q, best[2], best[3], best[4], ctx)
               for rpi in rpis]
        try:
            row["ours_graph_us"] = graph_time(fns)
        except Exception as e:
            print(f"   ours graph FAIL {type(e).__name__}: {str(e)[:300]}")
    if graph and fi:
        try:
            ws = [fi_wrapper(pool, perm[r * bs:(r + 1) * bs], bs, q, h, ctx, dev, kvd, True)
                  for r in range(min(reps, 16))]
            row["fi_graph_us"] = graph_time([(lambda r=r: r(qn, qp)) for _, r in ws])
        except Exception as e:
            print(f"   flashinfer graph FAIL {type(e).__name__}: {str(e)[:300]}")
    add_rates(row, bs, q, h, ctx, kv_bytes)
    del pool
    torch.cuda.empty_cache()
    return row


def fmt(row):
    g = lambda k, f="{:.1f}": f.format(row[k]) if k in row else "-"
    return (f"| {row['kv']} | {row['H']} | {row['q']} | {row['bs']} | {row['ctx']} | "
            f"{g('ours_us')} | {g('fi_us')} | {g('ratio', '{:.2f}')} | {g('ours_GBs', '{:.0f}')} | "
            f"{g('fi_GBs', '{:.0f}')} | {g('ours_TFs', '{:.0f}')} | {g('ours_graph_us')} | "
            f"{g('fi_graph_us')} | {g('ours_graph_GBs', '{:.0f}')} | {row.get('ours_cfg', '-')} |")


HEADER = ("| KV | H | q | bs | ctx | ours µs | FI µs | FI/ours | ours GB/s | FI GB/s | ours TF/s "
          "| ours graph µs | FI graph µs | ours graph GB/s | config |\n" + "|---" * 15 + "|")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one config per row")
    ap.add_argument("--defaults", action="store_true",
                    help="the grid at the backend's defaults, graph and eager")
    args = ap.parse_args()
    if not (args.check or args.sweep or args.table or args.defaults):
        args.table = True
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    out_dir = os.environ.get("OUT")
    results = {}
    if args.check:
        results["check"] = check(dev)
    if args.sweep:
        print("== sweep (eager µs)", flush=True)
        rows = []
        for kvd in (torch.bfloat16, FP8_DTYPE):
            for h, q, bs, ctx in ((32, 1, 1, 32768), (32, 1, 128, 8192), (128, 4, 32, 4096),
                                  (128, 1, 64, 32768)):
                allc = CONFIGS[32] + CONFIGS[128]
                r = measure(h, q, bs, ctx, kvd, dev, allc, fi=False,
                            splits_list=(None, 16, 64) if bs == 1 else (None,))
                print("  ", r, flush=True)
                rows.append(r)
        results["sweep"] = rows
    if args.table:
        print("== table", flush=True)
        print(HEADER, flush=True)
        rows = []
        for h in (32, 128):
            for q in (1, 4):
                for bs, ctx in SHAPES:
                    for kvd in (torch.bfloat16, FP8_DTYPE):
                        c = _cands(h * q)[:1] if args.quick else _cands(h * q)
                        t0 = time.time()
                        r = measure(h, q, bs, ctx, kvd, dev, c, graph=bs == 1)
                        rows.append(r)
                        print(fmt(r), f"({time.time() - t0:.0f}s)", flush=True)
        results["table"] = rows
        if out_dir:
            with open(os.path.join(out_dir, "bench_mla.md"), "w") as f:
                f.write(HEADER + "\n" + "\n".join(fmt(r) for r in rows) + "\n")
    if args.defaults:
        from bench_mla_breakdown import row as default_rows
        from bench_mla_breakdown import table as default_table

        rows = []
        for h in (32, 128):
            for q in (1, 4):
                for bs, ctx in SHAPES:
                    for kvd in (torch.bfloat16, FP8_DTYPE):
                        rows += default_rows(kvd, h, q, ctx, bs, dev, eager=True)
                        print(rows[-1], flush=True)  # as it goes: a cut run keeps its rows
        results["defaults"] = rows
        print("\n== defaults: µs per call in a replayed CUDA graph (full) and eagerly (eager)")
        print(default_table(rows), flush=True)
        if out_dir:
            with open(os.path.join(out_dir, "bench_mla_defaults.md"), "w") as f:
                f.write(default_table(rows) + "\n")
    if out_dir:
        with open(os.path.join(out_dir, "bench_mla.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
