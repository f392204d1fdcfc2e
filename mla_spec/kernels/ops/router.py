"""DeepSeek-V3 grouped top-k routing ("noaux_tc"), one program per token holding its ``E`` logits,
in place of the dozen small kernels of :func:`route_tokens` (the reference); :func:`gate_logits`
computes the logits::

    s = sigmoid(logits)            (or softmax)              [E]
    c = s + e_score_correction_bias                          [E]  (selection only)
    group score = top-1 + top-2 of c within each of n_group groups
    keep the topk_group best groups; c = -inf elsewhere
    top_k experts by c (k argmax rounds; ties go to the lower expert id)
    weights = s[ids] (normalized to sum 1 when norm_topk_prob) * routed_scaling_factor
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mla_spec.device import use_triton
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs

__all__ = ["GATE_GEMV_MAX_N", "GateConfig", "fused_route", "fused_route_ref",
           "fused_route_supports", "gate_config", "gate_logits", "gate_logits_ref", "route_tokens"]


#: Warps of the routing program at E >= 256: one warp's argmax rounds are shuffles alone
ROUTE_WARPS = 1


@triton.jit(do_not_specialize=["shared_id"])
def _route_kernel(logits_ptr, bias_ptr, w_ptr, id_ptr, stride_l, scale, shared_id,
                  E: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, K: tl.constexpr,
                  KP: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                  SIGMOID: tl.constexpr, SHARED: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E)
    x = tl.load(logits_ptr + row * stride_l + offs).to(tl.float32)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        z = tl.exp(x - tl.max(x, 0))
        s = z / tl.sum(z, 0)
    c = s
    if HAS_BIAS:
        c = s + tl.load(bias_ptr + offs).to(tl.float32)
    if G > 1:
        EG: tl.constexpr = E // G
        cg = tl.reshape(c, (G, EG))
        cols = tl.arange(0, EG)
        top1 = tl.max(cg, 1)
        first = tl.argmax(cg, 1)
        if EG > 1:
            top2 = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), cg), 1)
            gscore = top1 + top2
        else:
            gscore = top1
        gids = tl.arange(0, G)
        keep = gids < 0
        for _ in tl.static_range(TG):
            best = tl.argmax(gscore, 0)
            keep = keep | (gids == best)
            gscore = tl.where(gids == best, float("-inf"), gscore)
        keep_e = tl.reshape(tl.broadcast_to(keep[:, None], (G, EG)), (E,))
        c = tl.where(keep_e, c, float("-inf"))
    slots = tl.arange(0, KP)
    ids = tl.zeros((KP,), dtype=tl.int64)
    ws = tl.zeros((KP,), dtype=tl.float32)
    for k in tl.static_range(K):
        i = tl.argmax(c, 0)
        ids = tl.where(slots == k, i.to(tl.int64), ids)
        ws = tl.where(slots == k, tl.sum(tl.where(offs == i, s, 0.0), 0), ws)
        c = tl.where(offs == i, float("-inf"), c)
    if NORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    ws = ws * scale
    KO: tl.constexpr = K + 1 if SHARED else K  # columns written
    if SHARED:  # slot K: the shared expert, weight 1.0 (KP > K holds it)
        ids = tl.where(slots == K, shared_id.to(tl.int64), ids)
        ws = tl.where(slots == K, 1.0, ws)
    ok = slots < KO
    tl.store(w_ptr + row * KO + slots, ws, mask=ok)
    tl.store(id_ptr + row * KO + slots, ids.to(id_ptr.dtype.element_ty), mask=ok)


def fused_route_supports(num_experts: int, n_group: int, topk_group: int, top_k: int) -> bool:
    """Whether the kernel handles this routing shape (else ``route_tokens`` runs)."""
    e, g = num_experts, n_group
    return (e > 0 and not e & (e - 1) and g >= 1 and not e % g and not (e // g) & (e // g - 1)
            and 1 <= topk_group <= g and 1 <= top_k <= topk_group * (e // g))


def _check(router_logits, bias, top_k, n_group, topk_group, scoring_func):
    if router_logits.dim() != 2 or router_logits.dtype != torch.float32:
        raise ValueError(f"router_logits must be [N, E] float32, got "
                         f"{tuple(router_logits.shape)} {router_logits.dtype}")
    n, e = router_logits.shape
    if e & (e - 1) or n_group < 1 or e % n_group or (e // n_group) & (e // n_group - 1):
        raise ValueError(f"the fused router needs E a power of two split into n_group groups of a "
                         f"power-of-two size; got E = {e}, n_group = {n_group}")
    if not 1 <= topk_group <= n_group or not 1 <= top_k <= topk_group * (e // n_group):
        raise ValueError(f"top_k = {top_k} / topk_group = {topk_group} do not fit E = {e} in "
                         f"{n_group} groups")
    if bias is not None and (bias.shape != (e,) or bias.device != router_logits.device):
        raise ValueError(f"e_score_correction_bias must be [{e}] on {router_logits.device}")
    if scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring_func {scoring_func!r}: supported 'sigmoid', 'softmax'")


def fused_route(router_logits: torch.Tensor, bias: torch.Tensor | None, *, top_k: int,
                n_group: int, topk_group: int, norm_topk_prob: bool,
                routed_scaling_factor: float, scoring_func: str = "sigmoid",
                shared_id: int | None = None, ids_dtype: torch.dtype = torch.int64
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_tokens`` in one kernel; ``shared_id`` appends the column ``(shared_id, 1.0)``."""
    _check(router_logits, bias, top_k, n_group, topk_group, scoring_func)
    if ids_dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids_dtype must be torch.int64 or torch.int32, got {ids_dtype}")
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group,
              norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
              scoring_func=scoring_func, shared_id=shared_id, ids_dtype=ids_dtype)
    if not use_triton(router_logits):
        return fused_route_ref(router_logits, bias, **kw)
    n, e = router_logits.shape
    ko = top_k + (shared_id is not None)
    weights = torch.empty((n, ko), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((n, ko), dtype=ids_dtype, device=router_logits.device)
    if n:
        _route_kernel[(n,)](
            router_logits, bias if bias is not None else router_logits, weights, ids,
            router_logits.stride(0), float(routed_scaling_factor), int(shared_id or 0),
            E=e, G=n_group, TG=topk_group, K=top_k, KP=triton.next_power_of_2(ko),
            HAS_BIAS=bias is not None, NORM=norm_topk_prob, SIGMOID=scoring_func == "sigmoid",
            SHARED=shared_id is not None,
            num_warps=ROUTE_WARPS if e >= 256 else 1, **pdl_kwargs(router_logits))
    return weights, ids


# ---- router logits ---------------------------------------------------------------------------
#: Tokens up to which :func:`gate_logits` runs its kernel on CUDA (cuBLAS above: a GEMM).
GATE_GEMV_MAX_N = 4


@dataclass(frozen=True)
class GateConfig:
    """Tile of :func:`gate_logits`: experts per program, hidden elements per step, warps."""

    block_e: int = 1
    block_k: int = 8192
    num_warps: int = 8


#: Per padded token count: 2026-11-29, ``python3 benchmarks/bench_router.py``
GATE_CONFIGS: dict[int, GateConfig] = {1: GateConfig(1, 8192, 8), 2: GateConfig(1, 8192, 16),
                                       4: GateConfig(1, 8192, 8)}


def gate_config(n: int, num_experts: int, hidden: int) -> GateConfig:
    """``GATE_CONFIGS`` for ``n`` tokens, clipped to ``num_experts`` and the hidden size."""
    cfg = GATE_CONFIGS[triton.next_power_of_2(max(n, 1))]
    be = cfg.block_e
    while num_experts % be:
        be //= 2
    return GateConfig(be, min(cfg.block_k, triton.next_power_of_2(hidden)), cfg.num_warps)


# K (the hidden size) stays specializable: a multiple of 16 keeps 16-byte vector loads
@triton.jit(do_not_specialize=["N"])
def _gate_logits_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_xn, stride_we, stride_on,
                        NT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                        USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    # experts [pid * BE, pid * BE + BE) for every token; [NT, BE, BK] products summed over K
    offs_e = tl.program_id(0) * BE + tl.arange(0, BE)
    offs_t = tl.arange(0, NT)
    t_ok = offs_t < N
    acc = tl.zeros([NT, BE], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < K
        w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_we + offs_k[None, :],
                    mask=k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_xn + offs_k[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(out_ptr + offs_t[:, None] * stride_on + offs_e[None, :], acc, mask=t_ok[:, None])


def gate_logits(x: torch.Tensor, weight: torch.Tensor, cfg: GateConfig | None = None
                ) -> torch.Tensor:
    """Router logits ``[N, E]`` fp32 of ``x [N, hidden]`` and the fp32 ``weight [E, hidden]``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gate_logits expects x [N, hidden] and weight [E, hidden]; got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}: one device expected")
    n, k = x.shape
    e = weight.shape[0]
    if (not use_triton(x) or n > GATE_GEMV_MAX_N or n == 0 or weight.dtype != torch.float32
            or weight.stride(1) != 1 or x.stride(1) != 1
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return gate_logits_ref(x, weight)
    cfg = cfg or gate_config(n, e, k)
    if e % cfg.block_e:
        raise ValueError(f"GateConfig.block_e = {cfg.block_e} must divide E = {e}")
    out = torch.empty((n, e), dtype=torch.float32, device=x.device)
    _gate_logits_kernel[(e // cfg.block_e,)](
        x, weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        NT=triton.next_power_of_2(n), BE=cfg.block_e, BK=cfg.block_k,
        num_warps=cfg.num_warps, **pdl_kwargs(x))
    return out


# ---- torch references (route_tokens also runs wherever the kernel does not) ---------------
def route_tokens(router_logits: torch.Tensor, bias: torch.Tensor | None, *, top_k: int,
                 n_group: int, topk_group: int, norm_topk_prob: bool,
                 routed_scaling_factor: float, scoring_func: str = "sigmoid"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped top-k routing of ``router_logits [N, E]`` -> (weights fp32, ids int64) ``[N, k]``."""
    if scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring_func {scoring_func!r}: supported 'sigmoid', 'softmax'")
    scores = router_logits.sigmoid() if scoring_func == "sigmoid" else router_logits.softmax(-1)
    n, e = scores.shape
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        grouped = choice.view(n, n_group, e // n_group)
        group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(-1)  # [N, G]
        keep = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, topk_ids


def fused_route_ref(router_logits, bias, *, top_k, n_group, topk_group, norm_topk_prob,
                    routed_scaling_factor, scoring_func="sigmoid", shared_id=None,
                    ids_dtype=torch.int64):
    """``route_tokens`` in the kernel's output order, then the shared column and the id dtype."""
    w, ids = route_tokens(router_logits, bias, top_k=top_k, n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                          routed_scaling_factor=routed_scaling_factor, scoring_func=scoring_func)
    scores = router_logits.sigmoid() if scoring_func == "sigmoid" else router_logits.softmax(-1)
    choice = scores if bias is None else scores + bias.float()
    order = choice.gather(1, ids).argsort(dim=1, descending=True, stable=True)
    w, ids = w.gather(1, order), ids.gather(1, order)
    if shared_id is not None:
        n = ids.shape[0]
        ids = torch.cat((ids, torch.full((n, 1), shared_id, dtype=ids.dtype, device=ids.device)), 1)
        w = torch.cat((w, torch.ones((n, 1), dtype=w.dtype, device=w.device)), 1)
    return w, ids.to(ids_dtype)


def gate_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Reference of ``router.gate_logits``: ``x.float() @ weight.float()^T``."""
    return F.linear(x.float(), weight.float())
