"""Tile configs of the paged MLA kernels, the choice of one per shape, and the split model.

``PagedConfig`` names one compiled variant of ``mla_decode_paged`` (or, with ``vsplit > 1`` /
``fused``, of its sibling kernel in ``mla_decode_vsplit``). ``PAGED_VARIANTS`` gives the
variants the names that ``benchmarks/sweep_mla.py`` prints; the measured per-shape winners
(``PAGED_DEFAULTS``, ``PAGED_CONTEXT_DEFAULTS``) live in ``mla_decode_defaults`` and are
re-exported here; :func:`paged_choice` reads them. :func:`pick_num_splits_paged` is the
KV-split cost model used when no split count is pinned.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mla_spec.device import cuda_capability
from mla_spec.kernels.launch.cuda_driver import cuda_kernels_available
from mla_spec.kernels.mla_decode_defaults import PAGED_CONTEXT_DEFAULTS, PAGED_DEFAULTS
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
    #: with ``pingpong``: P V as e4m3 MMAs too (P rounded to e4m3 after scaling by 256, V^T
    #: fragments by ``ldmatrix .trans`` and one ``prmt`` a register, no conversion to fp16;
    #: the error it adds: ``quant.fp8.fp8_probability_attention_error_bound``)
    e4m3_pv: bool = False

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
        if self.e4m3_pv and not self.pingpong:
            raise ValueError("e4m3_pv is an option of the pingpong (WE2) kernel")

    @property
    def tag(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
                f"{'T' if self.tma else 'P'}{'b' if self.part_bf16 else 'f'}"
                f"{f'v{self.vsplit}' if self.vsplit > 1 else ''}{'x' if self.fused else ''}"
                f"{'S' if self.swap else ''}{'K' if self.cuda else ''}"
                f"{'W' if self.wgmma else ''}{'p' if self.prefetch else ''}"
                f"{'R' if self.rows_m else ''}{'E' if self.e4m3_mma else ''}"
                f"{'2' if self.pingpong else ''}{'8' if self.e4m3_pv else ''}")

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
    # the same with P V in e4m3 as well (P rounded to e4m3, as TRT-LLM-gen's FP8 path does)
    "WE8": PagedConfig(32, 64, 8, 2, cuda=True, wgmma=True, e4m3_mma=True, pingpong=True,
                       e4m3_pv=True),
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
               fixed: bool, e4m3_queries: bool = True, e4m3_probs: bool = True) -> bool:
    """Whether a table entry's variant runs on ``device`` for this call: the Triton ones
    always; a CUDA one (``K*`` / ``W*``) with fixed rows, a cache it takes
    (:func:`cuda_cache_ok`), nvcc and sm_90+ (``cuda_kernels_available``), ``wgmma`` on
    exactly sm_90; an ``e4m3_mma`` one only when the caller lets the queries go e4m3, an
    ``e4m3_pv`` one only when it lets the softmax weights go e4m3 too."""
    if not cfg.cuda:
        return True
    return (fixed and cuda_cache_ok(cfg, kv_dtype) and cuda_kernels_available(device) is None
            and (not cfg.wgmma or cuda_capability(device) == (9, 0))
            and (e4m3_queries or not cfg.e4m3_mma) and (e4m3_probs or not cfg.e4m3_pv))


def _first_runnable(entry: str, kv_dtype, device, fixed, e4m3_queries=True,
                    e4m3_probs=True) -> tuple[PagedConfig, int | None] | None:
    for alt in entry.split("|"):
        cfg, pin = parse_choice(alt)
        if _runs_here(cfg, kv_dtype, device, fixed, e4m3_queries, e4m3_probs):
            return cfg, pin
    return None


def paged_choice(rows: int, kv_dtype: torch.dtype, device: torch.device, page_size: int = 64,
                 bs: int = 1, max_kv: int | None = None, fixed: bool = True,
                 e4m3_queries: bool = True,
                 e4m3_probs: bool = True) -> tuple[PagedConfig, int | None]:
    """(config, pinned splits or None) of a shape: on CUDA when the page size is a multiple of
    64, ``PAGED_CONTEXT_DEFAULTS`` (when ``max_kv``, the longest KV, is given) then
    ``PAGED_DEFAULTS``; fixed fallbacks otherwise (tiny tiles under the interpreter). Under a
    CUDA graph the capture's ``max_kv`` decides for every replay. A table entry may list
    alternatives, ``"W|S32w4"``: the first that runs here wins (:func:`_runs_here`: the CUDA
    kernels need fixed rows, a bf16 cache, nvcc, sm_90); a context entry none of whose
    alternatives runs gives way to the class entry. ``e4m3_queries=False`` passes over the
    kernels that round the queries to e4m3 for e4m3 MMAs (``WE*``, an FP8 cache only: the
    error they add is in ``quant.fp8.fp8_query_attention_error_bound``); ``e4m3_probs=False``
    over those that round the softmax weights to e4m3 for e4m3 P V MMAs (``WE8``:
    ``quant.fp8.fp8_probability_attention_error_bound``)."""
    if device.type != "cuda":
        return PagedConfig(16, min(8, page_size), 4, 1), None
    if page_size % 64:
        return PagedConfig(64, 32, 8, 3, tma=True, part_bf16=kv_dtype == FP8_DTYPE), None
    key = shape_class(rows, kv_dtype, bs)
    if max_kv is not None:
        by_ctx = PAGED_CONTEXT_DEFAULTS.get((*key, context_class(max_kv)))
        got = by_ctx and _first_runnable(by_ctx, kv_dtype, device, fixed, e4m3_queries,
                                         e4m3_probs)
        if got:
            return got
    entry = PAGED_DEFAULTS[key]
    got = _first_runnable(entry, kv_dtype, device, fixed, e4m3_queries, e4m3_probs)
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
