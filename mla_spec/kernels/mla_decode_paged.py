"""Page-granular split-KV MLA attention: the Hopper fast path of ``mla_decode`` (same function).

What it computes is exactly ``mla_spec.kernels.mla_decode.mla_decode`` (and its twin
``mla_decode_ref``): per request ``b``, row ``i`` of ``q_len`` sees KV positions
``j < kv_len - q_len + i + 1`` and gets
``v_scale * softmax_j(sm_scale * k_scale * q . s_j) @ s_j[:Dv]`` (zeros for an empty window).

Why a second kernel. The generic kernel gathers every KV row through ``req_to_token`` (one
index per token) and keeps one ``[M, 512]`` accumulator. Here the KV tile is addressed per
*page*: when ``page_size % BLOCK_N == 0`` and slots are page-aligned (``slot = page *
page_size + pos % page_size``, what ``mla_spec.kv_cache.assign_request_slots`` writes), the
``BLOCK_N`` positions of a tile live in one page, so one scalar ``req_to_token`` read per tile
gives the slot of its first row and the tile is ``BLOCK_N`` contiguous 576-wide rows. Layout::

    KV tile  [BLOCK_N, Dv/2] | [BLOCK_N, Dv/2] | [BLOCK_N, Dpe]   (three boxes of one page)
    S  = Q0 @ K0^T + Q1 @ K1^T + Qpe @ Kpe^T                  [BLOCK_M, BLOCK_N] fp32
    O0 += P @ K0,  O1 += P @ K1                               two [BLOCK_M, Dv/2] fp32

The two half-width accumulators keep each TMA box within the 256-element limit and give the
compiler two independent P@V chains. ``TMA=True`` loads the three boxes with device-side tensor
descriptors (``tl.make_tensor_descriptor``, needs ``triton.set_allocator``; the launcher sets
one), else with plain pointer loads. Rows past the split end inside the last page are read but
masked out of the scores (P = 0 there; the pool is zero-initialized and every store saturates,
so those rows are finite). Rows of a program (``BLOCK_M``, 64 on Hopper = one wgmma M) are
flattened ``(token, head)`` pairs as in ``mla_decode``; grid ``(m_blocks, num_splits, bs)`` so
that the m-blocks of one KV tile run side by side and share it through L2.

FP8 KV (``F16=True``): the e4m3 tile is converted to fp16 (exact: every e4m3 value is an fp16
value; a native conversion on SM89+) and the dots run in fp16 with fp32 accumulation. Queries
are cast to fp16 after an in-program power-of-two scale ``2**e`` that puts the tile's
``max |q|`` in ``[2**13, 2**14]`` (no overflow possible; the scale is divided out of the score
scale exactly), so the only query rounding is fp16's ``2**-11`` relative (finer than bf16's
``2**-8``); P is rounded to fp16 (``2**-11`` relative) instead of bf16. So the FP8 path is at
least as accurate as the bf16 path on the same (dequantized) cache.

Splits: :func:`pick_num_splits_paged` minimizes a cost model (waves of programs x tiles per
split, plus the partials' write/read), and partials may be bf16 (``part_bf16``: half the
bytes; adds one bf16 rounding, ``2**-9`` relative, before the fp32 combine).
Under the CPU interpreter the operands of bf16 / fp32 caches are upcast to fp32 before ``tl.dot``.

Options beyond this kernel: ``PagedConfig.swap`` (the KV tile on the MMA's M side, for few
query rows) runs ``mla_decode_swapab``'s kernel; ``PagedConfig.vsplit > 1`` (sibling CTAs each
owning 512 / vsplit output columns) and ``PagedConfig.fused`` (the last split merges, no combine
launch) run the kernel of ``mla_decode_vsplit``. Tile configs, the per-shape defaults table
``PAGED_DEFAULTS`` and the split cost model live in ``mla_decode_tiles`` (re-exported here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import cuda_capability, sm_count, triton_interpreting
from mla_spec.kernels.launch.cuda_driver import cuda_kernels_available
from mla_spec.kernels.mla_decode_combine import combine_splits
from mla_spec.kernels.mla_decode_common import (
    attn_pdl_kwargs,
    block_rows,
    check_mla_inputs,
    fp16_prescaled,
    kv_descriptors,
    load_kv_tile,
    online_softmax,
    prefetch_kv_tiles,
    request_rows,
)
from mla_spec.kernels.mla_decode_cuda import CudaTile, cuda_mla_supported, launch_cuda_mla
from mla_spec.kernels.mla_decode_swapab import launch_swapab
from mla_spec.kernels.mla_decode_tiles import (
    PAGED_CONTEXT_DEFAULTS,
    PAGED_DEFAULTS,
    PAGED_VARIANTS,
    PagedConfig,
    cuda_cache_ok,
    paged_choice,
    paged_config,
    parse_choice,
    pick_num_splits_paged,
    shape_class,
    splits_for,
)
from mla_spec.kernels.mla_decode_vsplit import launch_vsplit
from mla_spec.kernels.mla_decode_wgmma import launch_wgmma_mla, wgmma_mla_supported
from mla_spec.kernels.launch.pdl import gdc_launch, gdc_wait
from mla_spec.quant.fp8 import FP8_DTYPE

__all__ = ["PAGED_CONTEXT_DEFAULTS", "PAGED_DEFAULTS", "PAGED_VARIANTS", "PagedConfig",
           "mla_decode_paged", "paged_choice", "paged_config", "paged_supported", "parse_choice",
           "pick_num_splits_paged", "shape_class", "splits_for"]

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["H", "q_len_fixed", "num_splits", "stride_r2t", "num_slots",
                               "stride_lse_s"])
def _mla_paged_kernel(
    Qn, Qp, KV, R2T, RPI, KVL, QO, Out, Lse,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_r2t,
    stride_o_t, stride_o_h, stride_ps, stride_lse_s, num_slots,
    H, q_len_fixed, num_splits, qk_scale_log2, v_scale,
    DV: tl.constexpr, DPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RAGGED: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
    DOT_F32: tl.constexpr, F16: tl.constexpr, TMA: tl.constexpr, USE_GDC: tl.constexpr,
    L2PF: tl.constexpr,
):
    DH: tl.constexpr = DV // 2
    DK: tl.constexpr = DV + DPE
    pid_m = tl.program_id(0)
    sid = tl.program_id(1)
    b = tl.program_id(2)
    if L2PF:  # first KV tiles into L2 before the wait (pdl rule 4)
        prefetch_kv_tiles(KV, R2T, RPI, KVL, QO, b, pid_m, sid, H, q_len_fixed, num_splits,
                          stride_r2t, num_slots, DK, BLOCK_M, BLOCK_N, RAGGED, 2)
    gdc_wait(USE_GDC)
    qo_start, q_len, kv_len, n_rows, m0 = request_rows(QO, KVL, b, pid_m, H, q_len_fixed,
                                                       BLOCK_M, RAGGED)
    if m0 < n_rows:
        req, offs_m, mask_m, tok, head = block_rows(RPI, b, m0, n_rows, qo_start, H, BLOCK_M)
        offs_h = tl.arange(0, DH)
        offs_p = tl.arange(0, DPE)
        qrow = Qn + tok[:, None] * stride_qn_t + head[:, None] * stride_qn_h
        q0 = tl.load(qrow + offs_h[None, :], mask=mask_m[:, None], other=0.0)
        q1 = tl.load(qrow + DH + offs_h[None, :], mask=mask_m[:, None], other=0.0)
        qp = tl.load(Qp + tok[:, None] * stride_qp_t + head[:, None] * stride_qp_h
                     + offs_p[None, :], mask=mask_m[:, None], other=0.0)
        row_scale = qk_scale_log2
        if F16:
            q0, q1, qp, row_scale = fp16_prescaled(q0, q1, qp, row_scale)
        elif DOT_F32:
            q0, q1, qp = q0.to(tl.float32), q1.to(tl.float32), qp.to(tl.float32)
        # NOTE: mla_decode_common.split_window written out: inlining the call moves ptxas'
        # sm_90 spills of variant G (fp8 KV, ragged) by 4 bytes (labels of the inlined range)
        bound = kv_len - q_len + offs_m // H + 1  # [M]: row sees j < bound
        last_row = tl.minimum(m0 + BLOCK_M, n_rows) - 1
        hi_rows = kv_len - q_len + last_row // H + 1
        chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        lo = sid * chunk
        hi = tl.minimum(tl.minimum(lo + chunk, kv_len), hi_rows)
        dsc_v, dsc_p = kv_descriptors(KV, num_slots, DK, DH, DPE, BLOCK_N, TMA)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
        r2t_row = R2T + req * stride_r2t
        offs_r = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            slot0 = tl.load(r2t_row + start)  # first slot of this tile: rows are contiguous
            k0, k1, kp = load_kv_tile(KV, dsc_v, dsc_p, slot0, start, hi, offs_r, offs_h,
                                      offs_p, DH, DV, DK, TMA, F16, DOT_F32)
            if DOT_F32:
                s = tl.dot(q0, tl.trans(k0), input_precision="ieee")
                s = tl.dot(q1, tl.trans(k1), s, input_precision="ieee")
                s = tl.dot(qp, tl.trans(kp), s, input_precision="ieee")
            else:
                s = tl.dot(q0, tl.trans(k0))
                s = tl.dot(q1, tl.trans(k1), s)
                s = tl.dot(qp, tl.trans(kp), s)
            s = s * row_scale
            offs_n = start + offs_r
            vis = (offs_n[None, :] < bound[:, None]) & (offs_n[None, :] < hi)
            s = tl.where(vis, s, float("-inf"))
            p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            if DOT_F32:
                acc0 = tl.dot(p, k0, acc0, input_precision="ieee")
                acc1 = tl.dot(p, k1, acc1, input_precision="ieee")
            else:
                pc = p.to(k0.dtype)
                acc0 = tl.dot(pc, k0, acc0)
                acc1 = tl.dot(pc, k1, acc1)
            m_i = m_new

        gdc_launch(USE_GDC)  # after the KV loop (pdl rule 5)
        has = l_i > 0.0
        inv = tl.where(has, v_scale / tl.where(has, l_i, 1.0), 0.0)
        o0 = acc0 * inv[:, None]
        o1 = acc1 * inv[:, None]
        lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        rows = tok * H + head
        if SPLIT:
            optr = Out + sid * stride_ps + rows[:, None] * DV + offs_h[None, :]
            tl.store(optr, o0.to(Out.dtype.element_ty), mask=mask_m[:, None])
            tl.store(optr + DH, o1.to(Out.dtype.element_ty), mask=mask_m[:, None])
            tl.store(Lse + sid * stride_lse_s + rows, lse2, mask=mask_m)
        else:
            optr = Out + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_h[None, :]
            tl.store(optr, o0.to(Out.dtype.element_ty), mask=mask_m[:, None])
            tl.store(optr + DH, o1.to(Out.dtype.element_ty), mask=mask_m[:, None])
            if WRITE_LSE:
                tl.store(Lse + rows, lse2 * 0.6931471805599453, mask=mask_m)


def paged_supported(device: torch.device, dv: int, dpe: int, page_size: int,
                    kv_dtype: torch.dtype, cfg: PagedConfig | None = None) -> str | None:
    """None when the paged kernel can run here, else why not (the caller falls back)."""
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
            return ("the CUDA kernel takes a bf16 cache (wgmma without prefetch: or fp8 e4m3) "
                    "with Dv 512 / Dpe 64")
    if dv % 32 or dv & (dv - 1) or dpe & (dpe - 1) or dpe < 16:
        return f"needs Dv a power of two >= 32 and Dpe a power of two >= 16 (got {dv}/{dpe})"
    cfg = cfg or paged_config(1, kv_dtype, device, page_size)
    if page_size % cfg.block_n:
        return f"page_size {page_size} is not a multiple of BLOCK_N {cfg.block_n}"
    return None


_ALLOCATOR_SET = False


def _ensure_allocator():
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:
        def alloc(size: int, alignment: int, stream):
            return torch.empty(size, dtype=torch.int8, device="cuda")
        triton.set_allocator(alloc)
        _ALLOCATOR_SET = True


def mla_decode_paged(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, sm_scale,
                     *, page_size: int, k_scale: float = 1.0, v_scale: float = 1.0,
                     q_len: int | None = None, qo_indptr: torch.Tensor | None = None,
                     max_q: int | None = None, max_kv: int | None = None,
                     num_splits: int | None = None, return_lse: bool = False,
                     out: torch.Tensor | None = None, config: PagedConfig | None = None,
                     num_sms: int | None = None, counters: torch.Tensor | None = None,
                     early_kv: bool | None = None):
    """Paged fast path of :func:`mla_spec.kernels.mla_decode.mla_decode` (same result).

    Parameters
    ----------
    q_nope : ``[N, H, Dv]``, q_pe : ``[N, H, Dpe]`` (bf16 / fp16)
    kv_flat : ``[num_slots, Dv + Dpe]`` contiguous; slots page-aligned (see module docstring)
    req_to_token : ``[max_reqs, max_ctx]`` int32; req_pool_indices ``[bs]``; kv_lens ``[bs]``
    page_size : pool page size, a multiple of ``config.block_n``
    q_len (fixed rows per request) or qo_indptr ``[bs + 1]`` with ``max_q`` (ragged)
    max_kv : longest KV (host int; avoids a device sync when picking splits)
    config : tile config (default: ``paged_choice`` for this shape and context); ``vsplit > 1`` or
        ``fused`` runs the sibling kernel of ``mla_decode_vsplit``
    counters : int32 zeros ``>= bs * m_blocks * vsplit`` for the fused combine (default: a
        cached per-device buffer)
    early_kv : the wgmma kernels load their first KV tile before their PDL wait (default
        ``mla_decode_wgmma.EARLY_KV``, off). Only when ``kv_lens``, the page table and every KV
        row but each request's last ``q_len`` were written before the kernel ahead of this
        call began (a decode step: its store writes just the step's rows); see
        ``mla_decode_wgmma.launch_wgmma_mla``. Other kernels ignore it.

    Returns
    -------
    ``[N, H, Dv]`` in q_nope's dtype (and the natural-log ``lse [N, H]`` fp32 if asked).
    """
    check_mla_inputs(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr)
    n, h, dv = q_nope.shape
    dpe = q_pe.shape[-1]
    bs = req_pool_indices.numel()
    dev = q_nope.device
    if (q_len is None) == (qo_indptr is None):
        raise ValueError("give exactly one of q_len (fixed rows per request) or qo_indptr")
    pinned = None
    if config is None:
        if max_kv is None and num_splits is None and dev.type == "cuda":
            max_kv = int(kv_lens.max()) if bs else 0  # read below for the splits anyway
        config, pinned = paged_choice((q_len or max_q or 1) * h, kv_flat.dtype, dev, page_size,
                                      bs, max_kv, fixed=q_len is not None)
    cfg = config
    why = paged_supported(dev, dv, dpe, page_size, kv_flat.dtype, cfg)
    if why:
        raise ValueError(f"mla_decode_paged: {why}")
    if kv_flat.shape[-1] != dv + dpe or not kv_flat.is_contiguous():
        raise ValueError(f"kv_flat must be contiguous [slots, {dv + dpe}]")
    if q_len is None and max_q is None:
        max_q = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if bs else 0
    rows = (q_len if q_len is not None else max_q) * h
    m_blocks = max(1, triton.cdiv(rows, cfg.block_m))
    if num_splits is None:
        num_splits = pinned
    if num_splits is None:
        mk = max_kv if max_kv is not None else (int(kv_lens.max()) if bs else 0)
        sms = num_sms or (sm_count(dev) if dev.type == "cuda" else 4)
        num_splits = splits_for(cfg, bs, m_blocks, mk, rows,
                                kv_flat.shape[-1] * kv_flat.element_size(), sms, dv)
    if out is None:
        out = torch.empty((n, h, dv), dtype=q_nope.dtype, device=dev)
    lse = torch.empty((n, h), dtype=torch.float32, device=dev) if return_lse else None
    if n == 0 or bs == 0:
        return (out, lse) if return_lse else out
    interp = dev.type == "cpu"
    is_fp8 = kv_flat.dtype == FP8_DTYPE
    if not (interp or is_fp8 or q_nope.dtype == kv_flat.dtype == q_pe.dtype):
        raise ValueError(f"queries {q_nope.dtype} must match the {kv_flat.dtype} cache")
    if cfg.tma and not interp:
        _ensure_allocator()
    if cfg.cuda:
        tile = CudaTile(cfg.block_m, cfg.block_n, cfg.num_stages, cfg.num_warps)
        why = (wgmma_mla_supported(q_nope, q_pe, kv_flat, page_size, q_len, cfg)
               if cfg.wgmma else cuda_mla_supported(q_nope, q_pe, kv_flat, page_size, tile, q_len))
        if why:
            raise ValueError(f"mla_decode_paged: variant {cfg.tag}: {why}")
        args = (q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, out, lse,
                float(sm_scale) * float(k_scale) * _LOG2E, v_scale)
        if cfg.wgmma:
            launch_wgmma_mla(*args, q_len=q_len, m_blocks=m_blocks, num_splits=num_splits,
                             kind=cfg, early_kv=early_kv)
        else:
            launch_cuda_mla(*args, q_len=q_len, m_blocks=m_blocks, num_splits=num_splits,
                            tile=tile)
        return (out, lse) if return_lse else out
    if cfg.swap:
        launch_swapab(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr,
                      out, lse, float(sm_scale) * float(k_scale) * _LOG2E, v_scale, q_len=q_len,
                      m_blocks=m_blocks, num_splits=num_splits, cfg=cfg, interp=interp,
                      is_fp8=is_fp8)
        return (out, lse) if return_lse else out
    if cfg.sibling_kernel:
        launch_vsplit(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr,
                      out, lse, float(sm_scale) * float(k_scale) * _LOG2E, v_scale, q_len=q_len,
                      m_blocks=m_blocks, num_splits=num_splits, cfg=cfg, interp=interp,
                      counters=counters)
        return (out, lse) if return_lse else out
    split = num_splits > 1
    if split:
        pdt = torch.bfloat16 if cfg.part_bf16 else torch.float32
        part = torch.empty((num_splits, n * h, dv), dtype=pdt, device=dev)
        part_lse = torch.empty((num_splits, n * h), dtype=torch.float32, device=dev)
        o_arg, l_arg = part, part_lse
    else:
        o_arg, l_arg = out, (lse if return_lse else out)
    qo = qo_indptr if qo_indptr is not None else kv_lens  # dummy when fixed
    _mla_paged_kernel[(m_blocks, num_splits, bs)](
        q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo, o_arg, l_arg,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1),
        (n * h * dv) if split else 0, (n * h) if split else 0, kv_flat.shape[0],
        h, q_len or 0, num_splits, float(sm_scale) * float(k_scale) * _LOG2E, float(v_scale),
        DV=dv, DPE=dpe, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        RAGGED=qo_indptr is not None, SPLIT=split, WRITE_LSE=return_lse,
        DOT_F32=interp and not is_fp8, F16=is_fp8, TMA=cfg.tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **attn_pdl_kwargs(q_nope, cfg),
    )
    if split:
        combine_splits(part, part_lse, out, lse)
    return (out, lse) if return_lse else out
