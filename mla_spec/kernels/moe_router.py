"""DeepSeek-V3 grouped top-k routing ("noaux_tc") in one Triton program per token.

The torch path (``mla_spec.models.moe.route_tokens``, also this module's twin) runs about a dozen
small kernels per MoE layer (sigmoid, bias add, group top-2, group top-k, mask, top-k, gather,
normalize, scale). At decode batch sizes each costs a launch, ~2 µs in a CUDA graph, which is a
large share of a layer whose expert weights take tens of µs to read. Here one program holds a
token's ``E`` router logits in registers and does the whole selection:

    s = sigmoid(logits)            (or softmax)              [E]
    c = s + e_score_correction_bias                          [E]  (selection only)
    group score = top-1 + top-2 of c within each of n_group groups
    keep the topk_group best groups; c = -inf elsewhere
    top_k experts by c (k argmax rounds; ties go to the lower expert id)
    weights = s[ids] (normalized to sum 1 when norm_topk_prob) * routed_scaling_factor

Shapes: ``router_logits [N, E]`` (fp32, any row stride) -> ``topk_weights [N, top_k]`` fp32,
``topk_ids [N, top_k]`` int64, ids in descending score order. ``E`` a power of two and a
multiple of ``n_group`` (DeepSeek-V3: 256 experts, 8 groups, top-4 groups, top-8).

Options for the fused NVFP4 MoE, which would otherwise append and convert in two more kernels:
``shared_id`` appends a column ``(shared_id, 1.0)`` (the shared expert run as one more top-k
column, ``[N, top_k + 1]``) and ``ids_dtype`` writes int32 ids.

The router logits themselves (``x @ gate.weight^T`` in fp32) come from :func:`gate_logits` at
decode sizes: one kernel reads the bf16 activations and the fp32 ``[E, hidden]`` weight, where
torch needs a cast kernel and an fp32 cuBLAS GEMV (6.7 µs for DeepSeek's 256 x 7168 on the
H200, 1.1 TB/s).

On by default for CUDA tensors (``mla_spec.models.moe.FUSED_ROUTER``). Checked against its twin
under the CPU interpreter and on the H200; there it replaced torch's ~12 routing kernels and
took the MoE block at bs 1 from 147 to 107 µs (docs/bench_layer.md). 30 registers, no spills,
at DeepSeek's 256 / 8 / 4 / 8.
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
           "fused_route_supports", "gate_config", "gate_logits", "gate_logits_ref"]


#: Warps of the routing program at E >= 256 (smaller E: 1). Its argmax rounds are block-wide
#: reductions, which a single warp does with shuffles alone: 3.8 µs per call in a CUDA graph on
#: the H200 at 1 warp, 5.6 at 4 (``benchmarks/bench_router.py``).
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
    """Whether the kernel handles this routing shape (E a power of two in ``n_group`` groups of
    a power-of-two size, ``top_k`` within the kept groups); else ``route_tokens`` must run."""
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
    """Same contract as ``route_tokens`` (module docstring); Triton when ``use_triton``, else
    the twin. ``shared_id``: append the column ``(shared_id, 1.0)``; ``ids_dtype``: int64 or
    int32. No host sync, no allocation beyond the two outputs (CUDA-graph safe)."""
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


def fused_route_ref(router_logits, bias, *, top_k, n_group, topk_group, norm_topk_prob,
                    routed_scaling_factor, scoring_func="sigmoid", shared_id=None,
                    ids_dtype=torch.int64):
    """Torch twin: ``route_tokens`` with the kernel's output order (descending choice score),
    then the optional shared column and the id dtype."""
    from mla_spec.models.moe import route_tokens

    w, ids = route_tokens(router_logits, bias, top_k=top_k, n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                          routed_scaling_factor=routed_scaling_factor, scoring_func=scoring_func)
    scores = router_logits.sigmoid() if scoring_func == "sigmoid" else router_logits.softmax(-1)
    choice = scores if bias is None else scores + bias.float()
    order = choice.gather(1, ids).argsort(dim=1, descending=True, stable=True)
    w, ids = w.gather(1, order), ids.gather(1, order)
    if shared_id is not None:
        n = ids.shape[0]
        ids = torch.cat((ids, torch.full((n, 1), shared_id, dtype=ids.dtype, device=ids.device)),
                        1)
        w = torch.cat((w, torch.ones((n, 1), dtype=w.dtype, device=w.device)), 1)
    return w, ids.to(ids_dtype)


# ---- router logits ---------------------------------------------------------------------------
#: Tokens up to which :func:`gate_logits` runs its kernel on CUDA (cuBLAS above: a GEMM).
GATE_GEMV_MAX_N = 4


@dataclass(frozen=True)
class GateConfig:
    """Tile of :func:`gate_logits`: ``block_e`` experts per program, ``block_k`` of the hidden
    dimension per step (``>= hidden``: one shot, every load in flight at once), warps."""

    block_e: int = 1
    block_k: int = 8192
    num_warps: int = 8


#: Per padded token count (1, 2, 4): picked on the H200 by ``benchmarks/bench_router.py``.
#: H200, 2026-11-29, sixth session (docs/bench_router.md; hidden size specialized): 4.7 / 4.7 /
#: 5.8 µs at 1 / 2 / 4 tokens for DeepSeek's 256 x 7168, against 9.8 / 19.0 / 19.2 µs for
#: torch (cast + cuBLAS fp32).
GATE_CONFIGS: dict[int, GateConfig] = {
    1: GateConfig(1, 8192, 8),
    2: GateConfig(1, 8192, 16),
    4: GateConfig(1, 8192, 8),
}


def gate_config(n: int, num_experts: int, hidden: int) -> GateConfig:
    """``GATE_CONFIGS`` for ``n`` tokens, ``block_e`` clipped to divide ``num_experts`` and
    ``block_k`` to the hidden size's power of two (small models, the interpreter)."""
    cfg = GATE_CONFIGS[triton.next_power_of_2(max(n, 1))]
    be = cfg.block_e
    while num_experts % be:
        be //= 2
    return GateConfig(be, min(cfg.block_k, triton.next_power_of_2(hidden)), cfg.num_warps)


# K (the hidden size, fixed per model) stays specializable: Triton then knows it is a multiple
# of 16 and the masked loads become 16-byte vector loads (offline sm_90 compile: 12 per thread
# instead of 64 scalar ones at 1 token; added after the last H200 measurement).
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


def gate_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`gate_logits`: ``x.float() @ weight.float()^T``."""
    return F.linear(x.float(), weight.float())


def gate_logits(x: torch.Tensor, weight: torch.Tensor, cfg: GateConfig | None = None
                ) -> torch.Tensor:
    """Router logits ``[N, E]`` fp32 of ``x [N, hidden]`` (bf16 / fp16 / fp32, unit last stride)
    and the fp32 gate ``weight [E, hidden]``: one Triton kernel for ``N <= GATE_GEMV_MAX_N`` on
    a Triton device (fp32 products and sums; the order of the sum differs from cuBLAS, so the
    logits agree to fp32 rounding), :func:`gate_logits_ref` otherwise. CUDA-graph safe."""
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
