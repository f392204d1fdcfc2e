"""Fused RoPE (``mla_spec.kernels.ops.rope_qk``) against its torch reference on the GPU.

    python benchmarks/bench_rope.py

DeepSeek-V3 shapes: q_pe ``[N, H, 64]`` as a view of q_b_proj's ``[N, H, 192]`` output, k_pe
``[N, 64]`` a view of kv_a_proj's ``[N, 576]``, YaRN frequencies, H = 32 (TP 4) and 128 (TP 1),
N = 1..512 rows. Each is timed per call inside a replayed CUDA graph (the decode setting; the
torch version is ~24 small kernels there) and eagerly, after a check against the twin. Prints a
table (twin µs, fused µs, ratio) last; writes ``bench_rope.json`` to ``$OUT`` when set.
"""

from __future__ import annotations

import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_nvfp4 as bench  # noqa: E402

from mla_spec.kernels.ops import rope_qk, rope_qk_ref  # noqa: E402
from mla_spec.models.rope import yarn_inv_freq  # noqa: E402

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def time_one(h: int, n: int, inv_freq: torch.Tensor, attn: float) -> dict:
    q = torch.randn(n, h, 192, device="cuda", dtype=torch.bfloat16)[..., 128:]
    k = torch.randn(n, 576, device="cuda", dtype=torch.bfloat16)[:, 512:]
    pos = torch.randint(0, 163840, (n,), device="cuda")

    def twin():
        return rope_qk_ref(pos, q, k, inv_freq, attn)

    def fused():
        return rope_qk(pos, q, k, inv_freq, attn)

    err = max(bench.rel_err(a, b) for a, b in zip(fused(), twin()))
    t_graph, f_graph = bench.graph_us([twin] * 8), bench.graph_us([fused] * 8)
    t_eager = triton.testing.do_bench(twin) * 1e3
    f_eager = triton.testing.do_bench(fused) * 1e3
    return dict(h=h, n=n, twin_graph_us=round(t_graph, 2), fused_graph_us=round(f_graph, 2),
                ratio_graph=round(t_graph / f_graph, 2), twin_eager_us=round(t_eager, 1),
                fused_eager_us=round(f_eager, 1), rel_err=float(f"{err:.1e}"))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_rope needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    inv_freq, attn = yarn_inv_freq(64, 10000.0, YARN, 163840)
    inv_freq = inv_freq.cuda()
    rows = []
    for h in (32, 128):
        for n in (1, 4, 32, 128, 512):
            rows.append(time_one(h, n, inv_freq, attn))
            print(rows[-1], flush=True)
    c = bench.col
    print("\n" + bench.md_table([
        ("H", c("h")), ("N", c("n")), ("torch twin µs (graph)", c("twin_graph_us")),
        ("fused µs (graph)", c("fused_graph_us")), ("twin / fused", c("ratio_graph")),
        ("twin eager µs", c("twin_eager_us")), ("fused eager µs", c("fused_eager_us")),
        ("rel err", c("rel_err"))], rows))
    bench.save_results("bench_rope", rows=rows)


if __name__ == "__main__":
    main()
