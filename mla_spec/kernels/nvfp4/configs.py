"""Tile configs of the NVFP4 kernels and the configs pinned by the H200 sweeps
(``benchmarks/sweep_nvfp4.py``, ``sweep_gemv.py``, ``sweep_nvfp4_cuda.py``) per weight shape and
token bucket (``M_BUCKETS``). :func:`parse_variant` reads a name, a kind then tokens in any order:

| token | meaning |
|---|---|
| ``gemv`` | kind: the FMA GEMV (``gemv.py``, ``GemvConfig``) |
| ``mmab`` | kind: the MMA kernel, activations as the A operand (``gemm.py``, ``NVFP4MmaConfig``) |
| ``cuda`` | kind: the hand-written ``mma.sync`` kernel (``gemm_cuda.py``, ``CudaMmaConfig``) |
| ``bm<n>`` | mmab: token tile (16 / 32 / 64 / 128; absent: by M) |
| ``bn<n>`` / ``bk<n>`` | weight rows / K elements per program and step |
| ``s<n>`` / ``w<n>`` / ``st<n>`` | K splits / warps / pipeline stages |
| ``g<n>`` | gemv: int64 words (16-element blocks) per row and step |
| ``h2`` / ``pf`` | gemv: packed-fp16 math (``gemv_packed.py``) / its double-buffered K loop |
| ``r<n>`` / ``xl`` | cuda: 16-row tiles per warp / no activation prefetch across chunks |
"""

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = ["GemvConfig", "NVFP4MmaConfig", "CudaMmaConfig", "MoeGemvConfig", "PINNED_CONFIGS",
           "PINNED_CUDA", "PINNED_CUDA_REFUSED", "M_BUCKETS", "m_bucket", "parse_variant",
           "variant_name", "pinned_config"]


@dataclass(frozen=True)
class GemvConfig:
    """GEMV tiles: rows and 16-blocks a step, ``split_k``, warps, stages, packed math, prefetch."""

    block_n: int = 128
    groups: int = 2
    split_k: int = 1
    num_warps: int = 1
    num_stages: int = 1
    packed: bool = False
    prefetch: bool = False


@dataclass(frozen=True)
class NVFP4MmaConfig:
    """MMA tiles: tokens (0: by M) x rows x K a step, ``split_k``, warps, stages."""

    block_m: int = 0
    block_n: int = 128
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class CudaMmaConfig:
    """``mma.sync`` tiles: warps per 16-row tile, chunks in flight, ``split_k``, prefetch, tiles."""

    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    x_prefetch: bool = True
    row_tiles: int = 1


@dataclass(frozen=True)
class MoeGemvConfig:
    """Tiles of the MoE gemv path: w13 launch (also fp32 activations' w2) and ``*2`` the w2 loop
    launch; defaults: 2026-11-30, ``python3 benchmarks/sweep_gemv.py --moe``."""

    block_n: int = 16
    num_warps: int = 4
    groups: int = 16
    split_k: int | None = None
    block_n2: int = 8
    num_warps2: int = 1
    groups2: int = 32


M_BUCKETS = (1, 2, 4, 8, 16, 64, 128, 512)

# H200 winners (docs/bench_nvfp4.md) in ``mla_spec/data/nvfp4_pinned_h200.json``, with the date
# and sweep command of each table: "NxK" -> token bucket -> variant name.
_PINNED = json.loads((Path(__file__).resolve().parents[2] / "data" / "nvfp4_pinned_h200.json")
                     .read_text())


def _shape(name: str) -> tuple[int, int]:
    n, k = name.split("x")
    return int(n), int(k)


#: Triton configs: "mmab" (``sweep_nvfp4.py``) and "gemv" (``sweep_gemv.py``) winners
PINNED_CONFIGS: dict[tuple[int, int, int], str] = {
    (*_shape(nk), int(m)): v for nk, per_m in _PINNED["triton"]["pinned"].items()
    for m, v in per_m.items()}
#: where the mma.sync kernel beat the entry above (``sweep_nvfp4_cuda.py``); ``nvfp4_gemm`` takes
#: these first where the kernel runs
PINNED_CUDA: dict[tuple[int, int, int], str] = {
    (*_shape(nk), int(m)): v for nk, per_m in _PINNED["cuda"]["pinned"].items()
    for m, v in per_m.items()}
#: where the same sweep kept the Triton entry (cuda slower or within 2%)
PINNED_CUDA_REFUSED = frozenset((*_shape(nk), m) for nk, ms in _PINNED["cuda"]["refused"].items()
                                for m in ms)

_FIELDS = {"bm": "block_m", "bn": "block_n", "bk": "block_k", "st": "num_stages", "s": "split_k",
           "w": "num_warps", "g": "groups", "r": "row_tiles"}
_POW2 = ("block_n", "block_k", "groups", "num_warps")
_KIND_TOKENS = {"gemv": ("bn", "st", "s", "w", "g"), "mmab": ("bm", "bn", "bk", "st", "s", "w"),
                "cuda": ("w", "st", "s", "r")}
_FLAGS = {("gemv", "h2"): "packed", ("gemv", "pf"): "prefetch", ("cuda", "xl"): "x_prefetch"}


def m_bucket(m: int) -> int | None:
    """Smallest bucket of ``M_BUCKETS`` holding ``m`` tokens, None above the last."""
    return next((b for b in M_BUCKETS if m <= b), None)


@cache
def parse_variant(name: str) -> GemvConfig | NVFP4MmaConfig | CudaMmaConfig:
    """A variant name -> its config (``GemvConfig``, ``NVFP4MmaConfig``, ``CudaMmaConfig``)."""
    kind, *tokens = name.split() or [""]
    if kind not in _KIND_TOKENS:
        raise ValueError(f"variant {name!r} must start with 'gemv', 'mmab' or 'cuda'")
    kw: dict[str, int | bool] = {}
    for tok in tokens:
        hit = re.fullmatch(r"(bm|bn|bk|st|s|w|g|r)(\d+)", tok)
        if (kind, tok) in _FLAGS:
            kw[_FLAGS[kind, tok]] = tok != "xl"
        elif hit is None or hit[1] not in _KIND_TOKENS[kind]:
            raise ValueError(f"unsupported token {tok!r} in {kind} variant {name!r}")
        else:
            kw[_FIELDS[hit[1]]] = int(hit[2])
    for field, v in kw.items():
        if field == "block_m" and v not in (16, 32, 64, 128):
            raise ValueError(f"block_m = {v} in {name!r}: must be 16, 32, 64 or 128")
        if not isinstance(v, bool) and (v < 1 or (field in _POW2 and v & (v - 1))):
            raise ValueError(f"{field} = {v} in {name!r}: must be >= 1"
                             + (" and a power of two" if field in _POW2 else ""))
    if kind == "cuda":
        return CudaMmaConfig(**kw)
    return GemvConfig(**kw) if kind == "gemv" else NVFP4MmaConfig(**kw)


def variant_name(cfg: GemvConfig | NVFP4MmaConfig | CudaMmaConfig) -> str:
    """Inverse of ``parse_variant`` (the sweeps' naming)."""
    if isinstance(cfg, CudaMmaConfig):
        return (f"cuda w{cfg.num_warps} st{cfg.num_stages} s{cfg.split_k}"
                + (f" r{cfg.row_tiles}" if cfg.row_tiles != 1 else "")
                + ("" if cfg.x_prefetch else " xl"))
    if isinstance(cfg, NVFP4MmaConfig):
        bm = f" bm{cfg.block_m}" if cfg.block_m else ""
        return (f"mmab{bm} bn{cfg.block_n} bk{cfg.block_k} w{cfg.num_warps} st{cfg.num_stages}"
                f" s{cfg.split_k}")
    return (f"gemv bn{cfg.block_n} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"
            + (f" g{cfg.groups}" if cfg.groups != 2 else "") + (" h2" if cfg.packed else "")
            + (" pf" if cfg.prefetch else ""))


def pinned_config(m: int, n: int, k: int) -> GemvConfig | NVFP4MmaConfig | None:
    """The pinned config for ``m`` tokens x weight ``[N, K]``, or None when not measured."""
    name = PINNED_CONFIGS.get((n, k, m_bucket(m)))
    return None if name is None else parse_variant(name)
