"""``mla_decode_paged``: the page-granular Hopper fast path of ``mla_decode`` (same result; twin:
``reference.mla_decode_ref``); the ``PagedConfig`` (default :func:`choice.paged_choice`) picks the
kernel, :func:`choice.splits_for` the split count unless pinned.
"""

import functools
from dataclasses import dataclass

import torch
import triton

from mla_spec.device import cuda_capability, sm_count, triton_interpreting
from mla_spec.kernels import options
from mla_spec.kernels.launch.cuda_driver import cuda_kernels_available
from mla_spec.kernels.mla.choice import (
    PagedConfig,
    cuda_cache_ok,
    paged_choice,
    paged_config,
    splits_for,
)
from mla_spec.kernels.mla.sm90_mma import CudaTile, cuda_mla_supported, launch_cuda_mla
from mla_spec.kernels.mla.sm90_wgmma import launch_wgmma_mla, wgmma_mla_supported
from mla_spec.kernels.mla.triton_common import check_mla_inputs
from mla_spec.kernels.mla.triton_paged import launch_paged
from mla_spec.kernels.mla.triton_vsplit import launch_vsplit
from mla_spec.quant.fp8 import FP8_DTYPE

__all__ = ["mla_decode_paged", "paged_supported"]

_LOG2E = 1.4426950408889634


def paged_supported(device: torch.device, dv: int, dpe: int, page_size: int,
                    kv_dtype: torch.dtype, cfg: PagedConfig | None = None) -> str | None:
    """None when the paged kernels can run here, else why not (the caller falls back)."""
    if device.type == "cuda":
        if cuda_capability(device)[0] < 9:
            return "the paged fast path is tuned for SM90+ (Hopper)"
    elif not triton_interpreting():
        return "needs CUDA or the Triton interpreter"
    if kv_dtype == torch.float32:
        return "fp32 caches use the generic kernel"
    if cfg is not None and cfg.cuda:
        if device.type != "cuda":
            return "the CUDA kernel needs a CUDA device"
        why = cuda_kernels_available(device)
        if why:
            return why
        if not cuda_cache_ok(cfg, kv_dtype) or (dv, dpe) != (512, 64):
            return ("the CUDA kernel takes a bf16 cache (wgmma: or fp8 e4m3; e4m3_mma: fp8 "
                    "e4m3 only) with Dv 512 / Dpe 64")
    if dv % 32 or dv & (dv - 1) or dpe & (dpe - 1) or dpe < 16:
        return f"needs Dv a power of two >= 32 and Dpe a power of two >= 16 (got {dv}/{dpe})"
    cfg = cfg or paged_config(1, kv_dtype, device, page_size)
    if page_size % cfg.block_n:
        return f"page_size {page_size} is not a multiple of BLOCK_N {cfg.block_n}"
    return None


@functools.cache
def _ensure_allocator() -> None:
    """Triton's scratch allocator (the TMA kernels' descriptors), set once."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                       device="cuda"))


@dataclass
class _Call:
    """What one call signature decided once (:func:`mla_decode_paged`'s plan cache), and its
    launches bound after the first (``relaunch``, valid while the kernel options are ``opts``)."""

    cfg: PagedConfig
    m_blocks: int
    num_splits: int
    interp: bool
    is_fp8: bool
    relaunch: object = None
    opts: tuple = ()


def _options() -> tuple:
    return options.PDL, options.L2_PREFETCH, options.EARLY_KV


#: call signature -> _Call: the checks, the variant and the splits of a shape, decided once
_CALLS: dict[tuple, _Call] = {}


def _signature(tensors) -> tuple:
    return tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(),
                                          t.data_ptr() & 15) for t in tensors])


def mla_decode_paged(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, sm_scale,
                     *, page_size: int, k_scale: float = 1.0, v_scale: float = 1.0,
                     q_len: int | None = None, qo_indptr: torch.Tensor | None = None,
                     max_q: int | None = None, max_kv: int | None = None,
                     num_splits: int | None = None, return_lse: bool = False,
                     out: torch.Tensor | None = None, config: PagedConfig | None = None,
                     num_sms: int | None = None, early_kv: bool | None = None):
    """``mla_decode`` with a contiguous, page-aligned ``kv_flat`` (``max_kv``: host int).

    The checks, the variant (``config``, default :func:`choice.paged_choice`) and the split
    count are decided once per call signature (shapes, strides, dtypes, devices, alignment and
    the host arguments) and cached: a repeated call only launches. Without ``max_kv`` (and
    without ``config`` / ``num_splits``) a CUDA call reads ``kv_lens.max()`` (a device sync)."""
    bs = req_pool_indices.numel()
    if max_kv is None and num_splits is None and config is None and q_nope.is_cuda:
        max_kv = int(kv_lens.max()) if bs else 0
    if q_len is None and max_q is None and qo_indptr is not None:
        max_q = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if bs else 0
    decided = config is not None and num_splits is not None  # max_kv then decides nothing
    key = (_signature((q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens,
                       qo_indptr, out)), page_size, q_len, max_q, None if decided else max_kv,
           num_splits, return_lse, config, num_sms, early_kv)
    call = _CALLS.get(key)
    if call is None:
        call = _plan(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr,
                     page_size, q_len, max_q, max_kv, num_splits, config, num_sms)
        if len(_CALLS) >= 4096:
            _CALLS.clear()
        _CALLS[key] = call
    elif not kv_lens.is_cuda:  # the one data-dependent check (free on the host)
        check_mla_inputs(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens,
                         qo_indptr)
    n, h, dv = q_nope.shape
    dev = q_nope.device
    if out is None:
        out = torch.empty((n, h, dv), dtype=q_nope.dtype, device=dev)
    lse = torch.empty((n, h), dtype=torch.float32, device=dev) if return_lse else None
    if n == 0 or bs == 0:
        return (out, lse) if return_lse else out
    args = (q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens)
    scale = float(sm_scale) * float(k_scale) * _LOG2E
    go = call.relaunch  # a repeated call: pointers and scales rewritten, launched (a few µs)
    if go is None or call.opts != _options() or \
            not go(*args, qo_indptr, out, lse, scale, float(v_scale)):
        call.relaunch, call.opts = _launch(call, args, qo_indptr, out, lse, scale, v_scale,
                                           q_len, early_kv), _options()
    return (out, lse) if return_lse else out


def _launch(call: _Call, args, qo_indptr, out, lse, scale, v_scale, q_len, early_kv):
    """The call's launches through the kernel's launcher; returns their relaunch (or None)."""
    cfg = call.cfg
    bind = not call.interp
    if cfg.tma and bind:
        _ensure_allocator()
    if cfg.wgmma:
        return launch_wgmma_mla(*args, out, lse, scale, v_scale, q_len=q_len,
                                m_blocks=call.m_blocks, num_splits=call.num_splits, kind=cfg,
                                early_kv=early_kv, bind=bind)
    if cfg.cuda:
        launch_cuda_mla(*args, out, lse, scale, v_scale, q_len=q_len, m_blocks=call.m_blocks,
                        num_splits=call.num_splits,
                        tile=CudaTile(cfg.block_m, cfg.block_n, cfg.num_stages, cfg.num_warps))
        return None
    if cfg.sibling_kernel:
        launch_vsplit(*args, qo_indptr, out, lse, scale, v_scale, q_len=q_len,
                      m_blocks=call.m_blocks, num_splits=call.num_splits, cfg=cfg,
                      interp=call.interp, is_fp8=call.is_fp8)
        return None
    return launch_paged(*args, qo_indptr, out, lse, scale, v_scale, q_len=q_len,
                        m_blocks=call.m_blocks, num_splits=call.num_splits, cfg=cfg,
                        interp=call.interp, is_fp8=call.is_fp8, bind=bind)


def _plan(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr, page_size,
          q_len, max_q, max_kv, num_splits, config, num_sms) -> _Call:
    """Check a call signature and decide its variant and splits (ValueError: what is wrong)."""
    check_mla_inputs(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr)
    n, h, dv = q_nope.shape
    dpe = q_pe.shape[-1]
    bs = req_pool_indices.numel()
    dev = q_nope.device
    if (q_len is None) == (qo_indptr is None):
        raise ValueError("give exactly one of q_len (fixed rows per request) or qo_indptr")
    pinned = None
    if config is None:
        config, pinned = paged_choice((q_len or max_q or 1) * h, kv_flat.dtype, dev, page_size,
                                      bs, max_kv, fixed=q_len is not None)
    cfg = config
    why = paged_supported(dev, dv, dpe, page_size, kv_flat.dtype, cfg)
    if why:
        raise ValueError(f"mla_decode_paged: {why}")
    if kv_flat.shape[-1] != dv + dpe or not kv_flat.is_contiguous():
        raise ValueError(f"kv_flat must be contiguous [slots, {dv + dpe}]")
    rows = (q_len if q_len is not None else max_q) * h
    m_blocks = max(1, triton.cdiv(rows, cfg.block_m))
    if num_splits is None:
        num_splits = pinned
    if num_splits is None:
        mk = max_kv if max_kv is not None else (int(kv_lens.max()) if bs else 0)
        sms = num_sms or (sm_count(dev) if dev.type == "cuda" else 4)
        num_splits = splits_for(cfg, bs, m_blocks, mk, rows,
                                kv_flat.shape[-1] * kv_flat.element_size(), sms, dv)
    interp = dev.type == "cpu"
    is_fp8 = kv_flat.dtype == FP8_DTYPE
    if not (interp or is_fp8 or q_nope.dtype == kv_flat.dtype == q_pe.dtype):
        raise ValueError(f"queries {q_nope.dtype} must match the {kv_flat.dtype} cache")
    if cfg.cuda:
        tile = CudaTile(cfg.block_m, cfg.block_n, cfg.num_stages, cfg.num_warps)
        why = (wgmma_mla_supported(q_nope, q_pe, kv_flat, page_size, q_len, cfg)
               if cfg.wgmma else cuda_mla_supported(q_nope, q_pe, kv_flat, page_size, tile, q_len))
        if why:
            raise ValueError(f"mla_decode_paged: config {cfg.tag}: {why}")
    return _Call(cfg, m_blocks, int(num_splits), interp, is_fp8)
