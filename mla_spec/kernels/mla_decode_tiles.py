"""Tile configs of the paged MLA kernels, the per-shape defaults table, and the split model.

``PagedConfig`` names one compiled variant of ``mla_decode_paged`` (or, with ``vsplit > 1`` /
``fused``, of its sibling kernel in ``mla_decode_vsplit``). ``PAGED_VARIANTS`` gives the
variants the names that ``benchmarks/sweep_mla.py`` prints; ``PAGED_DEFAULTS`` maps a shape
class ``(kv dtype, rows per request, batch)`` to the winner of the last H200 sweep (edit it
after a sweep: the sweep's "best" column prints ``NAME/spN`` strings of exactly this form, and
it prints a suggested table), and ``PAGED_CONTEXT_DEFAULTS`` overrides a class per context
length where the winner changes with it. :func:`pick_num_splits_paged` is the KV-split cost
model used when no split count is pinned.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mla_spec.device import cuda_capability
from mla_spec.kernels.cuda_driver import cuda_kernels_available
from mla_spec.quant.fp8 import FP8_DTYPE

__all__ = ["PAGED_CONTEXT_DEFAULTS", "PAGED_DEFAULTS", "PAGED_VARIANTS", "PagedConfig",
           "context_class", "cuda_cache_ok", "paged_choice", "paged_config", "parse_choice",
           "pick_num_splits_paged", "shape_class", "splits_for"]


@dataclass(frozen=True)
class PagedConfig:
    """Tile config of the paged kernel (``tma``: TMA descriptor loads; ``part_bf16``: bf16
    split partials; ``vsplit`` in {1, 2, 4}: sibling CTAs per row block, each owning
    ``Dv / vsplit`` output columns; ``fused``: the last split program merges the partials,
    no combine launch; ``swap``: the KV tile on the MMA's M side and the query rows on its N
    side, ``mla_decode_swapab``). ``vsplit > 1`` or ``fused`` runs ``mla_decode_vsplit``'s
    kernel."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    tma: bool = False
    part_bf16: bool = False
    vsplit: int = 1
    fused: bool = False
    swap: bool = False
    #: programs resident per SM (the split cost model's wave size)
    ctas_per_sm: int = 1
    #: launched with programmatic dependent launch (``kernels.pdl``)
    pdl: bool = True
    #: the hand-written CUDA kernel (``mla_decode_cuda``; ``num_stages`` bulk-copy stages)
    cuda: bool = False
    #: with ``cuda``: its warpgroup-MMA sibling (``mla_decode_wgmma``, sm_90 only; 64-token
    #: tiles, two stages, 8 consumer warps, ``block_m`` 64, 32 or 16)
    wgmma: bool = False
    #: with ``wgmma``: the split's first tiles into L2 before the PDL wait (as the Triton
    #: kernels' ``L2PF``)
    prefetch: bool = False
    #: with ``wgmma``, 64 rows: the query rows on the MMA's M side
    #: (``csrc/mla_wgmma_rows_sm90.cu``: P V with P from registers, 35% fewer shared-memory
    #: operand bytes per tile than the swapped ``W64``)
    rows_m: bool = False
    #: with ``wgmma``, 32 rows, an e4m3 cache only: Q K as e4m3 MMAs on the tile as it lands
    #: (the queries quantized to e4m3 per row) and V fed to ``wgmma`` from registers, nothing
    #: widened in shared memory (``csrc/mla_wgmma_e4m3_sm90.cu``; the error it adds:
    #: ``quant.fp8.fp8_query_attention_error_bound``)
    e4m3_mma: bool = False
    #: with ``e4m3_mma``: the two consumer warpgroups take turns, each multiplying whole tiles
    #: with its own softmax state (``csrc/mla_wgmma_e4m3pp_sm90.cu``), instead of splitting
    #: every tile between them
    pingpong: bool = False

    def __post_init__(self) -> None:
        if self.swap and (self.vsplit > 1 or self.fused):
            raise ValueError("swap excludes vsplit / fused (different kernels)")
        if self.cuda and (self.swap or self.vsplit > 1 or self.fused or self.tma
                          or self.part_bf16):
            raise ValueError("the CUDA kernel has its own tile (block_m, block_n, warps, "
                             "stages) only")
        if self.wgmma and not (self.cuda and self.block_n == 64 and self.num_warps == 8
                               and self.num_stages == 2 and self.block_m in (16, 32, 64)):
            raise ValueError("wgmma is a CUDA kernel (cuda=True) with block_m 16, 32 or 64, "
                             "block_n 64, 8 (consumer) warps, 2 stages")
        if self.prefetch and not self.wgmma:
            raise ValueError("prefetch is a wgmma option")
        if self.rows_m and not (self.wgmma and self.block_m == 64 and not self.prefetch):
            raise ValueError("rows_m is an option of the 64-row wgmma kernel without prefetch")
        if self.e4m3_mma and not (self.wgmma and self.block_m == 32 and not self.prefetch
                                  and not self.rows_m):
            raise ValueError("e4m3_mma is an option of the 32-row wgmma kernel without "
                             "prefetch (an e4m3 cache only)")
        if self.pingpong and not self.e4m3_mma:
            raise ValueError("pingpong is an option of the e4m3_mma kernel")

    @property
    def tag(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
                f"{'T' if self.tma else 'P'}{'b' if self.part_bf16 else 'f'}"
                f"{f'v{self.vsplit}' if self.vsplit > 1 else ''}{'x' if self.fused else ''}"
                f"{'S' if self.swap else ''}{'K' if self.cuda else ''}"
                f"{'W' if self.wgmma else ''}{'p' if self.prefetch else ''}"
                f"{'R' if self.rows_m else ''}{'E' if self.e4m3_mma else ''}"
                f"{'2' if self.pingpong else ''}")

    @property
    def sibling_kernel(self) -> bool:
        """Whether the V-split / fused-combine kernel (``mla_decode_vsplit``) runs."""
        return self.vsplit > 1 or self.fused


# Named tile configs (the sweep's variant names; ``benchmarks/sweep_mla.py`` times them all).
PAGED_VARIANTS: dict[str, PagedConfig] = {
    "A": PagedConfig(64, 64, 8, 2),
    "C": PagedConfig(64, 64, 8, 2, tma=True),
    "F": PagedConfig(64, 64, 8, 2, part_bf16=True),
    "G": PagedConfig(32, 64, 4, 2),
    "CF": PagedConfig(64, 64, 8, 2, tma=True, part_bf16=True, pdl=False),
    # V-split (mla_decode_vsplit): each CTA owns 512 / vsplit output columns
    "V2": PagedConfig(64, 64, 8, 2, tma=True, vsplit=2),
    "V2b": PagedConfig(64, 64, 8, 2, tma=True, part_bf16=True, vsplit=2),
    "V4": PagedConfig(64, 64, 4, 2, tma=True, vsplit=4),
    "V4w8": PagedConfig(64, 64, 8, 2, tma=True, vsplit=4),
    "G2": PagedConfig(32, 64, 4, 2, vsplit=2),
    # G4 and CF launch without PDL: with it they ran 1.1-1.3x slower at batch 1 and 4k-32k
    # contexts (FP8 KV, H200 sweep, sixth session; the S and C variants gained from it); G4's
    # 4 warps and <= 112 KB of shared memory keep two programs per SM
    "G4": PagedConfig(32, 64, 4, 2, vsplit=4, ctas_per_sm=2, pdl=False),
    "G4b": PagedConfig(32, 64, 4, 2, part_bf16=True, vsplit=4),
    # fused combine (the last split CTA merges the partials: one launch); vsplit 1 / 2 at m32
    # spill at sm_90 (ptxas), so not listed
    "G4x": PagedConfig(32, 64, 4, 2, vsplit=4, fused=True),
    "V4x": PagedConfig(64, 64, 4, 2, tma=True, vsplit=4, fused=True),
    "V4w8x": PagedConfig(64, 64, 8, 2, tma=True, vsplit=4, fused=True),
    "V2bx": PagedConfig(64, 64, 8, 2, tma=True, part_bf16=True, vsplit=2, fused=True),
    # swap AB (mla_decode_swapab): KV tile = MMA M (64 per warpgroup), query rows = MMA N
    "S16": PagedConfig(16, 64, 4, 2, swap=True),
    "S16b": PagedConfig(16, 64, 4, 2, part_bf16=True, swap=True),
    "S32": PagedConfig(32, 64, 8, 2, swap=True),
    "S32T": PagedConfig(32, 64, 8, 2, tma=True, swap=True),
    "S32b": PagedConfig(32, 64, 8, 2, part_bf16=True, swap=True),
    "S32w4": PagedConfig(32, 64, 4, 2, swap=True),
    "S64": PagedConfig(64, 64, 8, 2, swap=True),
    "S64T": PagedConfig(64, 64, 8, 2, tma=True, swap=True),
    # the hand-written CUDA kernel (mla_decode_cuda; bf16 cache, fixed q_len, nvcc on first use)
    "K": PagedConfig(32, 64, 4, 2, cuda=True),
    "K8": PagedConfig(32, 64, 8, 2, cuda=True),
    "Kn32": PagedConfig(32, 32, 4, 4, cuda=True),
    "K16": PagedConfig(16, 64, 4, 2, cuda=True),
    "K16n32": PagedConfig(16, 32, 4, 4, cuda=True),
    "K16n32s2": PagedConfig(16, 32, 4, 2, cuda=True, ctas_per_sm=2),
    # its warpgroup-MMA sibling (mla_decode_wgmma; TMA tiles, sm_90 only)
    "W": PagedConfig(32, 64, 8, 2, cuda=True, wgmma=True),
    "W16": PagedConfig(16, 64, 8, 2, cuda=True, wgmma=True),
    "W64": PagedConfig(64, 64, 8, 2, cuda=True, wgmma=True),
    # the same with the split's first tiles prefetched into L2 before the PDL wait (built and
    # tested on the CPU only so far: not timed, no default names them)
    "Wp": PagedConfig(32, 64, 8, 2, cuda=True, wgmma=True, prefetch=True),
    "W64p": PagedConfig(64, 64, 8, 2, cuda=True, wgmma=True, prefetch=True),
    # 64 rows with the query rows on the MMA's M side (FlashMLA's split of the work)
    "WR": PagedConfig(64, 64, 8, 2, cuda=True, wgmma=True, rows_m=True),
    # an e4m3 cache multiplied as it lands: e4m3 Q K, V from registers (the queries go e4m3)
    "WE": PagedConfig(32, 64, 8, 2, cuda=True, wgmma=True, e4m3_mma=True),
    # the same with the two consumer warpgroups taking turns on whole tiles
    "WE2": PagedConfig(32, 64, 8, 2, cuda=True, wgmma=True, e4m3_mma=True, pingpong=True),
}

# Per-shape winners: (kv class, rows class, batch class) -> "NAME" or "NAME/spN" (``spN`` pins
# the split count; omit it to keep the cost model, which adapts to the context length), or
# alternatives "A|B": the first that runs on the device and call wins (``paged_choice``).
# kv: "bf16" (bf16 / fp16 caches) | "fp8"; rows (= q_len * H per request): "r32" (<= 32) |
# "r128" (<= 128) | "big"; batch: "b1" (bs <= 2) | "b48" (<= 48) | "big".
# Values: winners of the H200 sweeps (docs/bench_mla.md, v2 and v3).
PAGED_DEFAULTS: dict[tuple[str, str, str], str] = {
    **{("bf16", "r32", bc): "G" for bc in ("b1", "b48", "big")},
    **{("bf16", rc, bc): "C" for rc in ("r128", "big") for bc in ("b1", "b48", "big")},
    **{("fp8", rc, bc): "CF" for rc in ("r32", "r128", "big") for bc in ("b1", "b48", "big")},
    # H200 sweep of 2026-11-29 (docs/benchmarks.md): the only shape classes whose winner changed
    ("fp8", "r32", "b1"): "G4",  # 14.9 vs 19.3 µs at bs 1, ctx 4k, in a CUDA graph
    # second H200 sweep (swap AB, docs/bench_mla.md v4): bs 1 ctx 4k in a graph 12.1 vs 14.1 µs
    # (G, still faster at ctx 32k: 31.2 vs 34.6); bs 128 ctx 8k 511 vs 581 µs, bs 64 ctx 32k
    # 961 vs 1066 µs
    ("bf16", "r32", "b1"): "S16",
    # ninth session, the warpgroup-MMA CUDA kernel (docs/bench_mla.md v8; graph µs, FlashInfer
    # in the same run): bs 32 ctx 4k W/sp4 61.8 vs S16/sp2 107.6 (FlashInfer 49.0; 51.4 vs
    # 48.7 with the sized combine); bs 128 ctx 8k 303.8 vs S32w4 514 (281-289); bs 64 ctx 32k
    # W/sp2 627.7 vs 984.7 (658.0). Where W cannot run (not sm_90, no nvcc, ragged rows,
    # fp16), the Triton variant after the "|".
    ("bf16", "r32", "b48"): "W|S16",  # S16: bs 32 ctx 4k 152.7 vs G 175.6 µs (eager)
    ("bf16", "r32", "big"): "W|S32w4",
    # 128 rows (H 128 q 1; H 32 q 4 = TARGET_VERIFY at TP4): W64, two 64-row CTAs per request
    # (C: one per 64 rows too, but Triton's per-tile cost). bs 128 ctx 8k H 128: 730 vs C 1105
    # (FlashInfer 574); H 32 q 4: 762 vs 1128 (567); bs 32 ctx 4k q 4: W64/sp2 103.6 vs C/sp2
    # 152.8 (75.1); bs 64 ctx 32k H 128: 1466 vs 2160 (1192)
    # twelfth session: WR (the query rows on the MMA's M side, P V from registers; W64 runs
    # wherever WR does, so it is no alternative: it stays a variant for comparisons; docs/
    # bench_mla.md v10, FlashInfer in the same run): bs 128 ctx 8k H 128 612-635 vs W64 741-753
    # (FlashInfer 547-557), H 32 q 4 632 vs 748 (565); bs 32 ctx 4k WR/sp2 89.4-90.7 vs W64
    # 102-105 (75); bs 64 ctx 32k 1240-1279 vs 1474-1521 (1184-1208)
    ("bf16", "r128", "b48"): "WR|C",
    ("bf16", "r128", "big"): "WR|C",
    # third H200 sweep (sixth session, bs 1 at ctx 1k / 4k / 32k in a graph, after the split
    # model's combine term): S16 within 1.09x of the best over the class (V2: 1.25x), C 1.00x
    ("bf16", "r128", "b1"): "S16",
    ("fp8", "big", "b1"): "C",
    # tenth session, the wgmma kernels on an e4m3 cache (widened to fp16 in shared memory;
    # docs/bench_mla.md v9, graph µs, FlashInfer's fp8 in the same run): bs 128 ctx 8k W 353
    # vs CF 703 (886.7); bs 64 ctx 32k W/sp2 695 vs 1363 (1826); 128 rows bs 128 ctx 8k W64
    # 855-858 vs 1364-1369 (1742-1779)
    # thirteenth session: WE2, the queries rounded to e4m3 per row (as TRT-LLM-gen's FP8 path
    # does) for e4m3 Q K MMAs, V fed to wgmma from registers, the warpgroups taking turns on
    # whole tiles (docs/bench_mla.md v11; graph µs, FlashInfer's bf16 in the same run): bs 128
    # ctx 8k 189.3 vs W 335.1 (FlashInfer bf16 288.0, fp8 876.4); bs 64 ctx 32k 420.0 vs
    # 661.6 (654.0); bs 32 ctx 4k 41.5 vs 54.0 (49.7). paged_choice(e4m3_queries=False) keeps
    # the queries in fp16 (W).
    ("fp8", "r32", "b48"): "WE2|W|CF",
    ("fp8", "r32", "big"): "WE2|W|CF",
    # twelfth session: WR on an e4m3 cache (both warpgroups widen a tile together; v10): bs
    # 128 ctx 8k H 128 653.9 vs W64 846.3 (FlashInfer fp8 1760.6); H 32 q 4 bs 32 ctx 4k
    # WR/sp2 96.8 vs 125.0 (251.9); bs 64 ctx 32k 1278.2 vs 1611.1 (3586.5)
    ("fp8", "r128", "b48"): "WR|CF",
    ("fp8", "r128", "big"): "WR|CF",
    # twelfth session: more than 128 rows (H 128 q 4, TARGET_VERIFY without tensor
    # parallelism) run W64 with one 64-row block per 64 rows, each streaming the request's KV
    # (the blocks of one request run side by side, so the re-reads mostly hit L2; docs/
    # bench_mla.md v10, graph µs, FlashInfer in the same run): bf16 bs 32 ctx 4k 361-380 vs C
    # 545 (FlashInfer 239), bs 128 ctx 8k 2879 vs 4171 (2104); fp8 bs 32 ctx 4k 441-444 vs CF
    # 687-694 (FlashInfer fp8 909-919), bs 128 ctx 8k 3378 vs 5280 (7116)
    # and WR: bf16 bs 32 ctx 4k 295-299 vs W64 366-368 (FlashInfer 241-246), bs 128
    # ctx 8k 2320 vs 2847 (2049)
    # (fp8 bs 32 ctx 4k: WR 342.0 vs W64 443.5, FlashInfer fp8 916.7)
    **{(kv, "big", bc): alts for kv, alts in (("bf16", "WR|C"), ("fp8", "WR|CF"))
       for bc in ("b48", "big")},
}


# Per-context winners where they differ from the class's: (kv, rows, batch, context) -> choice;
# context: "c2k" (longest KV <= 2048) | "c8k" (<= 8192) | "long". Seventh-session H200 sweeps,
# two runs (docs/bench_mla.md v6; batch 1 in a graph, 128 rows = TARGET_VERIFY at H 32 / DECODE
# at H 128):
PAGED_CONTEXT_DEFAULTS: dict[tuple[str, str, str, str], str] = {
    # 32k: CF 61.9 / 62.5 vs S16 91.8 / 91.1 µs (S16's 8 row blocks each re-read the KV from
    # L2); ninth session: W64/sp64 41.2 vs CF 51.8 (FlashInfer 39.8)
    ("bf16", "r128", "b1", "long"): "WR/sp64|CF",  # twelfth: WR 36.7-36.8 (FI 39.8-40.0)
    # sixteenth session, once WR released a stage before its next Q K (docs/bench_mla.md v14):
    # 4k WR/sp32 16.48-16.50 vs S16/sp16 17.43-17.77 (FlashInfer 19.7-20.2); at 1k S16 stays
    # (9.21 vs WR/sp16 13.27)
    ("bf16", "r128", "b1", "c8k"): "WR/sp32|S16",
    ("fp8", "r128", "b1", "c2k"): "G4",    # 1k: 14.1 vs V2 16.7, CF 20.4 µs
    # 4k: 26.2 / 26.4 vs CF 28.6 / 28.5 µs (32k: CF, 70); tenth session: W64/sp64 21.4 vs G4
    # 25.2 (FlashInfer fp8 43.6)
    ("fp8", "r128", "b1", "c8k"): "WR/sp64|G4",  # twelfth: 4k 18.5 vs W64 19.9
    # eighth session, after the one-round combine (docs/bench_mla.md v7): 64 one-tile splits at
    # 4k, 9.57 vs 11.41 µs at the model's 32 (at 1k the model's 16 stays: 7.44 vs 8.20 at 64)
    ("bf16", "r32", "b1", "c8k"): "S16/sp64",
    # the CUDA kernel's 128 splits at 32k: 28.8 vs S16/sp64 31.0 µs (its split phase 25.0-25.5
    # µs in three runs; the one-round combine of 128 splits measured once); ninth session: the
    # wgmma kernel W/sp128 24.8 vs K 28.2 at 32k (16k: 19.6 vs 18.5)
    ("bf16", "r32", "b1", "long"): "W/sp128|K/sp128",
    # tenth session, an e4m3 cache at 32k (docs/bench_mla.md v9): W/sp128 23.2 vs G4/sp64 43.8
    # (FlashInfer fp8 76.4, bf16 48.2); 128 rows: W64/sp64 44.9 vs CF 60.2 (87.4). The
    # widening of tile i + 1 overlaps tile i's P V: bs 128 ctx 8k 356.6 -> 338.8 µs
    ("fp8", "r32", "b1", "long"): "W/sp128|G4",
    ("fp8", "r128", "b1", "long"): "WR/sp64|CF",  # twelfth: H 32 q 4 36.8 vs 44.4
    # twelfth session, 512 rows at batch 1 (v10): 32k WR/sp16 101.3 vs W64/sp16 120.3-122.4
    # vs C/sp16 148.1 (FlashInfer 73.9-74.6); at 4k C stays (31.8-32.3 vs WR/sp16 41.9, W64/sp8
    # 39.2-39.6; fp8 CF 37.4 vs W64 44.9)
    ("bf16", "big", "b1", "long"): "WR/sp16|C",
    # thirteenth session (v11), 512 rows at batch 1 ctx 4k: bf16 WR/sp16 28.8 vs C 32.0
    # (FlashInfer 25.4), fp8 30.3 vs C 37.3 (FlashInfer fp8 52.9); fourteenth (v12), with bf16
    # partials and the combine's new shapes: bf16 24.0, fp8 25.9 (mla_decode_wgmma.PART_BF16)
    ("bf16", "big", "b1", "c8k"): "WR/sp16|C",
    ("fp8", "big", "b1", "c8k"): "WR/sp16|C",
}


def context_class(max_kv: int) -> str:
    """The context part of a ``PAGED_CONTEXT_DEFAULTS`` key."""
    return "c2k" if max_kv <= 2048 else "c8k" if max_kv <= 8192 else "long"


def shape_class(rows: int, kv_dtype: torch.dtype, bs: int) -> tuple[str, str, str]:
    """The ``PAGED_DEFAULTS`` key of a shape (``rows`` = q_len * H per request)."""
    kv = "fp8" if kv_dtype == FP8_DTYPE else "bf16"
    rc = "r32" if rows <= 32 else "r128" if rows <= 128 else "big"
    bc = "b1" if bs <= 2 else "b48" if bs <= 48 else "big"
    return kv, rc, bc


def parse_choice(choice: str) -> tuple[PagedConfig, int | None]:
    """``"NAME"`` or ``"NAME/spN"`` -> (config, pinned split count or None)."""
    name, _, sp = choice.partition("/sp")
    if name not in PAGED_VARIANTS:
        raise ValueError(f"unknown paged variant {name!r}: one of {', '.join(PAGED_VARIANTS)}")
    return PAGED_VARIANTS[name], (int(sp) if sp else None)


def cuda_cache_ok(cfg: PagedConfig, kv_dtype: torch.dtype) -> bool:
    """Whether a CUDA variant takes this cache dtype: bf16 all but ``e4m3_mma``, fp8 e4m3 the
    wgmma kernels without prefetch (``mla_decode_wgmma.WGMMA_FP8_BLOCK_M``, ``WR``, ``WE``)."""
    if cfg.e4m3_mma:
        return kv_dtype == FP8_DTYPE
    return kv_dtype == torch.bfloat16 or (kv_dtype == FP8_DTYPE and cfg.wgmma
                                          and not cfg.prefetch)


def _runs_here(cfg: PagedConfig, kv_dtype: torch.dtype, device: torch.device,
               fixed: bool, e4m3_queries: bool = True) -> bool:
    """Whether a table entry's variant runs on ``device`` for this call: the Triton ones
    always; a CUDA one (``K*`` / ``W*``) with fixed rows, a cache it takes
    (:func:`cuda_cache_ok`), nvcc and sm_90+ (``cuda_kernels_available``), ``wgmma`` on
    exactly sm_90; an ``e4m3_mma`` one only when the caller lets the queries go e4m3."""
    if not cfg.cuda:
        return True
    return (fixed and cuda_cache_ok(cfg, kv_dtype) and cuda_kernels_available(device) is None
            and (not cfg.wgmma or cuda_capability(device) == (9, 0))
            and (e4m3_queries or not cfg.e4m3_mma))


def _first_runnable(entry: str, kv_dtype, device, fixed,
                    e4m3_queries=True) -> tuple[PagedConfig, int | None] | None:
    for alt in entry.split("|"):
        cfg, pin = parse_choice(alt)
        if _runs_here(cfg, kv_dtype, device, fixed, e4m3_queries):
            return cfg, pin
    return None


def paged_choice(rows: int, kv_dtype: torch.dtype, device: torch.device, page_size: int = 64,
                 bs: int = 1, max_kv: int | None = None, fixed: bool = True,
                 e4m3_queries: bool = True) -> tuple[PagedConfig, int | None]:
    """(config, pinned splits or None) of a shape: on CUDA when the page size is a multiple of
    64, ``PAGED_CONTEXT_DEFAULTS`` (when ``max_kv``, the longest KV, is given) then
    ``PAGED_DEFAULTS``; fixed fallbacks otherwise (tiny tiles under the interpreter). Under a
    CUDA graph the capture's ``max_kv`` decides for every replay. A table entry may list
    alternatives, ``"W|S32w4"``: the first that runs here wins (:func:`_runs_here`: the CUDA
    kernels need fixed rows, a bf16 cache, nvcc, sm_90); a context entry none of whose
    alternatives runs gives way to the class entry. ``e4m3_queries=False`` passes over the
    kernels that round the queries to e4m3 for e4m3 MMAs (``WE*``, an FP8 cache only: the
    error they add is in ``quant.fp8.fp8_query_attention_error_bound``)."""
    if device.type != "cuda":
        return PagedConfig(16, min(8, page_size), 4, 1), None
    if page_size % 64:
        return PagedConfig(64, 32, 8, 3, tma=True, part_bf16=kv_dtype == FP8_DTYPE), None
    key = shape_class(rows, kv_dtype, bs)
    if max_kv is not None:
        by_ctx = PAGED_CONTEXT_DEFAULTS.get((*key, context_class(max_kv)))
        got = by_ctx and _first_runnable(by_ctx, kv_dtype, device, fixed, e4m3_queries)
        if got:
            return got
    entry = PAGED_DEFAULTS[key]
    got = _first_runnable(entry, kv_dtype, device, fixed, e4m3_queries)
    if got is None:
        raise ValueError(f"PAGED_DEFAULTS[{key}] = {entry!r} lists no variant that runs here; "
                         "end it with a Triton variant")
    return got


def paged_config(rows: int, kv_dtype: torch.dtype, device: torch.device,
                 page_size: int = 64, bs: int = 1, max_kv: int | None = None) -> PagedConfig:
    """Default tile per device / KV dtype / rows per request / batch / context
    (:func:`paged_choice`)."""
    return paged_choice(rows, kv_dtype, device, page_size, bs, max_kv)[0]


@functools.lru_cache(maxsize=4096)  # ~70 µs of host time per eager call at bs 32 otherwise
def pick_num_splits_paged(bs: int, m_blocks: int, max_kv: int, block_n: int, rows: int,
                          kv_row_bytes: int, num_sms: int = 132, part_bytes: int = 4,
                          dv: int = 512, ctas_per_sm: int = 1, max_splits: int = 128,
                          fixed_tiles: float = 1.0, vsplit: int = 1, fused: bool = False,
                          combine_per_split: float = 1.0 / 16) -> int:
    """Splits minimizing ``waves(s) * (tiles/s + fixed + partial cost)`` (in KV-tile units).

    A split's partial ``[rows, dv / vsplit]`` is written once and read once by the combine; a
    wave is ``num_sms * ctas_per_sm`` programs (``vsplit`` siblings per row block). The
    separate combine costs one launch plus ``combine_per_split`` per split (its rounds over
    the partials, and every split's own query load: measured at batch 1 on the H200, sixth
    session, 16 splits won at 16 tiles, 32 at 64 and 64 at 512, where the model without it
    took 64 at 64 tiles and ran 1.6x slower), the fused one a serial merge of ``s`` partials in
    one program. Uniform lengths are assumed (``max_kv`` for all).
    """
    tiles = -(-max(int(max_kv), 1) // block_n)
    tile_bytes = block_n * kv_row_bytes
    part = 2.0 * min(rows, 64) * dv / vsplit * part_bytes / tile_bytes
    slots = num_sms * ctas_per_sm
    best, best_cost = 1, None
    for s in range(1, min(tiles, max_splits) + 1):
        progs = max(bs * m_blocks * vsplit, 1) * s
        waves = -(-progs // slots)
        cost = waves * (-(-tiles // s) + fixed_tiles + (part if s > 1 else 0.0))
        if s > 1:  # the combine launch, or the fused merge (reads s partials serially)
            cost += s * part / 2.0 if fused else 1.0 + s * combine_per_split
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


def splits_for(cfg: PagedConfig, bs: int, m_blocks: int, max_kv: int, rows: int,
               kv_row_bytes: int, num_sms: int = 132, dv: int = 512) -> int:
    """:func:`pick_num_splits_paged` with the variant's own partial dtype, V-split, fused
    combine and programs per SM."""
    return pick_num_splits_paged(bs, m_blocks, max_kv, cfg.block_n, rows, kv_row_bytes, num_sms,
                                 2 if cfg.part_bf16 else 4, dv, ctas_per_sm=cfg.ctas_per_sm,
                                 vsplit=cfg.vsplit, fused=cfg.fused)
