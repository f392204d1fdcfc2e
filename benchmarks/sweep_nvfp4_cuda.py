"""The hand-written NVFP4 ``mma.sync`` kernel (``nvfp4.gemm_cuda``) against the Triton choice of
``nvfp4_gemm`` and cuBLAS bf16, at DeepSeek-V3's TP-4 shapes and 1-16 tokens (GPU only).

For each (shape, M): every built ``cuda w<warps> st<stages> s<splits> [r2] [xl]`` variant is
checked against the torch reference, then timed per call in one replayed CUDA graph that rotates
weight sets past the 60 MB L2 (PDL on, as the model runs), beside the current automatic config
and cuBLAS bf16 on bf16 weights in the same run. Prints one table (µs, x cuBLAS, cuda / auto)
and writes ``$OUT/sweep_nvfp4_cuda.{json,md}`` when ``$OUT`` is set; its best variants are
``configs.PINNED_CUDA``'s entries.

    python3 benchmarks/sweep_nvfp4_cuda.py [--ms 1,2,4,8,16] [--shapes dense_gate_up_tp4,...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nvfp4 import SHAPES, col, graph_us, md_table, save_results, weight_sets  # noqa: E402

from mla_spec.kernels.nvfp4 import CudaMmaConfig, nvfp4_gemm, nvfp4_gemm_ref  # noqa: E402
from mla_spec.kernels.nvfp4.configs import variant_name  # noqa: E402
from mla_spec.kernels.nvfp4.gemm import auto_config  # noqa: E402
from mla_spec.kernels.nvfp4.gemm_cuda import CUDA_MMA_BUILT, cuda_gemm_supported  # noqa: E402


def variants(m: int, n: int, k: int) -> list[CudaMmaConfig]:
    """Every build that takes ``m`` tokens, at the K splits worth trying for (N, K)."""
    chunks = k // 128
    splits = sorted({s for s in (1, 2, 4, 8, 16) if s <= max(1, chunks // 2)}
                    if n < 4096 else {1, 2, 3, 4})
    nt = 1 if m <= 8 else 2
    return [CudaMmaConfig(w, st, s, xpf, r) for s in splits
            for t, w, st, xpf, r in CUDA_MMA_BUILT if t == nt]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        sets, wbf = weight_sets(n, k)
        for m in ms:
            t0 = time.time()
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            why = cuda_gemm_supported(x, *sets[0], torch.bfloat16)
            if why:
                raise SystemExit(f"{name} m={m}: {why}")
            ref = nvfp4_gemm_ref(x, *sets[0], torch.float32)
            timed = {}
            for cfg in variants(m, n, k):
                y = nvfp4_gemm(x, *sets[0], config=cfg).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                if not err < 8e-3:
                    raise SystemExit(f"{name} m={m} {variant_name(cfg)}: error {err:.2e}")
                timed[cfg] = graph_us([lambda a=a, c=cfg, x=x: nvfp4_gemm(x, *a, config=c)
                                       for a in sets])
            best = min(timed, key=timed.get)
            tcfg = auto_config(m, n, k)  # the Triton choice (what runs without the cuda kernel)
            auto = graph_us([lambda a=a, x=x, c=tcfg: nvfp4_gemm(x, *a, config=c) for a in sets])
            bf16 = graph_us([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbf])
            cu = timed[best]
            rows.append(dict(shape=name, n=n, k=k, m=m, cuda_us=round(cu, 2),
                             cuda_variant=variant_name(best), auto_us=round(auto, 2),
                             auto_variant=variant_name(tcfg),
                             bf16_us=round(bf16, 2), cuda_x_bf16=round(bf16 / cu, 2),
                             auto_x_bf16=round(bf16 / auto, 2), cuda_vs_auto=round(auto / cu, 2),
                             cuda_GBps=round(n * k * 0.5625 / (cu * 1e-6) / 1e9),
                             all_us={variant_name(c): round(v, 2) for c, v in timed.items()}))
            print({k_: v for k_, v in rows[-1].items() if k_ != "all_us"},
                  f"({time.time() - t0:.0f} s)", flush=True)
        del sets, wbf
    cols = [("shape", col("shape")), ("M", col("m")), ("cuda µs", col("cuda_us")),
            ("variant", col("cuda_variant")), ("auto µs", col("auto_us")),
            ("auto variant", col("auto_variant")), ("cuBLAS bf16 µs", col("bf16_us")),
            ("cuda x bf16", col("cuda_x_bf16")), ("auto x bf16", col("auto_x_bf16")),
            ("cuda / auto", col("cuda_vs_auto")), ("cuda GB/s", col("cuda_GBps"))]
    md = md_table(cols, rows)
    print(md)
    save_results("sweep_nvfp4_cuda", md, rows=rows)


if __name__ == "__main__":
    main()
