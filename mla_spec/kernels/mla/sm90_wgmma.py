"""Launcher of the Hopper wgmma split-KV MLA kernels (``csrc/``: ``W``, ``WR``, ``WE2`` / ``WE8``):
fixed ``q_len``, a bf16 or e4m3 cache with pages a multiple of 64, Dv 512 / Dpe 64, bf16 queries,
sm_90; bf16 partials for ``combine.combine_splits_fast`` (``WR``'s two merge in a cluster).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, fields

import torch

from mla_spec.device import cuda_capability
from mla_spec.kernels import options
from mla_spec.kernels.launch.cuda_driver import CudaKernel, tensor_map_2d
from mla_spec.kernels.launch.pdl import pdl_on
from mla_spec.kernels.mla.combine import SplitBuffers, combine_splits_fast
from mla_spec.kernels.mla.sm90_mma import MlaParams, call_supported, split_params
from mla_spec.quant.fp8 import FP8_DTYPE

__all__ = ["EARLY_KV_MIN_SPLITS", "EARLY_KV_TILES", "WgmmaKind", "clusters_splits",
           "launch_wgmma_mla", "wgmma_mla_supported", "wgmma_smem"]

_BN, _STAGES = 64, 2
_W_SRC, _ROWS_SRC, _E4M3_SRC = ("mla_wgmma_sm90.cu", "mla_wgmma_rows_sm90.cu",
                                "mla_wgmma_e4m3pp_sm90.cu")
#: ``early_kv``: the first stage only, at 64 splits or more (faster only there; docs/bench_mla.md)
EARLY_KV_TILES = 1
EARLY_KV_MIN_SPLITS = 64
#: the e4m3-MMA kernels' stages (40 KB each: five 128-dim boxes of 64 tokens' bytes)
_E4M3_STAGES, _E4M3_TILE = 4, 5 * _BN * 128
#: the stage barriers' room: a "full" one per box group (at most nine) and an "empty" one
_MAX_BOX_GROUPS = 9


@dataclass(frozen=True)
class WgmmaKind:
    """The ``PagedConfig`` fields that pick a wgmma kernel (:meth:`of`)."""

    rows_m: bool = False
    e4m3_mma: bool = False
    e4m3_pv: bool = False

    @classmethod
    def of(cls, cfg) -> WgmmaKind:
        """The kind of a ``PagedConfig`` (or of anything with these fields)."""
        return cfg if isinstance(cfg, cls) else _kind_of(cfg)

    @property
    def block_m(self) -> int:
        """Query rows a CTA: 64 on the MMA's M side (``rows_m``), else 32 on its N side."""
        return 64 if self.rows_m else 32

    @property
    def source(self) -> str:
        return _E4M3_SRC if self.e4m3_mma else _ROWS_SRC if self.rows_m else _W_SRC

    def kernel_name(self, kv_dtype: torch.dtype) -> str:
        """The ``extern "C"`` kernel of :attr:`source` for a cache of ``kv_dtype``."""
        f8 = "_f8" if kv_dtype == FP8_DTYPE else ""
        if self.e4m3_mma:
            return f"mla_wgmma_e4m3pp{'8' if self.e4m3_pv else ''}_m32"
        return f"mla_wgmma_rows64{f8}" if self.rows_m else f"mla_wgmma_m32{f8}"

    @property
    def threads(self) -> int:
        """Threads a CTA: 8 consumer warps, a producer warp (a warpgroup for ``WR``, ``WE*``)."""
        return 384 if self.rows_m or self.e4m3_mma else 288

    @property
    def smem(self) -> int:
        return wgmma_smem(self)


@functools.lru_cache(maxsize=64)
def _kind_of(cfg) -> WgmmaKind:
    return WgmmaKind(**{f.name: getattr(cfg, f.name) for f in fields(WgmmaKind)})


#: the compiled kernels: (kind, e4m3 cache) -> kernel
_KINDS = {WgmmaKind(): (False, True), WgmmaKind(rows_m=True): (False, True),
          WgmmaKind(e4m3_mma=True): (True,), WgmmaKind(e4m3_mma=True, e4m3_pv=True): (True,)}
_KERNELS = {(k, f8): CudaKernel(k.source, k.kernel_name(FP8_DTYPE if f8 else torch.bfloat16),
                                arch="sm_90a") for k, f8s in _KINDS.items() for f8 in f8s}
#: the ``early_kv`` builds (``_ek``): ``W``, ``WE2`` and ``WE8``
_EARLY_KERNELS = {key: CudaKernel(v.src.name, v.name + "_ek", arch="sm_90a")
                  for key, v in _KERNELS.items() if not key[0].rows_m}
#: ``WR`` with its 2 splits as one cluster merging in distributed shared memory (``_cl``)
_CLUSTER_KERNELS = {key: CudaKernel(v.src.name, v.name + "_cl", arch="sm_90a")
                    for key, v in _KERNELS.items() if key[0].rows_m}


def wgmma_smem(kind: WgmmaKind) -> int:
    """Dynamic shared memory of one CTA, as laid out in the ``.cu`` files."""
    bm = kind.block_m
    if kind.e4m3_mma:  # four 40 KB stages, e4m3 queries, two P^T, maxima and sums of both groups
        return (1024 + _E4M3_STAGES * _E4M3_TILE + 5 * bm * 128 + 2 * bm * 128
                + (8 * bm + 4 * bm) * 4 + 16 * _E4M3_STAGES)
    base = (1024 + _STAGES * 9 * _BN * 128 + 9 * bm * 128 + bm * 128
            + 8 * _STAGES * (_MAX_BOX_GROUPS + 1))
    if kind.rows_m:
        return base + 2 * bm * 4
    return base + 2 * (bm // 2) * 128 * 4 + 8 * bm * 4 + 2 * bm * 4


class _WgParams(ctypes.Structure):
    """``WgParams`` of ``csrc/sm90_wgmma.cuh`` (64-byte aligned: 384 bytes)."""

    _fields_ = [("m", MlaParams), ("kv_map", ctypes.c_ubyte * 128), ("early_kv", ctypes.c_int),
                ("pad", ctypes.c_ubyte * 60)]


_MAPS: dict[tuple[int, int, int, bool, bool], bytes] = {}


def _tensor_map(kv_flat: torch.Tensor, e4m3_mma: bool = False) -> bytes:
    """The cache's TMA descriptor, cached: [64 tokens, 64 dims] boxes (``e4m3_mma``: 128 dims)."""
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


def wgmma_mla_supported(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_flat: torch.Tensor,
                        page_size: int, q_len: int | None, kind) -> str | None:
    """None when the kernel of ``kind`` (a :class:`WgmmaKind` or ``PagedConfig``) takes the call."""
    kind = WgmmaKind.of(kind)
    if (kind, kv_flat.dtype == FP8_DTYPE) not in _KERNELS:
        return f"{kind} is not compiled for a {kv_flat.dtype} cache (bf16 or fp8 e4m3: the " \
               f"32-row kernel and rows_m; e4m3_mma, with or without e4m3_pv: fp8 e4m3 only)"
    why = call_supported(q_nope, q_pe, kv_flat, page_size, _BN, q_len, "wgmma kernel",
                         (torch.bfloat16, FP8_DTYPE))
    if why is None and cuda_capability(q_nope.device) != (9, 0):
        return "the wgmma kernel needs sm_90 (Hopper): wgmma does not exist elsewhere"
    return why


def launch_wgmma_mla(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, out, lse,
                     qk_scale_log2: float, v_scale: float, *, q_len: int, m_blocks: int,
                     num_splits: int, kind, early_kv: bool | None = None, bind: bool = False):
    """Run the split kernel of ``kind``, then the combine unless the splits merge in a cluster.
    ``early_kv``: from :data:`EARLY_KV_MIN_SPLITS` splits, first KV tiles before the PDL wait; sound
    only if ``kv_lens``, the page table and all other KV rows were written before the kernel ahead
    began (a decode step); the kernel re-reads the slots after the wait and traps if they moved.
    ``bind``: also return ``go(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens,
    None, out, lse, qk_scale_log2, v_scale) -> bool``, the same launches for tensors of the same
    shapes, strides, dtypes and alignment, only pointers and scales rewritten (None: cannot)."""
    kind = WgmmaKind.of(kind)
    if out.dtype != torch.bfloat16 or out.stride(-1) != 1 or out.stride(0) % 4 or \
            out.stride(1) % 4 or out.data_ptr() % 8:
        raise ValueError("the wgmma kernel writes a bf16 out with contiguous, 8-byte aligned "
                         "rows")
    key = (kind, kv_flat.dtype == FP8_DTYPE)
    cluster = clusters_splits(kind, num_splits)
    m, part, part_lse = split_params(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices,
                                     kv_lens, out, lse, qk_scale_log2, v_scale, q_len,
                                     num_splits, part_bf16=True, partials=not cluster)
    p = _WgParams(m)
    ctypes.memmove(p.kv_map, _tensor_map(kv_flat, kind.e4m3_mma), 128)
    early = (options.EARLY_KV if early_kv is None else early_kv) and key in _EARLY_KERNELS \
        and not cluster and num_splits >= EARLY_KV_MIN_SPLITS
    p.early_kv = EARLY_KV_TILES if early else 0
    kernel = (_CLUSTER_KERNELS if cluster else _EARLY_KERNELS if early else _KERNELS)[key]
    launch = kernel.prepared(
        (num_splits, m_blocks, req_pool_indices.numel()), kind.threads, kind.smem,
        q_nope.device, pdl=pdl_on(q_nope), cluster=num_splits if cluster else 1)
    launch(p)
    combine = None
    if num_splits > 1 and not cluster:
        combine = combine_splits_fast(part, part_lse, out, lse, bind=bind)
        if bind and combine is None:
            return None
    if not bind or req_to_token.dtype != torch.int32:
        return None
    pm, kv_ptr, e4m3 = p.m, [kv_flat.data_ptr()], kind.e4m3_mma
    bufs = SplitBuffers((part.shape, part_lse.shape), torch.bfloat16, out.device) \
        if combine else None

    def go(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr, out, lse,
           qk_scale_log2, v_scale) -> bool:
        if kv_flat.data_ptr() != kv_ptr[0]:  # another layer's cache: its tensor map
            ctypes.memmove(p.kv_map, _tensor_map(kv_flat, e4m3), 128)
            pm.kv = kv_ptr[0] = kv_flat.data_ptr()
        pm.qn, pm.qp, pm.r2t = q_nope.data_ptr(), q_pe.data_ptr(), req_to_token.data_ptr()
        pm.rpi, pm.kv_lens, pm.out = req_pool_indices.data_ptr(), kv_lens.data_ptr(), \
            out.data_ptr()
        pm.lse = lse.data_ptr() if lse is not None else pm.out
        pm.qk_scale_log2, pm.v_scale = qk_scale_log2, v_scale
        if combine is None:  # one split, or a cluster's: no partials (as split_params)
            pm.part = pm.part_lse = pm.out
            launch(p)
            return True
        part, part_lse = bufs.get()
        pm.part, pm.part_lse = part.data_ptr(), part_lse.data_ptr()
        launch(p)
        return combine(part, part_lse, out, lse)
    return go


def clusters_splits(kind: WgmmaKind, num_splits: int) -> bool:
    """Whether the kernel merges its splits in clusters itself (``WR`` at 2 splits)."""
    return num_splits == 2 and kind.rows_m
