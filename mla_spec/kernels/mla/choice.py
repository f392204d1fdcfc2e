"""Which MLA kernel runs a call and with how many KV splits: tile configs, named variants, measured
per-shape defaults (``benchmarks/sweep_mla.py``), :func:`paged_choice` and the split heuristics.
"""

import functools
from dataclasses import dataclass

import torch

from mla_spec.device import cuda_capability
from mla_spec.kernels.launch.cuda_driver import cuda_kernels_available
from mla_spec.quant.fp8 import FP8_DTYPE

__all__ = ["PAGED_CONTEXT_DEFAULTS", "PAGED_DEFAULTS", "PAGED_VARIANTS", "VARIANTS",
           "PagedConfig", "context_class", "cuda_cache_ok", "paged_choice", "paged_config",
           "parse_choice", "pick_num_splits", "pick_num_splits_paged", "shape_class",
           "splits_for", "variant_name"]


@dataclass(frozen=True)
class PagedConfig:
    """One kernel of ``mla_decode_paged``: ``block_m`` rows by ``block_n`` KV tokens, warps, stages,
    Triton options, or ``cuda`` (``sm90_mma``; ``wgmma``: ``sm90_wgmma``, ``e4m3_mma`` / ``e4m3_pv``
    as bounded by ``quant.fp8``). Kernels and names: docs/bench_mla.md."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    tma: bool = False
    part_bf16: bool = False
    vsplit: int = 1
    swap: bool = False
    ctas_per_sm: int = 1
    pdl: bool = True
    cuda: bool = False
    wgmma: bool = False
    rows_m: bool = False
    e4m3_mma: bool = False
    e4m3_pv: bool = False

    def __post_init__(self) -> None:
        if self.vsplit not in (1, 4):
            raise ValueError(f"vsplit is 1 or 4 (got {self.vsplit})")
        if self.swap and self.vsplit > 1:
            raise ValueError("swap excludes vsplit (different kernels)")
        if self.cuda and (self.swap or self.vsplit > 1 or self.tma or self.part_bf16):
            raise ValueError("the CUDA kernels have their own tile (block_m, block_n, warps, "
                             "stages) only")
        if self.wgmma and not (self.cuda and self.block_n == 64 and self.num_warps == 8
                               and self.num_stages == 2
                               and self.block_m == (64 if self.rows_m else 32)):
            raise ValueError("wgmma is a CUDA kernel (cuda=True) with block_n 64, 8 (consumer) "
                             "warps, 2 stages and block_m 32 (64 with rows_m)")
        if (self.rows_m or self.e4m3_mma) and not self.wgmma:
            raise ValueError("rows_m and e4m3_mma are options of the wgmma kernels")
        if self.rows_m and self.e4m3_mma:
            raise ValueError("rows_m (the 64-row kernel) excludes e4m3_mma (a 32-row kernel)")
        if self.e4m3_pv and not self.e4m3_mma:
            raise ValueError("e4m3_pv is an option of the e4m3_mma kernel")

    @property
    def tag(self) -> str:
        """A short description of the fields (benchmark tables)."""
        return (f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
                f"{'T' if self.tma else 'P'}{'b' if self.part_bf16 else 'f'}"
                f"{f'v{self.vsplit}' if self.vsplit > 1 else ''}{'S' if self.swap else ''}"
                f"{'K' if self.cuda else ''}{'W' if self.wgmma else ''}"
                f"{'R' if self.rows_m else ''}{'E' if self.e4m3_mma else ''}"
                f"{'8' if self.e4m3_pv else ''}")

    @property
    def sibling_kernel(self) -> bool:
        """Whether the V-split kernel (``triton_vsplit``) runs."""
        return self.vsplit > 1


#: The variants the defaults pick: id -> (what it is, its config).
VARIANTS: dict[str, tuple[str, PagedConfig]] = {
    "C": ("Triton, 64 rows x 64 tokens, 8 warps, TMA loads, split-KV + combine",
          PagedConfig(64, 64, 8, 2, tma=True)),
    "CF": ("Triton as C with bf16 partials and without PDL (an fp8 cache's class default)",
           PagedConfig(64, 64, 8, 2, tma=True, part_bf16=True, pdl=False)),
    "G4": ("Triton, 32 rows x 64 tokens, 4 warps, 4 sibling programs of 128 output dims, no PDL",
           PagedConfig(32, 64, 4, 2, vsplit=4, ctas_per_sm=2, pdl=False)),
    "S16": ("Triton swap AB (KV tile on the MMA's M side), 16 rows x 64 tokens, 4 warps",
            PagedConfig(16, 64, 4, 2, swap=True)),
    "S32w4": ("Triton swap AB, 32 rows x 64 tokens, 4 warps",
              PagedConfig(32, 64, 4, 2, swap=True)),
    "K": ("CUDA mma.sync, 32 rows x 64 tokens, 2 bulk-copy stages, 4 warps, bf16 cache",
          PagedConfig(32, 64, 4, 2, cuda=True)),
    "W": ("CUDA wgmma, 32 rows (MMA N) x 64 tokens (MMA M), bf16 cache or fp8 widened to fp16",
          PagedConfig(32, 64, 8, 2, cuda=True, wgmma=True)),
    "WR": ("CUDA wgmma, 64 rows on the MMA's M side, P V from registers, bf16 or fp8 cache",
           PagedConfig(64, 64, 8, 2, cuda=True, wgmma=True, rows_m=True)),
    "WE2": ("CUDA wgmma, e4m3 Q K MMAs (queries rounded to e4m3), fp16 P V, fp8 cache",
            PagedConfig(32, 64, 8, 2, cuda=True, wgmma=True, e4m3_mma=True)),
    "WE8": ("CUDA wgmma, e4m3 Q K and P V MMAs, split-KV + combine, fp8 cache",
            PagedConfig(32, 64, 8, 2, cuda=True, wgmma=True, e4m3_mma=True, e4m3_pv=True)),
}
#: id -> config
PAGED_VARIANTS: dict[str, PagedConfig] = {name: cfg for name, (_, cfg) in VARIANTS.items()}

# Per-shape winners (H200; docs/bench_mla.md): (kv, rows, batch) -> "NAME", "NAME/spN" (``spN``
# pins the split count) or "A|B" (the first that runs here: ``_runs_here``). kv: "bf16" | "fp8";
# rows = q_len * H: "r32" (<= 32) | "r128" (<= 128) | "big"; batch: "b1" (<= 2) | "b48" | "big".
# 2026-11-29 (b1) and 2026-11-30, `python3 benchmarks/sweep_mla.py`.
PAGED_DEFAULTS: dict[tuple[str, str, str], str] = {
    (kv, rows, batch): choice for (kv, rows), row in {
        #                batch "b1"  "b48"            "big"
        ("bf16", "r32"): ("S16", "W|S16", "W|S32w4"),
        ("bf16", "r128"): ("S16", "WR|C", "WR|C"),
        ("bf16", "big"): ("C", "WR|C", "WR|C"),
        ("fp8", "r32"): ("G4", "WE8|WE2|W|CF", "WE8|WE2|W|CF"),
        ("fp8", "r128"): ("CF", "WR|CF", "WR|CF"),
        ("fp8", "big"): ("C", "WR|CF", "WR|CF"),
    }.items() for batch, choice in zip(("b1", "b48", "big"), row)
}

# Per-context winners where they differ from the class's: (kv, rows, batch, context) -> choice;
# context: "c2k" (longest KV <= 2048) | "c8k" (<= 8192) | "long". Batch 1; 2026-11-30, same sweep.
PAGED_CONTEXT_DEFAULTS: dict[tuple[str, str, str, str], str] = {
    ("bf16", "r128", "b1", "long"): "WR/sp64|CF", ("bf16", "r128", "b1", "c8k"): "WR/sp32|S16",
    ("fp8", "r128", "b1", "c2k"): "G4", ("fp8", "r128", "b1", "c8k"): "WR/sp64|G4",
    ("fp8", "r128", "b1", "long"): "WR/sp64|CF",
    ("bf16", "r32", "b1", "c8k"): "S16/sp64", ("bf16", "r32", "b1", "long"): "W/sp128|K/sp128",
    ("fp8", "r32", "b1", "long"): "WE8/sp128|WE2/sp128|W/sp128|G4",
    ("fp8", "r32", "b1", "c8k"): "WE8/sp32|G4", ("fp8", "r32", "b1", "c2k"): "WE8|G4",
    ("bf16", "big", "b1", "long"): "WR/sp16|C", ("bf16", "big", "b1", "c8k"): "WR/sp16|C",
    ("bf16", "big", "b1", "c2k"): "WR|C",
    ("fp8", "big", "b1", "long"): "WR/sp16|CF", ("fp8", "big", "b1", "c8k"): "WR/sp16|C",
    ("fp8", "big", "b1", "c2k"): "WR|C",
}


def variant_name(cfg: PagedConfig) -> str | None:
    """The id of ``VARIANTS`` whose config equals ``cfg`` (None: an unnamed config)."""
    return next((n for n, c in PAGED_VARIANTS.items() if c == cfg), None)


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
    """Whether a CUDA variant takes this cache (``e4m3_mma``: e4m3; wgmma: +bf16; mma: bf16)."""
    if cfg.e4m3_mma:
        return kv_dtype == FP8_DTYPE
    return kv_dtype == torch.bfloat16 or (kv_dtype == FP8_DTYPE and cfg.wgmma)


def _runs_here(cfg: PagedConfig, kv_dtype: torch.dtype, device: torch.device,
               fixed: bool, e4m3_queries: bool = True, e4m3_probs: bool = True) -> bool:
    """Whether a table entry runs here (CUDA: fixed rows, the cache, nvcc, sm_90+, consent)."""
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
    """(config, pinned splits or None) of a shape: the first entry of the tables that runs here."""
    if device.type != "cuda":
        return PagedConfig(16, min(8, page_size), 4, 1), None
    if page_size % 64:
        return PagedConfig(64, 32, 8, 3, tma=True, part_bf16=kv_dtype == FP8_DTYPE), None
    key = shape_class(rows, kv_dtype, bs)
    if max_kv is not None:
        by_ctx = PAGED_CONTEXT_DEFAULTS.get((*key, context_class(max_kv)))
        got = by_ctx and _first_runnable(by_ctx, kv_dtype, device, fixed, e4m3_queries, e4m3_probs)
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
    """The config of :func:`paged_choice`."""
    return paged_choice(rows, kv_dtype, device, page_size, bs, max_kv)[0]


def pick_num_splits(bs: int, m_blocks: int, max_kv: int, block_n: int,
                    num_sms: int = 132, min_tiles: int = 2, max_splits: int = 64) -> int:
    """The gather kernel's splits: ~two waves of programs, each split >= ``min_tiles`` tiles."""
    programs = max(bs * m_blocks, 1)
    want = -(-2 * num_sms // programs)
    tiles = -(-max(max_kv, 1) // block_n)
    return int(max(1, min(want, tiles // min_tiles, max_splits)))


@functools.lru_cache(maxsize=4096)  # ~70 µs of host time per eager call at bs 32 otherwise
def pick_num_splits_paged(bs: int, m_blocks: int, max_kv: int, block_n: int, rows: int,
                          kv_row_bytes: int, num_sms: int = 132, part_bytes: int = 4,
                          dv: int = 512, ctas_per_sm: int = 1, max_splits: int = 128,
                          fixed_tiles: float = 1.0, vsplit: int = 1,
                          combine_per_split: float = 1.0 / 16) -> int:
    """Splits minimizing ``waves(s) * (tiles/s + fixed + partial cost)`` plus the combine's cost."""
    tiles = -(-max(int(max_kv), 1) // block_n)
    tile_bytes = block_n * kv_row_bytes
    part = 2.0 * min(rows, 64) * dv / vsplit * part_bytes / tile_bytes
    slots = num_sms * ctas_per_sm
    best, best_cost = 1, None
    for s in range(1, min(tiles, max_splits) + 1):
        progs = max(bs * m_blocks * vsplit, 1) * s
        waves = -(-progs // slots)
        cost = waves * (-(-tiles // s) + fixed_tiles + (part if s > 1 else 0.0))
        if s > 1:  # the combine launch
            cost += 1.0 + s * combine_per_split
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


def splits_for(cfg, bs: int, m_blocks: int, max_kv: int, rows: int, kv_row_bytes: int,
               num_sms: int = 132, dv: int = 512) -> int:
    """:func:`pick_num_splits_paged` with a ``PagedConfig``'s partial dtype, V-split and wave."""
    return pick_num_splits_paged(bs, m_blocks, max_kv, cfg.block_n, rows, kv_row_bytes, num_sms,
                                 2 if cfg.part_bf16 else 4, dv, ctas_per_sm=cfg.ctas_per_sm,
                                 vsplit=cfg.vsplit)
