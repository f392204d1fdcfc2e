"""Tile configs of the NVFP4 kernels and the configs pinned by the H200 sweep.

``benchmarks/sweep_nvfp4.py`` times GEMV and MMA tile variants for each weight shape (N, K)
and M = 1, 4, 16, 64 tokens, and names the fastest one like ``"gemv bn256 s16 w2 st1"``.
``PINNED_CONFIGS`` keeps those names verbatim, keyed by ``(N, K, M bucket)``, so a new sweep is
applied by pasting its ``best variant`` column; ``parse_variant`` turns a name into a
``GemvConfig`` (``nvfp4_gemv``: FMA, no MMA) or an ``NVFP4GemmConfig`` (``nvfp4_gemm``: bf16
MMA after an in-register decode, weights on the MMA's A side: "swap AB") or an
``NVFP4MmaConfig`` (``nvfp4_gemm``'s standard-orientation kernel: activations ``[BM, BK]`` as
the A operand, decoded weights ``[BK, BN]`` as B). The dataclasses live here, so the table
needs no kernel import; the kernel modules re-export them under their usual names.

Variant grammar (tokens after the kind, any order)::

    gemv bn<block_n> s<split_k> w<num_warps> st<num_stages> [g<groups>] [h2 [pf]] [pure]
    mma  bn<block_n> s<split_k> w<num_warps> st<num_stages> [bk<block_k>] [pure]
    mmab [bm<block_m>] bn<block_n> bk<block_k> w<num_warps> st<num_stages> s<split_k> [pure]
    cuda w<num_warps> st<num_stages> s<split_k> [r<row_tiles>] [xl]  (CudaMmaConfig)

``pure`` selects the portable decoder (default: the PTX decoders, validated on the H200);
``h2`` the GEMV's packed-fp16 math (``nvfp4_gemv_packed``: two weights per instruction), ``pf``
its K loop with register double buffering.
``mmab`` without ``bm`` takes the token tile from M (``block_m = 0``: 16 / 32 / 64 / 128).

M buckets: a measured M stands for the token counts above the previous bucket, up to itself:
1 -> {1}, 2 -> {2}, 4 -> {3, 4}, 8 -> {5..8}, 16 -> {9..16}, 64 -> {17..64}, 128 -> {65..128},
512 -> {129..512}. Unmeasured buckets and M > 512 fall to the kernels' heuristics
(``packed_gemv_config`` up to 2 tokens, else ``default_mma_config``: the
standard-orientation kernel).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

__all__ = ["GemvConfig", "NVFP4GemmConfig", "NVFP4MmaConfig", "CudaMmaConfig", "PINNED_CONFIGS",
           "PINNED_CUDA", "PINNED_CUDA_REFUSED", "M_BUCKETS", "m_bucket", "parse_variant",
           "variant_name", "pinned_config"]


@dataclass(frozen=True)
class GemvConfig:
    """``block_n`` rows and ``groups`` 16-blocks per step, ``split_k`` programs along K,
    ``num_warps`` / ``num_stages``, and the PTX decoder (``fast_dequant``, GPU only)."""

    block_n: int = 128
    groups: int = 2
    split_k: int = 1
    num_warps: int = 1
    num_stages: int = 1
    fast_dequant: bool | None = None  # None: nvfp4_gemv.GEMV_FAST
    packed: bool = False  # fp16x2 math (nvfp4_gemv_packed), bf16 x only
    prefetch: bool = False  # packed only: next step's loads before this step's math


@dataclass(frozen=True)
class NVFP4GemmConfig:
    """Tile config: ``block_n`` weight rows and ``block_k`` elements per step, ``split_k``
    programs along K, warps / pipeline stages, and the packed PTX decoder (sm_90+, never in
    the interpreter; ``False`` selects the portable decoder)."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fast_dequant: bool = True


@dataclass(frozen=True)
class NVFP4MmaConfig:
    """Standard-orientation MMA kernel: ``block_m`` tokens (0: by M) x ``block_n`` weight rows
    per program, ``block_k`` elements per step, ``split_k`` programs along K, warps / stages,
    and the packed PTX decoder (``False``: the portable one)."""

    block_m: int = 0
    block_n: int = 128
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fast_dequant: bool = True


@dataclass(frozen=True)
class CudaMmaConfig:
    """The hand-written ``mma.sync`` kernel (``nvfp4_gemm_cuda``, up to 16 tokens, sm_90 with
    nvcc): ``num_warps`` warps per 16-row tile share its K range, each with a ring of
    ``num_stages`` 128-element chunks in flight (``cp.async``); ``split_k`` CTAs per tile
    along K; ``x_prefetch``: the next chunk's activations are loaded during this chunk's math;
    ``row_tiles``: 16-row tiles per warp (2: a chunk's activations serve two tiles).
    ``nvfp4_gemm_cuda.CUDA_MMA_BUILT`` lists the (tokens > 8, warps, stages, x_prefetch,
    row_tiles) combinations compiled."""

    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    x_prefetch: bool = True
    row_tiles: int = 1


M_BUCKETS = (1, 2, 4, 8, 16, 64, 128, 512)

# H200, 2026-11-29, torch 2.11 / triton 3.6, CUDA graph, weights rotated past L2 (µs per call;
# docs/bench_nvfp4.md). Entries marked "old default" are the previous heuristic's config where
# it beat every variant the sweep reached before its deadline.
PINNED_CONFIGS: dict[tuple[int, int, int], str] = {
    # M = 1 rows: fourth session (`sweep_gemv.py`, docs/bench_nvfp4.md): the GEMV with
    # packed-fp16 math ("h2"), wide steps (g 32-64 words: a warp's lanes along K) and register
    # double buffering ("pf") beats mmab on every shape, and at M = 2 (bucket {2}); mmab keeps
    # M >= 3 (at 4 tokens the packed GEMV lost on three shapes of four).
    # H200 sweeps of 2026-11-29, second session (`sweep_nvfp4.py --mma-only`, docs/bench_nvfp4.md):
    # the standard-orientation MMA kernel ("mmab") wins every shape and M, the GEMV included.
    # Comments: µs per call in a CUDA graph (cuBLAS bf16 in the same run); before = old default
    (9216, 7168, 1): "gemv bn8 s1 w2 st1 g64 h2 pf",  # 15.23 (cuBLAS 43.97); mmab 29.59
    (9216, 7168, 2): "gemv bn8 s1 w2 st1 g64 h2 pf",  # 23.33 (cuBLAS 41.45); mmab 29.92
    (9216, 7168, 4): "mmab bm16 bn128 bk256 w4 st3 s4",  # 29.68 (cuBLAS 43.89); before 52.04
    (9216, 7168, 8): "mmab bm16 bn128 bk256 w4 st3 s4",  # 29.51 (cuBLAS 44.32); before 92.85
    (9216, 7168, 16): "mmab bm16 bn128 bk256 w4 st3 s4",  # 29.35 (cuBLAS 43.97); before 88.88
    (9216, 7168, 64): "mmab bm64 bn128 bk128 w4 st3 s4",  # 51.93 (cuBLAS 39.49); before 317.73
    (9216, 7168, 128): "mmab bm128 bn128 bk128 w4 st4 s4",  # 82.11 (cuBLAS 40.98); before 94.5
    (9216, 7168, 512): "mmab bm128 bn64 bk128 w4 st4 s1",  # 256.55 (cuBLAS 91.36); before 278.41
    (7168, 4608, 1): "gemv bn8 s1 w2 st1 g64 h2 pf",  # 9.88 (cuBLAS 23.62); mmab 17.39
    (7168, 4608, 2): "gemv bn8 s1 w2 st1 g64 h2",  # 14.61 (cuBLAS 23.92); mmab 17.45
    (7168, 4608, 4): "mmab bm16 bn64 bk128 w4 st4 s4",  # 17.14 (cuBLAS 23.66); before 28.47
    (7168, 4608, 8): "mmab bm16 bn64 bk128 w4 st4 s4",  # 16.96 (cuBLAS 23.71); before 45.52
    (7168, 4608, 16): "mmab bm16 bn64 bk128 w4 st4 s4",  # 16.66 (cuBLAS 21.6); before 41.88
    (7168, 4608, 64): "mmab bm64 bn64 bk128 w4 st4 s4",  # 26.54 (cuBLAS 21.69); before 140.0
    (7168, 4608, 128): "mmab bm128 bn128 bk128 w8 st3 s4",  # 38.01 (cuBLAS 23.58); before 37.98
    (7168, 4608, 512): "mmab bm128 bn128 bk64 w4 st4 s2",  # 103.1 (cuBLAS 47.4); before 127.1
    (1024, 7168, 1): "gemv bn4 s4 w1 st1 g64 h2 pf",  # 5.91 (cuBLAS 9.4); mmab 9.01
    (1024, 7168, 2): "gemv bn8 s8 w2 st1 g32 h2 pf",  # 6.94 (cuBLAS 9.49); mmab 9.06
    (1024, 7168, 4): "mmab bm16 bn64 bk128 w4 st4 s8",  # 8.93 (cuBLAS 9.37); before 21.26
    (1024, 7168, 8): "mmab bm16 bn64 bk128 w4 st4 s8",  # 8.92 (cuBLAS 9.44); before 23.83
    (1024, 7168, 16): "mmab bm16 bn64 bk128 w4 st4 s8",  # 9.09 (cuBLAS 9.53); before 28.77
    (1024, 7168, 64): "mmab bm64 bn64 bk128 w4 st4 s8",  # 11.02 (cuBLAS 10.11); before 159.36
    (1024, 7168, 128): "mmab bm128 bn64 bk128 w4 st4 s8",  # 13.16 (cuBLAS 10.68); before 14.15
    (1024, 7168, 512): "mmab bm128 bn128 bk64 w4 st4 s8",  # 28.53 (cuBLAS 15.28); before 36.56
    (7168, 512, 1): "gemv bn4 s1 w1 st1 g32 h2 pf",  # 3.16 (cuBLAS 4.78); mmab 5.01
    # seventh session (sweep_gemv --one-step): 2.80 vs 3.95 for the entry before (no pf), cuBLAS
    # 4.79; the shared expert's w2 at 2 tokens
    (7168, 512, 2): "gemv bn8 s1 w2 st1 g32 h2 pf",
    (7168, 512, 4): "mmab bm16 bn64 bk128 w4 st4 s1",  # 4.66 (cuBLAS 4.77); before 9.66
    (7168, 512, 8): "mmab bm16 bn64 bk128 w4 st4 s1",  # 4.52 (cuBLAS 4.78); before 10.84
    (7168, 512, 16): "mmab bm16 bn64 bk128 w4 st4 s1",  # 4.47 (cuBLAS 4.84); before 13.83
    (7168, 512, 64): "mmab bm64 bn64 bk128 w4 st4 s1",  # 5.38 (cuBLAS 5.13); before 38.26
    (7168, 512, 128): "mmab bm128 bn64 bk128 w4 st4 s1",  # 6.7 (cuBLAS 5.21); before 10.07
    (7168, 512, 512): "mmab bm128 bn256 bk128 w8 st3 s1",  # 15.92 (cuBLAS 8.16); before 18.96
}

# The hand-written mma.sync kernel (``nvfp4_gemm_cuda``, sm_90 with nvcc) where the H200 sweep
# measured it faster than the entry above (eleventh session, `benchmarks/sweep_nvfp4_cuda.py`,
# second sweep, after the two-row-tile build: µs per call in a CUDA graph, PDL on, cuda vs the
# Triton config above, cuBLAS bf16 in the same run). ``nvfp4_gemm`` takes these first when the
# kernel can run the call, else the Triton table.
PINNED_CUDA: dict[tuple[int, int, int], str] = {
    (9216, 7168, 2): "cuda w8 st4 s1",  # 18.41 vs 22.55 (cuBLAS 43.27)
    (9216, 7168, 4): "cuda w8 st4 s1",  # 19.24 vs 28.79 (cuBLAS 43.75)
    (9216, 7168, 8): "cuda w4 st8 s1",  # 21.36 vs 28.37 (cuBLAS 43.80)
    (7168, 4608, 1): "cuda w8 st4 s1 r2",  # 9.50 vs 10.03 (cuBLAS 23.50)
    (7168, 4608, 2): "cuda w8 st4 s1 r2",  # 9.61 vs 14.25 (cuBLAS 23.52)
    (7168, 4608, 4): "cuda w8 st4 s1 r2",  # 9.73 vs 16.04 (cuBLAS 23.49)
    (7168, 4608, 8): "cuda w8 st4 s1 r2",  # 9.99 vs 15.78 (cuBLAS 23.62)
    (7168, 4608, 16): "cuda w8 st4 s1 r2 xl",  # 13.52 vs 15.41 (cuBLAS 21.49)
    (1024, 7168, 4): "cuda w4 st4 s16 xl",  # 6.53 vs 7.76 (cuBLAS 9.46)
    (1024, 7168, 8): "cuda w4 st4 s16 xl",  # 6.71 vs 7.70 (cuBLAS 9.45)
    (7168, 512, 1): "cuda w4 st4 s1 xl",  # 2.31 vs 2.96 (cuBLAS 4.79)
    (7168, 512, 2): "cuda w4 st4 s1 xl",  # 2.36 vs 2.81 (cuBLAS 4.78)
    (7168, 512, 4): "cuda w4 st4 s1 xl",  # 2.41 vs 4.01 (cuBLAS 4.79)
    (7168, 512, 8): "cuda w4 st8 s1 r2",  # 2.67 vs 3.90 (cuBLAS 4.81)
    (7168, 512, 16): "cuda w4 st4 s1 xl",  # 3.38 vs 3.86 (cuBLAS 4.83)
}
# Where the sweep kept the Triton entry (cuda slower or within 2%): M = 1 on gate/up and w13
# (the packed GEMV: 14.71 vs 17.95, 4.93 vs 5.61), M = 2 on w13 (6.29 vs 6.41), M = 9-16 on
# gate/up and w13 (mmab: 28.35 vs 30.18, 7.94 vs 9.18).
PINNED_CUDA_REFUSED = frozenset({(9216, 7168, 1), (9216, 7168, 16), (1024, 7168, 1),
                                 (1024, 7168, 2), (1024, 7168, 16)})

_FIELDS = {"bm": "block_m", "bn": "block_n", "bk": "block_k", "st": "num_stages", "s": "split_k",
           "w": "num_warps", "g": "groups", "r": "row_tiles"}
_POW2 = ("block_n", "block_k", "groups", "num_warps")
_KIND_TOKENS = {"gemv": ("bn", "st", "s", "w", "g"), "mma": ("bn", "bk", "st", "s", "w"),
                "mmab": ("bm", "bn", "bk", "st", "s", "w"), "cuda": ("w", "st", "s", "r")}


def m_bucket(m: int) -> int | None:
    """Smallest bucket of ``M_BUCKETS`` holding ``m`` tokens, None above the last."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return None


@cache
def parse_variant(name: str) -> GemvConfig | NVFP4GemmConfig | NVFP4MmaConfig | CudaMmaConfig:
    """``"gemv bn256 s16 w2 st1"`` -> ``GemvConfig``, ``"mma bn128 s4 w8 st3 bk128"`` ->
    ``NVFP4GemmConfig``, ``"mmab bm64 bn128 bk128 w4 st3 s1"`` -> ``NVFP4MmaConfig``,
    ``"cuda w4 u1 s2"`` -> ``CudaMmaConfig`` (grammar in the module docstring); ValueError on
    anything else."""
    kind, *tokens = name.split() or [""]
    if kind not in _KIND_TOKENS:
        raise ValueError(f"variant {name!r} must start with 'gemv', 'mma', 'mmab' or 'cuda'")
    kw: dict[str, int | bool] = {}
    for tok in tokens:
        hit = re.fullmatch(r"(bm|bn|bk|st|s|w|g|r)(\d+)", tok)
        if tok == "pure" and kind != "cuda":
            kw["fast_dequant"] = False
        elif tok == "h2" and kind == "gemv":
            kw["packed"] = True
        elif tok == "pf" and kind == "gemv":
            kw["prefetch"] = True
        elif tok == "xl" and kind == "cuda":
            kw["x_prefetch"] = False
        elif hit is None or hit[1] not in _KIND_TOKENS[kind]:
            raise ValueError(f"unsupported token {tok!r} in {kind} variant {name!r}")
        else:
            kw[_FIELDS[hit[1]]] = int(hit[2])
    for field, v in kw.items():
        if field == "block_m" and v not in (16, 32, 64, 128):
            raise ValueError(f"block_m = {v} in {name!r}: must be 16, 32, 64 or 128")
        flag = field in ("fast_dequant", "packed", "prefetch", "x_prefetch")
        if not flag and (v < 1 or (field in _POW2 and v & (v - 1))):
            raise ValueError(f"{field} = {v} in {name!r}: must be >= 1"
                             + (" and a power of two" if field in _POW2 else ""))
    if kind == "cuda":
        return CudaMmaConfig(**kw)
    if kind == "gemv":
        return GemvConfig(**kw)
    return NVFP4GemmConfig(**kw) if kind == "mma" else NVFP4MmaConfig(**kw)


def variant_name(cfg: GemvConfig | NVFP4GemmConfig | NVFP4MmaConfig | CudaMmaConfig) -> str:
    """Inverse of ``parse_variant`` (the sweep's naming)."""
    if isinstance(cfg, CudaMmaConfig):
        return (f"cuda w{cfg.num_warps} st{cfg.num_stages} s{cfg.split_k}"
                + (f" r{cfg.row_tiles}" if cfg.row_tiles != 1 else "")
                + ("" if cfg.x_prefetch else " xl"))
    pure = " pure" if cfg.fast_dequant is False else ""
    if isinstance(cfg, NVFP4MmaConfig):
        bm = f" bm{cfg.block_m}" if cfg.block_m else ""
        return (f"mmab{bm} bn{cfg.block_n} bk{cfg.block_k} w{cfg.num_warps} st{cfg.num_stages}"
                f" s{cfg.split_k}{pure}")
    gemv = isinstance(cfg, GemvConfig)
    name = (f"{'gemv' if gemv else 'mma'} bn{cfg.block_n} s{cfg.split_k} w{cfg.num_warps} "
            f"st{cfg.num_stages}")
    if gemv and cfg.groups != 2:
        name += f" g{cfg.groups}"
    if gemv and cfg.packed:
        name += " h2"
    if gemv and cfg.prefetch:
        name += " pf"
    if not gemv:
        name += f" bk{cfg.block_k}"
    return name + pure


def pinned_config(m: int, n: int, k: int
                  ) -> GemvConfig | NVFP4GemmConfig | NVFP4MmaConfig | None:
    """The pinned config for ``m`` tokens x weight ``[N, K]``, or None when not measured."""
    name = PINNED_CONFIGS.get((n, k, m_bucket(m)))
    return None if name is None else parse_variant(name)
