"""Benchmark: draft-extend pad / unpad on the GPU, ours vs an SGLang-style kernel, torch, copy_.

    python benchmarks/bench_pad.py           # H {16,32,128} x bs {1,8,64,512} x max_q {2,4,8}
    python benchmarks/bench_pad.py --quick   # a few shapes (~10 s)
    python benchmarks/bench_pad.py --sweep   # then sweep bytes/program x warps (both variants)
    python benchmarks/bench_pad.py --small-bytes 4194304   # override SMALL_CALL_BYTES

Implementations (all move the same bytes: the real rows, read + written; padded rows untouched):
- ours: ``mla_spec.kernels.pad`` exactly as ``TRTLLMMLABackend.forward`` calls it
  (align="end", fill_padding=False into a reused ``out=`` buffer, validate=False,
  variant="auto": the one-round-trip "small" kernels below ``SMALL_CALL_BYTES``, else
  "large"); the columns ``small`` / ``large`` time both variants forced (graph), so one run
  shows where the threshold belongs. ``ours_nopdl``: the same without programmatic dependent
  launch (``options.PDL``): in a graph of consecutive calls each launch then starts after the
  previous call has finished instead of overlapping its tail.
- sglang-style: written here from the description in ``shared/reference/sglang.md`` §4.6: one
  program per (padded row, 64-head tile, 64-dim tile), masked, contiguous tensors, launched through
  the normal Triton path with its ints specialized.
- torch: index computation (searchsorted) + ``index_copy_`` (pad) / ``index_select`` (unpad).
- copy_: ``dst[:n].copy_(src[:n])`` of the same bytes: the ceiling (in a CUDA graph a memcpy
  node, not a kernel).
- floors of any Triton kernel on this host, through ours' direct launch path: ``tcopy`` = a
  bare flat copy of the same bytes (4 KB per program, no index logic) and ``noop`` = an empty
  one-program kernel. ours - tcopy is what the ragged index logic costs; tcopy - copy_ is what
  being a kernel node costs.

Times: eager = host loop of plain calls / call (Python launch cost included); graph = per call in
a replayed CUDA graph of 20 calls (median of ``triton.testing.do_bench``). Inputs rotate over
several buffer sets so calls >= 32 MB are not L2-resident (60 MB L2). lengths ~ U(1, max_q).
Writes ``bench_pad.json`` / ``bench_pad.md`` into ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from mla_spec.kernels import options
from mla_spec.kernels.launch.triton_launcher import TritonLauncher
from mla_spec.kernels.pad import draft_extend as dep

GRAPH_CALLS = 20


# ---- floors: a bare Triton copy of the same bytes and an empty kernel, same launch path ----------
@triton.jit
def _flat_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _noop_kernel(x_ptr):
    pass


_TCOPY = TritonLauncher(_flat_copy_kernel)
_NOOP = TritonLauncher(_noop_kernel)
_TCOPY_BLOCK = 2048  # bf16 elements: the small variant's 4 KB per program


def tcopy(src, dst):
    n = src.numel()
    key = (src.dtype, src.data_ptr() % 16, dst.data_ptr() % 16, n % 16, n == 1)
    ptrs = (src.data_ptr(), dst.data_ptr())
    _TCOPY(-(-n // _TCOPY_BLOCK), key, (src, dst), ptrs, (n, _TCOPY_BLOCK), 4)


def noop(x):
    _NOOP(1, (), (x,), (x.data_ptr(),), (), 4)


# ---- the SGLang-style peer (per (row, 64-head tile, 64-dim tile) program, masked) --------------
@triton.jit
def _row_start(cu_ptr, b, s, row, num_heads, head_dim, PACKED: tl.constexpr):
    """First element of row ``s`` of request ``b``: packed (``cu[b] + s``) or padded (``row``)."""
    if PACKED:
        start = (tl.load(cu_ptr + b) + s).to(tl.int64) * num_heads * head_dim
    else:
        start = row.to(tl.int64) * num_heads * head_dim
    return start


@triton.jit
def _sgl_style_copy(src_ptr, dst_ptr, seq_lens_ptr, cu_ptr, batch_size, max_q, num_heads,
                    head_dim, BLOCK: tl.constexpr, UNPAD: tl.constexpr):
    # pad: packed row -> padded row b * max_q + s; UNPAD: the other way round
    row = tl.program_id(0)
    b = row // max_q
    s = row % max_q
    if b < batch_size:
        if s < tl.load(seq_lens_ptr + b):
            h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            d = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
            mask = (h[:, None] < num_heads) & (d[None, :] < head_dim)
            tile = h[:, None] * head_dim + d[None, :]
            src_row = _row_start(cu_ptr, b, s, row, num_heads, head_dim, not UNPAD)
            x = tl.load(src_ptr + src_row + tile, mask=mask)
            dst_row = _row_start(cu_ptr, b, s, row, num_heads, head_dim, UNPAD)
            tl.store(dst_ptr + dst_row + tile, x, mask=mask)


def sgl_style_pad(q, seq, cu, padded):
    bs, m, h, d = padded.shape
    _sgl_style_copy[(bs * m, triton.cdiv(h, 64), triton.cdiv(d, 64))](
        q, padded, seq, cu, bs, m, h, d, BLOCK=64, UNPAD=False)


def sgl_style_unpad(raw, seq, cu, out):
    bs, m, h, d = raw.shape
    _sgl_style_copy[(bs * m, triton.cdiv(h, 64), triton.cdiv(d, 64))](
        raw, out, seq, cu, bs, m, h, d, BLOCK=64, UNPAD=True)


# ---- the torch peer ------------------------------------------------------------------------------
def _packed_to_padded_rows(seq, cu, max_q, arange):
    cu64 = cu.to(torch.int64)
    b = torch.searchsorted(cu64[1:].contiguous(), arange, right=True)
    lens = seq.to(torch.int64)[b]
    return b * max_q + (max_q - lens) + (arange - cu64[b])  # align="end"


def torch_pad(q, seq, cu, padded, arange):
    bs, m, h, d = padded.shape
    rows = _packed_to_padded_rows(seq, cu, m, arange)
    padded.view(bs * m, h * d).index_copy_(0, rows, q.view(-1, h * d))


def torch_unpad(raw, seq, cu, out, arange):
    bs, m, h, d = raw.shape
    rows = _packed_to_padded_rows(seq, cu, m, arange)
    torch.index_select(raw.view(bs * m, h * d), 0, rows, out=out.view(-1, h * d))


# ---- timing helpers ------------------------------------------------------------------------------
def _eager_us(fn, n_sets, calls=100, repeats=3):
    for i in range(3):
        fn(i % n_sets)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i % n_sets)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def _graph_us(fn, n_sets):
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            fn(i % n_sets)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median")
    del graph
    return ms * 1e3 / GRAPH_CALLS


def _make_sets(op, h, bs, max_q, lens, n_sets):
    d = 576 if op == "pad" else 512
    total = sum(lens)
    sets = []
    for _ in range(n_sets):
        s = {"arange": torch.arange(total, device="cuda")}
        if op == "pad":
            s["src"] = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
            s["dst"] = torch.zeros(bs, max_q, h, d, device="cuda", dtype=torch.bfloat16)
        else:
            s["src"] = torch.randn(bs, max_q, h, d, device="cuda", dtype=torch.bfloat16)
            s["dst"] = torch.zeros(total, h, d, device="cuda", dtype=torch.bfloat16)
        s["flat"] = torch.empty(total * h * d, device="cuda", dtype=torch.bfloat16)
        sets.append(s)
    return sets, total * h * d


def _ours(op, sets, seq, cu, max_q, total, variant):
    if op == "pad":
        return lambda i: dep.pad_draft_extend_query(
            sets[i]["src"], seq, cu, max_q, out=sets[i]["dst"], fill_padding=False,
            validate=False, variant=variant)
    return lambda i: dep.unpad_draft_extend_output(
        sets[i]["src"], seq, cu, total, out=sets[i]["dst"], validate=False, variant=variant)


def _without_pdl(fn):
    """``fn`` launched without programmatic dependent launch (in a graph: at capture)."""
    def run(i):
        old, options.PDL = options.PDL, False
        try:
            return fn(i)
        finally:
            options.PDL = old
    return run


def _impls(op, sets, seq, cu, max_q, total):
    ours = _ours(op, sets, seq, cu, max_q, total, "auto")
    if op == "pad":
        sgl = lambda i: sgl_style_pad(sets[i]["src"], seq, cu, sets[i]["dst"])
        tch = lambda i: torch_pad(sets[i]["src"], seq, cu, sets[i]["dst"], sets[i]["arange"])
    else:
        sgl = lambda i: sgl_style_unpad(sets[i]["src"], seq, cu, sets[i]["dst"])
        tch = lambda i: torch_unpad(sets[i]["src"], seq, cu, sets[i]["dst"], sets[i]["arange"])
    n_el = sets[0]["flat"].numel()
    src_flat = [s["src"].view(-1)[:n_el] for s in sets]
    copy = lambda i: sets[i]["flat"].copy_(src_flat[i])
    bare = lambda i: tcopy(src_flat[i], sets[i]["flat"])
    empty = lambda i: noop(sets[i]["flat"])
    return {"ours": ours, "ours_nopdl": _without_pdl(ours), "sglang": sgl, "torch": tch,
            "copy_": copy, "tcopy": bare, "noop": empty,
            "small": _ours(op, sets, seq, cu, max_q, total, "small"),
            "large": _ours(op, sets, seq, cu, max_q, total, "large")}


def _check_against_sgl(op, sets, seq, cu, max_q, total, lens):
    """ours (align start, both variants) == sglang-style on the real rows; ours (end) == twin."""
    s = sets[0]
    for variant in ("small", "large"):
        if op == "pad":
            a = s["dst"].clone().zero_()
            sgl_style_pad(s["src"], seq, cu, a)
            b = dep.pad_draft_extend_query(s["src"], seq, cu, max_q, align="start",
                                           variant=variant)
            real = torch.arange(max_q, device="cuda")[None, :] < seq[:, None]
            assert torch.equal(a[real], b[real]), f"pad: ours(start, {variant}) != sglang-style"
            b = dep.pad_draft_extend_query(s["src"], seq, cu, max_q, variant=variant)
            want = dep.pad_draft_extend_query_ref(s["src"], seq, cu, max_q)
        else:
            a = torch.empty_like(s["dst"])
            sgl_style_unpad(s["src"], seq, cu, a)
            b = dep.unpad_draft_extend_output(s["src"], seq, cu, total, align="start",
                                              variant=variant)
            assert torch.equal(a, b), f"unpad: ours(start, {variant}) != sglang-style"
            b = dep.unpad_draft_extend_output(s["src"], seq, cu, total, variant=variant)
            want = dep.unpad_draft_extend_output_ref(s["src"], seq, cu, total)
        assert torch.equal(b, want), f"{op}: ours({variant}) != torch twin"


def bench_shape(op, h, bs, max_q, seed=0):
    g = torch.Generator().manual_seed(seed + 1000 * h + bs + max_q)
    lens = torch.randint(1, max_q + 1, (bs,), generator=g).tolist()
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.cumsum(seq, 0)
    elsize = 2
    d = 576 if op == "pad" else 512
    moved = 2 * sum(lens) * h * d * elsize
    n_sets = max(2, min(16, -(-256 * 2**20 // max(moved, 1))))
    sets, _ = _make_sets(op, h, bs, max_q, lens, n_sets)
    total = sum(lens)
    _check_against_sgl(op, sets, seq, cu, max_q, total, lens)
    impls = _impls(op, sets, seq, cu, max_q, total)
    row = {"op": op, "H": h, "bs": bs, "max_q": max_q, "MB": moved / 1e6}
    big = max(sets[0]["src"].numel(), sets[0]["dst"].numel()) * elsize  # what auto looks at
    row["variant"] = dep.choose_variant(big, bs, op)
    for name, fn in impls.items():
        fn(0)
        before = dep.compile_count()
        if name not in ("small", "large", "ours_nopdl"):  # graph time only
            row[f"{name}_eager_us"] = _eager_us(fn, n_sets)
        row[f"{name}_graph_us"] = _graph_us(fn, n_sets)
        if name in ("ours", "small", "large", "ours_nopdl"):
            assert dep.compile_count() == before, f"{name} recompiled during timing"
    row["ours_GBps"] = moved / row["ours_graph_us"] / 1e3
    row["copy_GBps"] = moved / row["copy__graph_us"] / 1e3
    row["x_tcopy_graph"] = row["tcopy_graph_us"] / row["ours_graph_us"]
    row["pct_copy"] = 100 * row["copy__graph_us"] / row["ours_graph_us"]
    row["x_sgl_graph"] = row["sglang_graph_us"] / row["ours_graph_us"]
    row["x_sgl_eager"] = row["sglang_eager_us"] / row["ours_eager_us"]
    row["x_copy_eager"] = row["copy__eager_us"] / row["ours_eager_us"]
    row["small_vs_large"] = row["large_graph_us"] / row["small_graph_us"]
    del sets, impls
    torch.cuda.empty_cache()
    return row


COLS = [("op", "{}"), ("H", "{}"), ("bs", "{}"), ("max_q", "{}"), ("MB", "{:.2f}"),
        ("variant", "{}"), ("ours_eager_us", "{:.2f}"), ("sglang_eager_us", "{:.2f}"),
        ("torch_eager_us", "{:.1f}"), ("copy__eager_us", "{:.2f}"), ("tcopy_eager_us", "{:.2f}"),
        ("noop_eager_us", "{:.2f}"), ("ours_graph_us", "{:.2f}"), ("ours_nopdl_graph_us", "{:.2f}"),
        ("small_graph_us", "{:.2f}"), ("large_graph_us", "{:.2f}"),
        ("sglang_graph_us", "{:.2f}"), ("torch_graph_us", "{:.2f}"), ("copy__graph_us", "{:.2f}"),
        ("tcopy_graph_us", "{:.2f}"), ("noop_graph_us", "{:.2f}"), ("x_tcopy_graph", "{:.2f}"),
        ("ours_GBps", "{:.0f}"), ("pct_copy", "{:.0f}"), ("x_sgl_graph", "{:.2f}"),
        ("x_sgl_eager", "{:.2f}"), ("x_copy_eager", "{:.2f}"), ("small_vs_large", "{:.2f}")]


def to_markdown(rows):
    head = "| " + " | ".join(c for c, _ in COLS) + " |"
    sep = "|" + "---|" * len(COLS)
    body = ["| " + " | ".join(f.format(r[c]) for c, f in COLS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def summary(rows):
    big = [r for r in rows if r["MB"] >= 32]
    small = [r for r in rows if r["MB"] < 1]
    lines = []
    if big:
        pct = statistics.median(r["pct_copy"] for r in big)
        low = min(r["pct_copy"] for r in big)
        lines.append(f"calls >= 32 MB: ours median {pct:.0f}% of copy_ (min {low:.0f}%), "
                     f"{statistics.median(r['ours_GBps'] for r in big):.0f} GB/s")
    if small:
        med = lambda key: statistics.median(r[key] for r in small)
        ratio = [r["ours_graph_us"] / r["copy__graph_us"] for r in small]
        lines.append(f"calls < 1 MB in a graph: ours median {med('ours_graph_us'):.2f} us "
                     f"(max {max(r['ours_graph_us'] for r in small):.2f}), copy_ "
                     f"{med('copy__graph_us'):.2f} us (max "
                     f"{max(r['copy__graph_us'] for r in small):.2f}); ours/copy_ per row: max "
                     f"x{max(ratio):.2f}, median x{statistics.median(ratio):.2f}")
        lines.append(f"calls < 1 MB in a graph without PDL: ours median "
                     f"{med('ours_nopdl_graph_us'):.2f} us (PDL on: {med('ours_graph_us'):.2f})")
        lines.append(f"calls < 1 MB eager: ours median {med('ours_eager_us'):.2f} us, copy_ "
                     f"{med('copy__eager_us'):.2f} us, sglang-style "
                     f"{med('sglang_eager_us'):.2f} us")
        lines.append(f"floors, calls < 1 MB: bare Triton copy of the same bytes "
                     f"{med('tcopy_graph_us'):.2f} us in a graph / {med('tcopy_eager_us'):.2f} us "
                     f"eager; empty Triton kernel {med('noop_graph_us'):.2f} / "
                     f"{med('noop_eager_us'):.2f} us; ours/tcopy in a graph: max "
                     f"x{max(1 / r['x_tcopy_graph'] for r in small):.2f}, median "
                     f"x{statistics.median(1 / r['x_tcopy_graph'] for r in small):.2f}")
    lines.append("small vs large variant (graph, large/small): " + ", ".join(
        f"{lo}-{hi} MB x{statistics.median(r['small_vs_large'] for r in grp):.2f}"
        for lo, hi in ((0, 1), (1, 4), (4, 16), (16, 64), (64, 1e9))
        if (grp := [r for r in rows if lo <= r["MB"] < hi])))
    lines.append(f"vs sglang-style (graph): min x{min(r['x_sgl_graph'] for r in rows):.2f}, "
                 f"median x{statistics.median(r['x_sgl_graph'] for r in rows):.2f}")
    return "\n".join(lines)


def _ours_graph_us(op, h, bs, max_q, variant, seed=0):
    """Graph time of ours alone (forced variant), same inputs as :func:`bench_shape`."""
    g = torch.Generator().manual_seed(seed + 1000 * h + bs + max_q)
    lens = torch.randint(1, max_q + 1, (bs,), generator=g).tolist()
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.cumsum(seq, 0)
    moved = 2 * sum(lens) * h * (576 if op == "pad" else 512) * 2
    n_sets = max(2, min(16, -(-256 * 2**20 // max(moved, 1))))
    sets, _ = _make_sets(op, h, bs, max_q, lens, n_sets)
    us = _graph_us(_ours(op, sets, seq, cu, max_q, sum(lens), variant), n_sets)
    del sets
    torch.cuda.empty_cache()
    return us


def _reset_caches():
    dep._consts.cache_clear()
    for launcher in (dep._PAD, dep._PAD_SMALL, dep._UNPAD):
        launcher.binaries.clear()


def sweep(shapes, small_shapes):
    """Bytes/program x warps for ours: the large variant at a few large shapes, the small
    variant (also with the 1024-entry cu_seqlens_q load at every bs) at small ones (graph us)."""
    print("\nconfig sweep, large variant (ours, graph us per call):")
    default = (dep._TARGET_BYTES, dep._NUM_WARPS, dep._SMALL_TARGET_BYTES, dep._SMALL_NUM_WARPS,
               dep._CU_BLOCKS)
    for target, warps in [(8192, 4), (16384, 4), (32768, 4), (16384, 8), (32768, 8)]:
        dep._TARGET_BYTES, dep._NUM_WARPS = target, warps
        _reset_caches()
        res = [f"{op} H{h} bs{bs} q{q}: {_ours_graph_us(op, h, bs, q, 'large'):.2f}"
               for op, h, bs, q in shapes]
        print(f"  bytes/program {target:6d} warps {warps}: " + "; ".join(res), flush=True)
    dep._TARGET_BYTES, dep._NUM_WARPS = default[:2]
    print("\nconfig sweep, small variant (ours, graph us per call):")
    for target, warps, cu_blocks in [(4096, 4, (32, 128, 1024)),
                                     (2048, 4, (128, 1024)), (4096, 4, (128, 1024)),
                                     (8192, 4, (128, 1024)), (2048, 2, (128, 1024)),
                                     (4096, 2, (128, 1024)), (4096, 8, (128, 1024)),
                                     (4096, 4, (1024, 1024))]:
        dep._SMALL_TARGET_BYTES, dep._SMALL_NUM_WARPS, dep._CU_BLOCKS = target, warps, cu_blocks
        _reset_caches()
        res = [f"{op} H{h} bs{bs} q{q}: {_ours_graph_us(op, h, bs, q, 'small'):.2f}"
               for op, h, bs, q in small_shapes]
        print(f"  bytes/program {target:5d} warps {warps} cu {cu_blocks[0]:4d}: "
              + "; ".join(res), flush=True)
    (dep._TARGET_BYTES, dep._NUM_WARPS, dep._SMALL_TARGET_BYTES, dep._SMALL_NUM_WARPS,
     dep._CU_BLOCKS) = default
    _reset_caches()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--small-bytes", type=int, default=None,
                    help="override dep.SMALL_CALL_BYTES (the auto variant threshold)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pad needs a CUDA GPU")
    if args.small_bytes is not None:
        dep.SMALL_CALL_BYTES = args.small_bytes
    hs, bss, qs = (([32], [1, 8, 512], [4]) if args.quick
                   else ([16, 32, 128], [1, 8, 64, 512], [2, 4, 8]))
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, bf16, D 576 (pad) / 512 (unpad), SMALL_CALL_BYTES "
          f"{dep.SMALL_CALL_BYTES}", flush=True)
    t0 = time.perf_counter()
    rows = []
    for op in ("pad", "unpad"):
        for h in hs:
            for bs in bss:
                for q in qs:
                    rows.append(bench_shape(op, h, bs, q))
                    r = rows[-1]
                    print(f"{op:5s} H{h:<4d} bs{bs:<4d} q{q}: ours ({r['variant']}) "
                          f"{r['ours_graph_us']:.2f} us (small {r['small_graph_us']:.2f}, large "
                          f"{r['large_graph_us']:.2f}, copy_ {r['copy__graph_us']:.2f}, sgl "
                          f"{r['sglang_graph_us']:.2f}); eager {r['ours_eager_us']:.2f} vs copy_ "
                          f"{r['copy__eager_us']:.2f}, sgl {r['sglang_eager_us']:.2f}", flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s; compile_count() = {dep.compile_count()}; direct "
          f"launch path in use: pad {dep._PAD.direct}, pad small {dep._PAD_SMALL.direct}, unpad "
          f"{dep._UNPAD.direct}")
    md = to_markdown(rows)
    print("\n" + md + "\n\n" + summary(rows))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_pad.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(out, "bench_pad.md"), "w") as f:
            f.write(md + "\n\n" + summary(rows) + "\n")
    if args.sweep:
        sweep([("pad", 128, 512, 4), ("unpad", 128, 512, 4), ("pad", 32, 64, 8)],
              [("pad", 16, 1, 4), ("unpad", 16, 1, 4), ("pad", 128, 1, 4), ("unpad", 128, 1, 4),
               ("pad", 32, 8, 4), ("unpad", 32, 8, 4)])


if __name__ == "__main__":
    main()
