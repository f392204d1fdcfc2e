"""Dense (BF16) SwiGLU experts at a few tokens, read by expert id: no sort, no grouped GEMM, no
host sync (CUDA-graph safe). Two launches: ``act[p] = silu(x[p // k] w_gate[e_p]^T) * (x[p // k]
w_up[e_p]^T)`` for every (token, slot) pair ``p``, grid ``(I / BN, pairs)``; then ``out[t] = sum_j
w[t, j] * act[t k + j] w2[e_{t k + j}]^T``, grid ``(K / BN, tokens)``, the slots summed in order.
fp32 accumulation, bf16 ``act`` between them (as the grouped path rounds). Twin:
:func:`moe_gemv_bf16_ref`. The MTP layer of NVIDIA's FP4 checkpoints keeps such experts; its draft
forwards run 1-4 rows a request.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mla_spec.device import use_triton

__all__ = ["MOE_GEMV_BF16_MAX_PAIRS", "moe_gemv_bf16", "moe_gemv_bf16_ref"]

#: (token, slot) pairs up to which :func:`moe_gemv_bf16` runs (above: the grouped GEMMs)
MOE_GEMV_BF16_MAX_PAIRS = 16


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, ids_ptr, act_ptr, INTER, K, TOPK, s_xm, s_we, s_wn, s_am,
                    BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    row = pair // TOPK
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < INTER
    w_gate = w13_ptr + e * s_we + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    w_up = w_gate + INTER * s_wn
    acc_g = tl.zeros([BN, BK], dtype=tl.float32)
    acc_u = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = k0 + offs_k < K
        xk = tl.load(x_ptr + row * s_xm + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        m = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(w_gate + k0, mask=m, other=0.0).to(tl.float32) * xk[None, :]
        acc_u += tl.load(w_up + k0, mask=m, other=0.0).to(tl.float32) * xk[None, :]
    g = tl.sum(acc_g, 1).to(act_ptr.dtype.element_ty).to(tl.float32)
    u = tl.sum(acc_u, 1).to(act_ptr.dtype.element_ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(act_ptr.dtype.element_ty).to(tl.float32) * u
    tl.store(act_ptr + pair * s_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_kernel(act_ptr, w2_ptr, ids_ptr, tw_ptr, out_ptr, K, INTER, s_am, s_we, s_wn, s_om,
                 TOPK: tl.constexpr, BN: tl.constexpr, BI: tl.constexpr):
    pid_n = tl.program_id(0)
    tok = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_i = tl.arange(0, BI)
    n_ok = offs_n < K
    out = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = tok * TOPK + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        w = tl.load(tw_ptr + pair).to(tl.float32)
        rows = w2_ptr + e * s_we + offs_n[:, None].to(tl.int64) * s_wn + offs_i[None, :]
        acc = tl.zeros([BN, BI], dtype=tl.float32)
        for i0 in range(0, INTER, BI):
            i_ok = i0 + offs_i < INTER
            a = tl.load(act_ptr + pair * s_am + i0 + offs_i, mask=i_ok, other=0.0)
            wt = tl.load(rows + i0, mask=n_ok[:, None] & i_ok[None, :], other=0.0)
            acc += wt.to(tl.float32) * a.to(tl.float32)[None, :]
        y = tl.sum(acc, 1).to(out_ptr.dtype.element_ty).to(tl.float32)
        out += (y * w).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + tok * s_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def moe_gemv_bf16_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Torch twin: each (token, slot) pair through its expert, weighted, slots summed in order."""
    n, k = topk_ids.shape
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for j in range(k):
        e = topk_ids[:, j].long()
        h = torch.bmm(w13[e], x[:, :, None])[..., 0]  # [n, 2I]
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = torch.bmm(w2[e], act[:, :, None])[..., 0]
        out += (y * topk_weights[:, j, None].to(y.dtype)).to(x.dtype)
    return out


def moe_gemv_bf16(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``sum_j topk_weights[n, j] * expert_{topk_ids[n, j]}(x[n])``: ``x [N, K]``, ``w13 [E, 2I,
    K]`` (gate rows, then up), ``w2 [E, K, I]``, both with unit last stride -> ``[N, K]`` in x's
    dtype. Ids must lie in ``[0, E)`` (the router's output)."""
    n, k = topk_ids.shape
    if x.dim() != 2 or w13.dim() != 3 or w2.shape[0] != w13.shape[0] or \
            w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1] or \
            w2.shape[2] * 2 != w13.shape[1] or topk_weights.shape != (n, k) or x.shape[0] != n:
        raise ValueError(f"moe_gemv_bf16 expects x [N, K], ids / weights [N, k], w13 [E, 2I, K], "
                         f"w2 [E, K, I]; got {tuple(x.shape)}, {tuple(topk_ids.shape)}, "
                         f"{tuple(topk_weights.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    if not use_triton(x) or n == 0:
        return moe_gemv_bf16_ref(x, topk_weights, topk_ids, w13, w2)
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("moe_gemv_bf16 reads x, w13 and w2 with unit last stride")
    kdim, inter = x.shape[1], w2.shape[2]
    ids = topk_ids.contiguous()
    act = torch.empty((n * k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    bn = 16
    _gate_up_kernel[(triton.cdiv(inter, bn), n * k)](
        x, w13, ids, act, inter, kdim, k, x.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), BN=bn, BK=min(256, triton.next_power_of_2(kdim)), num_warps=4)
    _down_kernel[(triton.cdiv(kdim, bn), n)](
        act, w2, ids, topk_weights.contiguous(), out, kdim, inter, act.stride(0), w2.stride(0),
        w2.stride(1), out.stride(0), TOPK=k, BN=bn, BI=min(256, triton.next_power_of_2(inter)),
        num_warps=4)
    return out
