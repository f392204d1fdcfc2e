"""Benchmark: draft-extend pad / unpad on the GPU, ours vs an SGLang-style kernel, torch, copy_.

    python benchmarks/bench_pad.py           # H {16,32,128} x bs {1,64,512} x max_q {2,4,8}
    python benchmarks/bench_pad.py --quick   # a few shapes
    python benchmarks/bench_pad.py --sweep   # also sweep bytes/program x warps first

Implementations (all move the same bytes: the real rows, read + written; padded rows untouched):
- ours: ``mla_spec.kernels.draft_extend_pad`` (align="end", fill_padding=False, validate=False).
- sglang-style: written here from the description in ``shared/reference/sglang.md`` §4.6: one
  program per (padded row, 64-head tile, 64-dim tile), masked, contiguous tensors, launched through
  the normal Triton path with its ints specialized.
- torch: index computation (searchsorted) + ``index_copy_`` (pad) / ``index_select`` (unpad).
- copy_: ``dst[:n].copy_(src[:n])`` of the same bytes: the ceiling.

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

from mla_spec.kernels import draft_extend_pad as dep

GRAPH_CALLS = 20


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


def _impls(op, sets, seq, cu, max_q, total):
    if op == "pad":
        ours = lambda i: dep.pad_draft_extend_query(
            sets[i]["src"], seq, cu, max_q, out=sets[i]["dst"], fill_padding=False, validate=False)
        sgl = lambda i: sgl_style_pad(sets[i]["src"], seq, cu, sets[i]["dst"])
        tch = lambda i: torch_pad(sets[i]["src"], seq, cu, sets[i]["dst"], sets[i]["arange"])
    else:
        ours = lambda i: dep.unpad_draft_extend_output(
            sets[i]["src"], seq, cu, total, out=sets[i]["dst"], validate=False)
        sgl = lambda i: sgl_style_unpad(sets[i]["src"], seq, cu, sets[i]["dst"])
        tch = lambda i: torch_unpad(sets[i]["src"], seq, cu, sets[i]["dst"], sets[i]["arange"])
    n_el = sets[0]["flat"].numel()
    src_flat = [s["src"].view(-1)[:n_el] for s in sets]
    copy = lambda i: sets[i]["flat"].copy_(src_flat[i])
    return {"ours": ours, "sglang": sgl, "torch": tch, "copy_": copy}


def _check_against_sgl(op, sets, seq, cu, max_q, total, lens):
    """ours (align start) == sglang-style on the real rows; ours (end) == the torch peer."""
    s = sets[0]
    if op == "pad":
        a = s["dst"].clone().zero_()
        sgl_style_pad(s["src"], seq, cu, a)
        b = dep.pad_draft_extend_query(s["src"], seq, cu, max_q, align="start")
        real = torch.arange(max_q, device="cuda")[None, :] < seq[:, None]
        assert torch.equal(a[real], b[real]), "pad: ours(start) != sglang-style"
    else:
        a = torch.empty_like(s["dst"])
        sgl_style_unpad(s["src"], seq, cu, a)
        b = dep.unpad_draft_extend_output(s["src"], seq, cu, total, align="start")
        assert torch.equal(a, b), "unpad: ours(start) != sglang-style"


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
    for name, fn in impls.items():
        fn(0)
        before = dep.compile_count()
        row[f"{name}_eager_us"] = _eager_us(fn, n_sets)
        row[f"{name}_graph_us"] = _graph_us(fn, n_sets)
        if name == "ours":
            assert dep.compile_count() == before, "ours recompiled during timing"
    row["ours_GBps"] = moved / row["ours_graph_us"] / 1e3
    row["copy_GBps"] = moved / row["copy__graph_us"] / 1e3
    row["pct_copy"] = 100 * row["copy__graph_us"] / row["ours_graph_us"]
    row["x_sgl_graph"] = row["sglang_graph_us"] / row["ours_graph_us"]
    row["x_sgl_eager"] = row["sglang_eager_us"] / row["ours_eager_us"]
    del sets, impls
    torch.cuda.empty_cache()
    return row


COLS = [("op", "{}"), ("H", "{}"), ("bs", "{}"), ("max_q", "{}"), ("MB", "{:.2f}"),
        ("ours_eager_us", "{:.2f}"), ("sglang_eager_us", "{:.2f}"), ("torch_eager_us", "{:.1f}"),
        ("copy__eager_us", "{:.2f}"), ("ours_graph_us", "{:.2f}"), ("sglang_graph_us", "{:.2f}"),
        ("torch_graph_us", "{:.2f}"), ("copy__graph_us", "{:.2f}"), ("ours_GBps", "{:.0f}"),
        ("pct_copy", "{:.0f}"), ("x_sgl_graph", "{:.2f}"), ("x_sgl_eager", "{:.2f}")]


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
        lines.append("calls < 1 MB in a graph: ours median "
                     f"{statistics.median(r['ours_graph_us'] for r in small):.2f} us, copy_ "
                     f"{statistics.median(r['copy__graph_us'] for r in small):.2f} us; eager ours "
                     f"median {statistics.median(r['ours_eager_us'] for r in small):.2f} us")
    lines.append(f"vs sglang-style (graph): min x{min(r['x_sgl_graph'] for r in rows):.2f}, "
                 f"median x{statistics.median(r['x_sgl_graph'] for r in rows):.2f}")
    return "\n".join(lines)


def sweep(shapes):
    """Per-program bytes x warps for ours at a few large shapes (graph us)."""
    print("\nconfig sweep (ours, graph us per call):")
    default = (dep._TARGET_BYTES, dep._NUM_WARPS)
    for target, warps in [(8192, 4), (16384, 4), (32768, 4), (16384, 8), (32768, 8)]:
        dep._TARGET_BYTES, dep._NUM_WARPS = target, warps
        dep._consts.cache_clear()
        dep._PAD.binaries.clear()
        dep._UNPAD.binaries.clear()
        res = []
        for op, h, bs, q in shapes:
            r = bench_shape(op, h, bs, q)
            res.append(f"{op} H{h} bs{bs} q{q}: {r['ours_graph_us']:.2f}")
        print(f"  bytes/program {target:6d} warps {warps}: " + "; ".join(res))
    dep._TARGET_BYTES, dep._NUM_WARPS = default
    dep._consts.cache_clear()
    dep._PAD.binaries.clear()
    dep._UNPAD.binaries.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pad needs a CUDA GPU")
    hs, bss, qs = ([32], [1, 512], [4]) if args.quick else ([16, 32, 128], [1, 64, 512], [2, 4, 8])
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, bf16, D 576 (pad) / 512 (unpad)", flush=True)
    rows = []
    for op in ("pad", "unpad"):
        for h in hs:
            for bs in bss:
                for q in qs:
                    rows.append(bench_shape(op, h, bs, q))
                    r = rows[-1]
                    print(f"{op:5s} H{h:<4d} bs{bs:<4d} q{q}: ours {r['ours_graph_us']:.2f} us "
                          f"({r['pct_copy']:.0f}% copy), sgl {r['sglang_graph_us']:.2f}, eager "
                          f"{r['ours_eager_us']:.2f} vs {r['sglang_eager_us']:.2f}", flush=True)
    print(f"\ncompile_count() = {dep.compile_count()}; direct launch path in use: "
          f"pad {dep._PAD.direct}, unpad {dep._UNPAD.direct}")
    md = to_markdown(rows)
    print("\n" + md + "\n\n" + summary(rows))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_pad.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(out, "bench_pad.md"), "w") as f:
            f.write(md + "\n\n" + summary(rows) + "\n")
    if args.sweep:
        sweep([("pad", 128, 512, 4), ("unpad", 128, 512, 4), ("pad", 32, 64, 8)])


if __name__ == "__main__":
    main()
