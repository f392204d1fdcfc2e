"""Launcher of the Hopper warpgroup-MMA split-KV MLA kernels (``csrc/mla_wgmma_sm90.cu``,
``csrc/mla_wgmma64_sm90.cu``, ``csrc/mla_wgmma_rows_sm90.cu``).

Same contract and result as :func:`mla_spec.kernels.mla_decode_paged.mla_decode_paged` for
the shapes it takes: fixed ``q_len`` (DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2), a contiguous
bf16 or FP8 e4m3 cache ``[slots, 576]`` whose page size is a multiple of 64 (one KV tile = 64
consecutive slots of one page, fetched by TMA), Dv 512 / Dpe 64, bf16 queries with 16-byte
aligned rows, an sm_90 GPU (``wgmma`` exists on Hopper only). An e4m3 tile is widened to fp16
in shared memory and multiplied in fp16 with the queries rounded to fp16 (``csrc/sm90_fp8.cuh``
says why). 64, 32 or 16 query rows per CTA; more rows
per request run more row blocks, each streaming the KV. Splits merge through the CUDA combine
where it is the faster one (``mla_decode_combine_cuda``; ``COMBINE_CUDA``), else the Triton
one; ``W`` can also merge them inside its own grid (``GRID_MERGE``, off: 1-2% faster,
:func:`grid_merges`, ``csrc/sm90_grid_merge.cuh``).
``rows_m`` (variant ``WR``, ``csrc/mla_wgmma_rows_sm90.cu``): 64 rows on the MMA's M side
instead of N, P V with P from registers. ``e4m3_mma`` (variant ``WE``,
``csrc/mla_wgmma_e4m3_sm90.cu``, an e4m3 cache, 32 rows): Q K in e4m3 MMAs straight from the
tile with the queries quantized to e4m3 per row (``quant.fp8.quantize_rows_e4m3``), V fed to
``wgmma`` from registers; nothing is widened in shared memory. ``pingpong`` (``WE2``,
``csrc/mla_wgmma_e4m3pp_sm90.cu``): the same with the two consumer warpgroups taking turns on
whole tiles; ``e4m3_pv`` (``WE8``, the same source) with P V as e4m3 MMAs as well.

Why it exists: see the ``.cu`` files' headers. Its torch twin is ``mla_decode_ref``
(``tests/kernels/test_mla_decode_cuda.py`` runs every ``cuda`` variant against it on the GPU).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, fields

import torch

from mla_spec.device import cuda_capability, env_flag, sm_count
from mla_spec.kernels.launch.arrival import arrival_counters
from mla_spec.kernels.launch.cuda_driver import CudaKernel, tensor_map_2d
from mla_spec.kernels.mla_decode_combine import combine_splits
from mla_spec.kernels.mla_decode_combine_cuda import combine_splits_fast
from mla_spec.kernels.mla_decode_cuda import _Params, call_supported, split_params
from mla_spec.kernels.launch.pdl import pdl_on
from mla_spec.quant.fp8 import FP8_DTYPE

__all__ = ["WgmmaKind", "WGMMA_BLOCK_M", "WGMMA_FP8_BLOCK_M", "WGMMA_KERNELS", "clusters_splits",
           "grid_merges", "launch_wgmma_mla", "wgmma_mla_supported", "wgmma_smem"]

_BN, _STAGES, _DV = 64, 2, 512
#: rows per CTA -> (source, threads): 32 / 16 rows split the QK depth between the two consumer
#: warpgroups (``mla_wgmma_sm90.cu``, a producer warp), 64 rows split the rows
#: (``mla_wgmma64_sm90.cu``, a producer warpgroup); keep in sync with the sources' kernels
_SOURCES = {32: ("mla_wgmma_sm90.cu", 288), 16: ("mla_wgmma_sm90.cu", 288),
            64: ("mla_wgmma64_sm90.cu", 384)}
WGMMA_BLOCK_M = tuple(_SOURCES)
#: (rows per CTA, l2 prefetch) pairs compiled for a bf16 cache: ``prefetch`` puts the split's
#: first tiles into L2 before the PDL wait (suffix ``p``; no default takes it: slower at every
#: shape measured, and the tiles it asks for still arrive at the HBM pace, docs/bench_mla.md v18)
WGMMA_KERNELS = ((32, False), (16, False), (64, False), (32, True), (64, True))
#: rows per CTA compiled for an e4m3 cache (suffix ``_f8``; no prefetch)
WGMMA_FP8_BLOCK_M = (32, 16, 64)
#: (rows per CTA, e4m3 MMAs) of the kernels that write their split partials in bf16 (half the
#: bytes written and combined; one more rounding of the bf16 result's inputs). Fourteenth
#: session, once the combine took whole rows on 2 warps for bf16 (mla_decode_combine;
#: benchmarks/sweep_split_partials.py, docs/bench_mla.md v12): WE2 bs 32 ctx 4k 37.5 -> 34.1 µs;
#: W bs 32 ctx 4k 50.5-51.0 -> 48.0-48.1, batch 1 ctx 32k 22.3 -> 21.0; WR 512 rows batch 1
#: ctx 4k fp8 27.7 -> 25.9, bf16 26.3 -> 24.0. (The 16-row W16, no default, keeps fp32.)
PART_BF16 = frozenset({(64, False), (32, True), (32, False)})
# keys: (rows per CTA, prefetch, e4m3 cache, rows on M: WR, e4m3 MMAs: WE, ping-pong: WE2,
# e4m3 P V: WE8)
_KERNELS = {(bm, pf, False, False, False, False, False): CudaKernel(_SOURCES[bm][0],
                                                      f"mla_wgmma_m{bm}{'p' if pf else ''}",
                                                      arch="sm_90a") for bm, pf in WGMMA_KERNELS}
_KERNELS.update({(bm, False, True, False, False, False, False): CudaKernel(_SOURCES[bm][0],
                                                             f"mla_wgmma_m{bm}_f8", arch="sm_90a")
                 for bm in WGMMA_FP8_BLOCK_M})
#: the 64-row kernel with the query rows on the MMA's M side (bf16 or e4m3 cache, no prefetch)
_ROWS_SOURCE = "mla_wgmma_rows_sm90.cu"
_KERNELS.update({(64, False, f8, True, False, False, False): CudaKernel(
    _ROWS_SOURCE, f"mla_wgmma_rows64{'_f8' if f8 else ''}", arch="sm_90a") for f8 in (False, True)})
#: WR with the two splits of a (request, row block) as one thread-block cluster that merges
#: them in distributed shared memory (``CLUSTER`` in the source): no split partials, no combine
#: kernel. Keys as ``_KERNELS``'; taken at exactly 2 splits (:func:`clusters_splits`)
_CLUSTER_KERNELS = {(64, False, f8, True, False, False, False): CudaKernel(
    _ROWS_SOURCE, f"mla_wgmma_rows64{'_f8' if f8 else ''}_cl", arch="sm_90a")
    for f8 in (False, True)}
#: False: every split count runs the combine kernel (benchmarks compare the two)
CLUSTER_MERGE = True
#: The splits merge in the CUDA combine where it measured faster (``mla_decode_combine_cuda.
#: combine_splits_fast``: 64 splits and more, or 16 over 512 rows); False: always the Triton one
#: (benchmarks compare the two)
COMBINE_CUDA = True
#: The kernels that merge their splits inside the grid when the launcher passes barrier counters
#: (``csrc/sm90_grid_merge.cuh``): ``W`` (``mla_wgmma_sm90.cu``), bf16 or e4m3 cache
_MERGE_KEYS = frozenset(k for k, v in _KERNELS.items() if v.src.name == _SOURCES[32][0])
#: True: ``W`` merges its splits inside its grid where :func:`grid_merges` allows. Off: at
#: batch 1 (128 splits) it measured 1-2% faster than the CUDA combine (ctx 32k 19.03-19.09 vs
#: 19.23-19.44 µs, 16k 13.86 vs 14.17; H200, ``benchmarks/ab_csrc.py --merge``,
#: docs/bench_mla.md v17), too little for a barrier that needs every CTA of the grid resident
#: at once: under MPS or a green context that holds fewer SMs than the device reports, its
#: CTAs would wait for ones that cannot start (the kernel traps after ~4 s)
GRID_MERGE = False
#: Tiles a split CTA loads into shared memory before its PDL wait when a call asks for it
#: (``launch_wgmma_mla(early_kv=True)``, ``produce_early`` in ``csrc/sm90_wgmma.cuh``). One: the
#: first stage only; all the stages measured slower than none (the flood of loads slowed the
#: previous call's combine; H200, ``benchmarks/ab_csrc.py --early``, docs/bench_mla.md v19).
EARLY_KV_TILES = 1
#: ... and only at this many splits or more (batch 1 at long contexts), where it measured
#: 1.4-5.4% faster (bf16 ctx 16k / 32k, fp8 16k / 32k, 128 splits); with fewer it measured
#: +0.4-3.5% (fp8 batch 1 ctx 4k at 32 splits, bs 32 ctx 4k at 4, bs 128 ctx 1k at 1)
EARLY_KV_MIN_SPLITS = 64
#: The calls' default for ``early_kv`` (``MLA_SPEC_EARLY_KV=1`` turns it on at import): off, as
#: it is sound only under a contract the kernel cannot check in full (see ``launch_wgmma_mla``)
EARLY_KV = env_flag("MLA_SPEC_EARLY_KV", False)
#: the most 16-chunk passes a CTA's share of the merge may take (:func:`grid_merges`)
MERGE_MAX_PASSES = 2
#: the 32-row kernels with e4m3 Q K MMAs and V from registers (an e4m3 cache only): 288
#: threads, or 384 taking turns (a producer warpgroup)
_E4M3_SOURCE, _E4M3PP_SOURCE = "mla_wgmma_e4m3_sm90.cu", "mla_wgmma_e4m3pp_sm90.cu"
_KERNELS[(32, False, True, False, True, False, False)] = CudaKernel(
    _E4M3_SOURCE, "mla_wgmma_e4m3_m32", arch="sm_90a")
_KERNELS.update({(32, False, True, False, True, True, pv8): CudaKernel(
    _E4M3PP_SOURCE, f"mla_wgmma_e4m3pp{'8' if pv8 else ''}_m32", arch="sm_90a")
    for pv8 in (False, True)})
#: The builds that load a CTA's first KV tile before the PDL wait (suffix ``_ek``, keys as
#: ``_KERNELS``'; ``launch_wgmma_mla(early_kv=True)``): the batch-1 defaults ``W`` (bf16 or e4m3
#: cache) and ``WE2`` / ``WE8``. Other kernels ignore ``early_kv``.
_EARLY_KERNELS = {k: CudaKernel(v.src.name, v.name + "_ek", arch="sm_90a")
                  for k, v in _KERNELS.items()
                  if v.name in ("mla_wgmma_m32", "mla_wgmma_m32_f8", "mla_wgmma_e4m3pp_m32",
                                "mla_wgmma_e4m3pp8_m32")}
#: its stages (40 KB each: five 128-dim boxes of 64 tokens' bytes)
_E4M3_STAGES, _E4M3_TILE = 4, 5 * _BN * 128


#: the stage barriers' room: a "full" barrier per box group (``W``'s ``W_GROUPS``, at most the
#: tile's nine boxes) and an "empty" one per stage
_MAX_BOX_GROUPS = 9


def wgmma_smem(block_m: int, rows_m: bool = False, e4m3_mma: bool = False,
               pingpong: bool = False) -> int:
    """Dynamic shared memory of one CTA (as laid out in the ``.cu`` files): 1 KB of alignment
    slack, the KV stages, the queries, P^T (P with ``rows_m``), then the S^T exchange (16 / 32
    rows) or the per-row rescale factors (64), the reductions, the stage barriers."""
    if pingpong:  # four 40 KB stages, e4m3 queries, two P^T, maxima and sums of both groups
        return (1024 + _E4M3_STAGES * _E4M3_TILE + 5 * block_m * 128 + 2 * block_m * 128
                + (8 * block_m + 4 * block_m) * 4 + 16 * _E4M3_STAGES)
    if e4m3_mma:  # four 40 KB stages, e4m3 queries in five 128-byte boxes, the row amaxes
        return (1024 + _E4M3_STAGES * _E4M3_TILE + 5 * block_m * 128 + block_m * 128
                + 2 * (block_m // 2) * 128 * 4 + 8 * block_m * 4 + 2 * block_m * 4
                + 16 * _E4M3_STAGES)
    base = (1024 + _STAGES * 9 * _BN * 128 + 9 * block_m * 128 + block_m * 128
            + 8 * _STAGES * (_MAX_BOX_GROUPS + 1))
    if rows_m:
        return base + 2 * block_m * 4
    if block_m == 64:
        return base + 8 * 32 * 4 + 2 * block_m * 4
    return base + 2 * (block_m // 2) * 128 * 4 + 8 * block_m * 4 + 2 * block_m * 4


class _WgParams(ctypes.Structure):
    """``WgParams`` of ``csrc/sm90_wgmma.cuh``: the split kernels' parameters, the cache's
    TMA descriptor, the merge's barrier counters or null (64-byte aligned: 384 bytes)."""

    _fields_ = [("m", _Params), ("kv_map", ctypes.c_ubyte * 128), ("merge", ctypes.c_void_p),
                ("early_kv", ctypes.c_int), ("pad", ctypes.c_ubyte * 52)]


_MAPS: dict[tuple[int, int, int, bool, bool], bytes] = {}


def _tensor_map(kv_flat: torch.Tensor, e4m3_mma: bool = False) -> bytes:
    """The cache's TMA descriptor (it depends on the address, the slot count, the dtype and
    the kernel's box only: the row length and contiguity are checked before): boxes of [64
    tokens, 64 dims], 128-byte swizzled for bf16, packed bytes for e4m3
    (``csrc/sm90_fp8.cuh``); ``e4m3_mma``: [64 tokens, 128 dims] of e4m3, 128-byte swizzled."""
    fp8 = kv_flat.dtype == FP8_DTYPE
    key = (kv_flat.data_ptr(), kv_flat.shape[0], kv_flat.device.index or 0, fp8, e4m3_mma)
    got = _MAPS.get(key)
    if got is None:
        if len(_MAPS) >= 512:  # a pool per layer (61 in DeepSeek-V3, the MTP layer's too)
            _MAPS.clear()
        raw = kv_flat.view(torch.uint8) if fp8 else kv_flat
        got = _MAPS[key] = (tensor_map_2d(raw, 128, _BN) if e4m3_mma else
                            tensor_map_2d(raw, 64, _BN, swizzle=False) if fp8 else
                            tensor_map_2d(raw, 64, _BN))
    return got


@dataclass(frozen=True)
class WgmmaKind:
    """Which wgmma kernel a call runs: the fields of ``mla_decode_tiles.PagedConfig`` that pick
    one (:meth:`of` takes them from a config), so that a new variant flag is added here and in
    the config, not to every launcher signature. With the cache's dtype it names a compiled
    kernel (:meth:`key`, the keys of ``_KERNELS``)."""

    block_m: int = 32
    prefetch: bool = False
    rows_m: bool = False
    e4m3_mma: bool = False
    pingpong: bool = False
    e4m3_pv: bool = False

    @classmethod
    def of(cls, cfg) -> WgmmaKind:
        """The kind of a ``PagedConfig`` (or of anything with these fields)."""
        return cfg if isinstance(cfg, cls) else cls(**{f.name: getattr(cfg, f.name)
                                                       for f in fields(cls)})

    def key(self, kv_dtype: torch.dtype) -> tuple:
        return (self.block_m, self.prefetch, kv_dtype == FP8_DTYPE, self.rows_m, self.e4m3_mma,
                self.pingpong, self.e4m3_pv)

    @property
    def threads(self) -> int:
        """Threads a CTA: 8 consumer warps and a producer warp (a warpgroup for the 64-row and
        ping-pong kernels, which hand registers over with setmaxnreg)."""
        return 384 if self.pingpong else _SOURCES[self.block_m][1]

    @property
    def smem(self) -> int:
        return wgmma_smem(self.block_m, self.rows_m, self.e4m3_mma, self.pingpong)


def wgmma_mla_supported(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_flat: torch.Tensor,
                        page_size: int, q_len: int | None, kind) -> str | None:
    """None when the wgmma kernel of ``kind`` (a :class:`WgmmaKind` or a ``PagedConfig``) takes
    this call, else why not (the caller falls back)."""
    kind = WgmmaKind.of(kind)
    if kind.key(kv_flat.dtype) not in _KERNELS:
        return f"{kind} is not " \
               f"compiled for a {kv_flat.dtype} cache (bf16: (block_m, prefetch) one of " \
               f"{WGMMA_KERNELS}, or rows_m with 64 rows; e4m3: block_m one of " \
               f"{WGMMA_FP8_BLOCK_M}, no prefetch, rows_m with 64 rows, or e4m3_mma with 32, " \
               f"then pingpong, then e4m3_pv)"
    why = call_supported(q_nope, q_pe, kv_flat, page_size, _BN, q_len, "wgmma kernel",
                         (torch.bfloat16, FP8_DTYPE))
    if why is None and cuda_capability(q_nope.device) != (9, 0):
        return "the wgmma kernel needs sm_90 (Hopper): wgmma does not exist elsewhere"
    return why


def launch_wgmma_mla(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, out, lse,
                     qk_scale_log2: float, v_scale: float, *, q_len: int, m_blocks: int,
                     num_splits: int, kind, early_kv: bool | None = None) -> None:
    """Run the split kernel of ``kind`` (a :class:`WgmmaKind` or a ``PagedConfig``; and the
    combine when ``num_splits > 1``, unless its splits merge in a cluster,
    :func:`clusters_splits`, or inside the grid, :func:`grid_merges`) into ``out`` / ``lse`` (see
    :func:`mla_spec.kernels.mla_decode_paged.mla_decode_paged` for the arguments).

    ``early_kv`` (default :data:`EARLY_KV`): each split CTA of the kernels that have such a
    build (``_EARLY_KERNELS``; the others ignore it), at :data:`EARLY_KV_MIN_SPLITS` splits or
    more, loads its first :data:`EARLY_KV_TILES` KV tiles before its PDL wait, while the kernel
    ahead of it still runs (never a tile holding one of a request's last ``q_len`` rows). Only
    for a caller that knows that ``kv_lens``, ``req_pool_indices``, ``req_to_token`` and every
    other KV row were written before that kernel began, as in a decode step, whose store writes
    just the step's rows. The kernel reads the tiles' slots again after the wait and traps (a
    CUDA error) if they moved; rows rewritten in place cannot be seen."""
    kind = WgmmaKind.of(kind)
    if out.dtype != torch.bfloat16 or out.stride(-1) != 1 or out.stride(0) % 4 or \
            out.stride(1) % 4 or out.data_ptr() % 8:
        raise ValueError("the wgmma kernel writes a bf16 out with contiguous, 8-byte aligned "
                         "rows")
    key = kind.key(kv_flat.dtype)
    cluster = clusters_splits(key, num_splits)
    groups = m_blocks * req_pool_indices.numel()
    merge = grid_merges(key, num_splits, num_splits * groups,
                        min(kind.block_m, q_len * q_nope.shape[1]), q_nope.device)
    m, part, part_lse = split_params(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices,
                                     kv_lens, out, lse, qk_scale_log2, v_scale, q_len,
                                     num_splits,
                                     part_bf16=(kind.block_m, kind.e4m3_mma) in PART_BF16,
                                     partials=not cluster)
    p = _WgParams(m)
    ctypes.memmove(p.kv_map, _tensor_map(kv_flat, kind.e4m3_mma), 128)
    if merge:
        p.merge = arrival_counters(groups, q_nope.device).data_ptr()
    early = (EARLY_KV if early_kv is None else early_kv) and key in _EARLY_KERNELS \
        and not cluster and num_splits >= EARLY_KV_MIN_SPLITS
    p.early_kv = EARLY_KV_TILES if early else 0
    (_CLUSTER_KERNELS if cluster else _EARLY_KERNELS if early else _KERNELS)[key](
        (num_splits, m_blocks, req_pool_indices.numel()), kind.threads, kind.smem, p,
        q_nope.device, pdl=pdl_on(q_nope), cluster=num_splits if cluster else 1)
    if num_splits > 1 and not cluster and not merge:
        (combine_splits_fast if COMBINE_CUDA else combine_splits)(part, part_lse, out, lse)


def clusters_splits(key, num_splits: int) -> bool:
    """True when kernel ``key`` (of ``_KERNELS``) runs its ``num_splits`` splits as clusters
    that merge them itself (``WR`` at 2 splits)."""
    return CLUSTER_MERGE and num_splits == 2 and key in _CLUSTER_KERNELS


def grid_merges(key, num_splits: int, ctas: int, block_rows: int, device: torch.device) -> bool:
    """True when kernel ``key`` (of ``_KERNELS``) merges its ``num_splits`` splits inside its
    grid of ``ctas`` CTAs (``csrc/sm90_grid_merge.cuh``) rather than in a combine kernel:
    ``W``, when every CTA fits on the GPU at once (one CTA an SM: ~150-210 KB of shared memory
    each), as the splits wait for each other at a barrier, and when each CTA's share of a row
    block of ``block_rows`` rows is at most ``MERGE_MAX_PASSES`` passes of 16 chunks of 8
    columns (each pass is a round trip to L2: many splits, e.g. 128 at batch 1 ctx 32k)."""
    if not (GRID_MERGE and num_splits > 1 and key in _MERGE_KEYS):
        return False
    per_cta = -(-block_rows * (_DV // 8) // num_splits)
    return -(-per_cta // 16) <= MERGE_MAX_PASSES and ctas <= sm_count(device)
