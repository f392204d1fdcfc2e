"""Dense (BF16) routed experts as two grouped GEMMs: the MTP layer of NVIDIA's FP4 checkpoints.

Rows are sorted by expert, ``torch._grouped_mm`` runs over the stacked ``w13 [E, 2I, K]`` and
``w2 [E, K, I]``, and ``index_add_`` sums the weighted rows back: no host sync, CUDA-graph safe.
Expert weights become views of the stack (:func:`stack_dense_experts`); :func:`still_stacked`
notices a later ``.to()``. Timings: ``docs/bench_layer.md``.
"""

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["stack_dense_experts", "still_stacked", "grouped_supported", "grouped_experts_forward"]


def stack_dense_experts(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stack dense SwiGLU experts into ``(w13 [E, 2I, K], w2 [E, K, I])``, their weights becoming
    views of it; None when they cannot stack (quantized, biased, mixed shapes / dtypes)."""
    lins = [(e.gate_proj, e.up_proj, e.down_proj) for e in experts]
    if not lins:
        return None
    g0, _, d0 = lins[0]
    for trio in lins:
        for lin, ref in zip(trio, (g0, g0, d0)):
            w = getattr(lin, "weight", None)
            if (getattr(lin, "quantized", False) or not isinstance(w, nn.Parameter)
                    or getattr(lin, "bias", None) is not None or w.shape != ref.weight.shape
                    or w.dtype != ref.weight.dtype or w.device != ref.weight.device):
                return None
    inter, k = g0.weight.shape
    e = len(lins)
    w13 = torch.empty((e, 2 * inter, k), dtype=g0.weight.dtype, device=g0.weight.device)
    w2 = torch.empty((e, *d0.weight.shape), dtype=d0.weight.dtype, device=d0.weight.device)
    with torch.no_grad():
        for i, (g, u, d) in enumerate(lins):
            w13[i, :inter].copy_(g.weight)
            w13[i, inter:].copy_(u.weight)
            w2[i].copy_(d.weight)
    for i, (g, u, d) in enumerate(lins):
        for lin, view in ((g, w13[i, :inter]), (u, w13[i, inter:]), (d, w2[i])):
            lin.weight = nn.Parameter(view, requires_grad=lin.weight.requires_grad)
    return w13, w2


def still_stacked(experts: nn.ModuleList, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the experts' weights still live in ``w13`` / ``w2`` (a ``.to()`` breaks it)."""
    first, last = experts[0], experts[-1]
    inter = first.gate_proj.weight.shape[0]
    e = len(experts) - 1
    return (first.gate_proj.weight.data_ptr() == w13[0].data_ptr()
            and last.up_proj.weight.data_ptr() == w13[e, inter:].data_ptr()
            and last.down_proj.weight.data_ptr() == w2[e].data_ptr())


def grouped_supported(x: torch.Tensor, w13: torch.Tensor) -> str | None:
    """None when :func:`grouped_experts_forward` can run ``x`` with these weights, else why.
    CUDA: BF16 activations and weights, SM90+, rows 16-byte aligned (K and I multiples of 8)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    if x.dtype != w13.dtype or x.device != w13.device:
        return f"x is {x.dtype} on {x.device}, the experts {w13.dtype} on {w13.device}"
    if x.is_cuda:
        if x.dtype != torch.bfloat16:
            return f"torch._grouped_mm on CUDA needs bfloat16, got {x.dtype}"
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return "torch._grouped_mm needs SM90 or newer"
        if w13.shape[-1] % 8 or w13.shape[1] % 16:
            return f"K = {w13.shape[-1]} and I = {w13.shape[1] // 2} must be multiples of 8"
    return None


def grouped_experts_forward(x: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, w13: torch.Tensor,
                            w2: torch.Tensor) -> torch.Tensor:
    """``sum_j topk_weights[n, j] * expert_{topk_ids[n, j]}(x[n])`` with SwiGLU experts:
    ``x [N, K]``, fp32 weights and ids ``[N, k]``, ``w13 [E, 2I, K]`` (gate rows, then up),
    ``w2 [E, K, I]`` -> ``[N, K]`` in x's dtype."""
    n, k = topk_ids.shape
    if n == 0:
        return torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // k
    h = torch._grouped_mm(x.index_select(0, tok), w13.transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(g) * u).contiguous(), w2.transpose(-2, -1), offs=offs)
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)
