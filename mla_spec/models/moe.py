"""DeepSeek-V3 feed-forward blocks: the dense SwiGLU MLP and the routed MoE with shared experts.

Dense MLP: ``down(silu(gate(x)) * up(x))``, intermediate dim split over TP, one all-reduce.
Router ("noaux_tc"): ``scores = sigmoid(x @ W_gate^T)`` in fp32; groups are scored by the sum of
their top-2 *biased* scores (``+ e_score_correction_bias``), the best ``topk_group`` groups stay,
and the top ``num_experts_per_tok`` biased scores among them are chosen; the weights are the
*unbiased* scores, normalized to sum 1, times ``routed_scaling_factor``. MoE output: ``sum_k w_k
* expert_{id_k}(x) + shared_experts(x)``, one all-reduce. NVFP4 experts are stacked for one
``fused_moe_nvfp4`` launch (an NVFP4 shared expert may ride as one more expert of weight 1.0).
On CUDA at inference the fused kernels run; CPU and training take the torch code.
"""

import torch
import torch.nn.functional as F
from torch import nn

from mla_spec.device import use_triton
from mla_spec.distributed import tp_all_reduce
from mla_spec.kernels.ops import route_tokens
from mla_spec.kernels.ops.moe_gemv_bf16 import MOE_GEMV_BF16_MAX_PAIRS, moe_gemv_bf16
from mla_spec.models.batch_invariant import per_row
from mla_spec.models.linear import ColumnParallelLinear, RowParallelLinear
from mla_spec.models.moe_grouped import (
    grouped_experts_forward,
    grouped_supported,
    stack_dense_experts,
    still_stacked,
)

__all__ = ["DenseMLP", "MoEGate", "DeepseekV3MoE", "route_tokens", "shared_fusion_pays",
           "shared_expert_column", "with_shared_column"]

def shared_fusion_pays(num_tokens: int) -> bool:
    """Whether the shared expert rides in the fused launch for ``num_tokens`` rows: not on the
    per-pair GEMV path (2..``MOE_GEMV_MAX_M`` tokens; ``docs/bench_layer.md``)."""
    from mla_spec.kernels.nvfp4 import MOE_GEMV_MAX_M

    return num_tokens <= 1 or num_tokens > MOE_GEMV_MAX_M


def shared_expert_column(shared_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[1, 1]`` id (int64) and weight (1.0, fp32) :func:`with_shared_column` appends."""
    return (torch.full((1, 1), shared_id, dtype=torch.int64, device=device),
            torch.ones((1, 1), device=device))


def with_shared_column(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       column: tuple[torch.Tensor, torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, k] -> [N, k + 1]``: every token also selects the shared expert with weight 1.0."""
    n = topk_ids.shape[0]
    sid, sw = column
    return (torch.cat((topk_ids, sid.to(topk_ids.dtype).expand(n, 1)), 1),
            torch.cat((topk_weights, sw.to(topk_weights.dtype).expand(n, 1)), 1))


class DenseMLP(nn.Module):
    """SwiGLU MLP, intermediate dim split over ``tp_size`` ranks (``reduce_results=False``
    leaves the partial sum un-reduced: experts, shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, prefix: str = "",
                 quantized=None, tp_size: int = 1, reduce_results: bool = True,
                 dtype=torch.float32, device=None) -> None:
        super().__init__()
        q = quantized or (lambda name: False)
        kw = dict(tp_size=tp_size, dtype=dtype, device=device)
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size,
                                              quantized=q(f"{prefix}.gate_proj"), **kw)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size,
                                            quantized=q(f"{prefix}.up_proj"), **kw)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size,
                                           quantized=q(f"{prefix}.down_proj"),
                                           reduce_results=reduce_results, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., hidden]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    """``mlp.gate``: ``weight [E, hidden]`` and ``e_score_correction_bias [E]``, kept in fp32."""

    def __init__(self, cfg, device=None) -> None:
        super().__init__()
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, device=device))
        use_bias = cfg.topk_method == "noaux_tc"
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(E, device=device) if use_bias else None)
        self.top_k, self.n_group, self.topk_group = (cfg.num_experts_per_tok, cfg.n_group,
                                                     cfg.topk_group)
        if cfg.topk_method == "greedy":
            self.n_group = self.topk_group = 1
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.scoring_func = cfg.scoring_func
        # None: the kernel on CUDA where it handles the routing shape; True: wherever Triton
        # runs; False: route_tokens everywhere
        self.fused_router: bool | None = None
        from mla_spec.kernels.ops import fused_route_supports

        self._kernel_fits = fused_route_supports(E, self.n_group, self.topk_group, self.top_k)

    def forward(self, x: torch.Tensor, *, shared_id: int | None = None,
                ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, hidden]`` -> ``(topk_weights [N, k] fp32, topk_ids [N, k] int64)``. ``shared_id``
        appends the column ``(shared_id, 1.0)`` and ``ids_dtype`` may be int32 (for the fused NVFP4
        MoE; the router kernel writes both itself)."""
        kw = dict(top_k=self.top_k, n_group=self.n_group, topk_group=self.topk_group,
                  norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.scale,
                  scoring_func=self.scoring_func)
        if self.fused_router is None:  # by default only where the kernel handles the shape
            fused = x.is_cuda and self._kernel_fits
        else:
            fused = self.fused_router
        from mla_spec.kernels.ops import fused_route, gate_logits, gate_logits_ref

        kernel = fused and use_triton(x) and not torch.is_grad_enabled()
        # the logits kernel on CUDA only (the interpreter would only be slow)
        logits = (gate_logits if kernel and x.is_cuda else gate_logits_ref)(x, self.weight)
        if kernel:
            return fused_route(logits, self.e_score_correction_bias, shared_id=shared_id,
                               ids_dtype=ids_dtype, **kw)
        w, ids = route_tokens(logits, self.e_score_correction_bias, **kw)
        if shared_id is not None:
            ids, w = with_shared_column(ids, w, shared_expert_column(shared_id, ids.device))
        return w, ids.to(ids_dtype)


class DeepseekV3MoE(nn.Module):
    """Router + ``n_routed_experts`` experts + shared experts; one all-reduce at the end.
    ``_fused``: stacked NVFP4 weights (None for dense); ``shared_fused``: shared expert is last."""

    def __init__(self, cfg, *, prefix: str = "", quantized=None, tp_size: int = 1,
                 dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.tp_size = tp_size
        kw = dict(quantized=quantized, tp_size=tp_size, reduce_results=False, dtype=dtype,
                  device=device)
        self.gate = MoEGate(cfg, device=device)
        self.experts = nn.ModuleList(DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size,
                                              prefix=f"{prefix}.experts.{e}", **kw)
                                     for e in range(cfg.n_routed_experts))
        self.shared_experts = (DenseMLP(cfg.hidden_size,
                                        cfg.moe_intermediate_size * cfg.n_shared_experts,
                                        prefix=f"{prefix}.shared_experts", **kw)
                               if cfg.n_shared_experts else None)
        # "auto": on CUDA at inference the fused NVFP4 kernel (BF16 experts: when stacked the
        # by-id GEMV up to MOE_GEMV_BF16_MAX_PAIRS pairs, else the grouped GEMMs; unstacked, the
        # masked loop), elsewhere the loop over active experts.
        # "never" / "always" / "masked" / "grouped" force a path (tests, graph capture).
        self.fused_mode = "auto"
        self.fuse_shared_experts = True  # where stacked (shared_fused) and on the fused path
        self.shared_fused = False  # set by _stack_nvfp4_experts
        self._fused = self._stack_nvfp4_experts()
        self._dense = stack_dense_experts(self.experts) if self._fused is None else None

    def _shared_stackable(self, g0, d0) -> bool:
        """The shared expert is NVFP4 with the routed experts' per-rank shapes (one of them)."""
        se = self.shared_experts
        if se is None:
            return False
        trio = (se.gate_proj, se.up_proj, se.down_proj)
        return all(lin.quantized for lin in trio) and all(
            getattr(lin, n).shape == getattr(ref, n).shape
            and getattr(lin, n).dtype == getattr(ref, n).dtype
            and getattr(lin, n).device == getattr(ref, n).device
            for lin, ref in zip(trio, (g0, g0, d0)) for n in ("weight", "weight_scale"))

    def _stack_nvfp4_experts(self):
        """Stack the NVFP4 experts (and a stackable shared expert) into ``w13`` / ``w2``; the
        per-expert buffers become views, so the loader fills both. None for dense experts."""
        lins = [(e.gate_proj, e.up_proj, e.down_proj) for e in self.experts]
        if not lins or not all(lin.quantized for trio in lins for lin in trio):
            return None
        g0, _, d0 = lins[0]
        dev = g0.weight.device
        if self._shared_stackable(g0, d0):
            se = self.shared_experts
            lins.append((se.gate_proj, se.up_proj, se.down_proj))
            self.shared_fused = True
            self._shared_column = shared_expert_column(len(self.experts), dev)
        E, inter = len(lins), g0.out_features

        def stacked(ref, rows):
            return torch.zeros((E, rows, *ref.shape[1:]), dtype=ref.dtype, device=dev)

        w13 = {n: stacked(getattr(g0, n), 2 * inter) for n in ("weight", "weight_scale")}
        w2 = {n: stacked(getattr(d0, n), d0.out_features) for n in ("weight", "weight_scale")}
        s13 = torch.ones((E, 2), device=dev)
        s2 = torch.ones((E,), device=dev)
        for e, (g, u, d) in enumerate(lins):
            for n in ("weight", "weight_scale"):
                g._buffers[n] = w13[n][e, :inter]
                u._buffers[n] = w13[n][e, inter:]
                d._buffers[n] = w2[n][e]
            g._buffers["weight_scale_2"] = s13[e, 0]
            u._buffers["weight_scale_2"] = s13[e, 1]
            d._buffers["weight_scale_2"] = s2[e]
        return w13, s13, w2, s2

    def _fuse_shared(self) -> bool:
        """Run the shared expert as fused row ``E`` (only meaningful on the fused path)."""
        return self.shared_fused and bool(self.fuse_shared_experts)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        """The grouped BF16 path: dense experts still stacked, inference, CUDA under "auto" (any
        device under "grouped"), shapes and dtypes ``torch._grouped_mm`` takes."""
        if self._dense is None or torch.is_grad_enabled() or self.fused_mode not in (
                "auto", "grouped") or (self.fused_mode == "auto" and not x.is_cuda):
            return False
        return (still_stacked(self.experts, *self._dense)
                and grouped_supported(x, self._dense[0]) is None)

    def _use_fused(self, x: torch.Tensor) -> bool:
        if self._fused is None or self.fused_mode == "never":
            return False
        return self.fused_mode == "always" or (x.is_cuda and not torch.is_grad_enabled())

    def fused_experts_forward(self, x, topk_weights, topk_ids, kernel=None, *,
                              with_shared: bool = False) -> torch.Tensor:
        """Routed experts through ``fused_moe_nvfp4`` (or ``kernel``, e.g. ``fused_moe_ref``);
        ``with_shared`` adds the shared expert as one more top-k column (``shared_fused``)."""
        from mla_spec.kernels.nvfp4 import fused_moe_nvfp4
        from mla_spec.quant.nvfp4 import NVFP4Tensor

        w13, s13, w2, s2 = self._fused
        if with_shared:
            if not self.shared_fused:
                raise ValueError("with_shared needs the shared expert stacked (shared_fused)")
            topk_ids, topk_weights = with_shared_column(topk_ids, topk_weights,
                                                        self._shared_column)
        fn = kernel or fused_moe_nvfp4
        return fn(x, topk_ids, topk_weights, NVFP4Tensor(w13["weight"], w13["weight_scale"], s13),
                  NVFP4Tensor(w2["weight"], w2["weight_scale"], s2))

    def experts_forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
        """``sum_k w[n,k] * expert_{ids[n,k]}(x[n])`` over the rank's intermediate slice."""
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        for e in torch.unique(topk_ids).tolist():
            rows, slot = torch.where(topk_ids == e)
            y = self.experts[e](x[rows]) * topk_weights[rows, slot, None]
            out = out.index_add(0, rows, y.to(x.dtype))
        return out

    def masked_experts_forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                               topk_ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every row, weighted by its (mostly zero) routing weight: no host sync,
        fixed shapes, so CUDA graphs can capture it (BF16 experts on CUDA)."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (topk_weights * (topk_ids == e)).sum(-1, keepdim=True)  # [N, 1] fp32
            out = out + (expert(x) * w).to(x.dtype)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., hidden]`` (all-reduced)."""
        shape = x.shape
        return per_row(self._forward_rows, x.reshape(-1, shape[-1])).view(shape)

    def _forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, hidden]`` -> ``[N, hidden]`` (all-reduced)."""
        if self._use_fused(x):
            # the router writes the shared column and int32 ids itself (no cat / cast kernels)
            shared_done = self._fuse_shared() and shared_fusion_pays(x.shape[0])
            topk_weights, topk_ids = self.gate(
                x, shared_id=len(self.experts) if shared_done else None, ids_dtype=torch.int32)
            return self._finish(x, self.fused_experts_forward(x, topk_weights, topk_ids),
                                shared_done)
        topk_weights, topk_ids = self.gate(x)
        if self._use_grouped(x):
            few = x.is_cuda and self.fused_mode == "auto" and \
                topk_ids.numel() <= MOE_GEMV_BF16_MAX_PAIRS  # read by id: no sort (1-4 rows)
            out = (moe_gemv_bf16 if few else grouped_experts_forward)(x, topk_weights, topk_ids,
                                                                      *self._dense)
        elif self.fused_mode == "masked" or (self.fused_mode == "auto" and x.is_cuda
                                             and not torch.is_grad_enabled()):
            out = self.masked_experts_forward(x, topk_weights, topk_ids)
        else:
            out = self.experts_forward(x, topk_weights, topk_ids)
        return self._finish(x, out, False)

    def _finish(self, x: torch.Tensor, out: torch.Tensor, shared_done: bool) -> torch.Tensor:
        """Add the (unfused) shared expert, all-reduce (``forward`` restores the leading dims)."""
        if self.shared_experts is not None and not shared_done:
            out = out + self.shared_experts(x)
        return tp_all_reduce(out, self.tp_size)
