"""Our backend: the split-KV MLA kernels of ``mla_spec/kernels/mla/``.

Two kernels compute the same function. The *paged* fast path (``mla_decode_paged``: one
contiguous page tile per iteration, two half-width accumulators, fp16 MMA for FP8 KV) runs when
the device is Hopper (or the CPU interpreter), the cache is bf16 / fp16 / fp8, and the pool's
page size is a multiple of its KV tile (64 / 32 on the H200). Otherwise (fp32 caches or queries,
other GPUs, odd page sizes) the *generic* kernel (``mla_decode``: per-token gather through
``req_to_token``, any page size and order) runs. ``kernel="generic"`` / ``"paged"`` forces one.

One kernel call serves every mode: fixed rows per request (DECODE, TARGET_VERIFY,
DRAFT_EXTEND_V2) go through ``q_len``, ragged ones (v1 DRAFT_EXTEND, EXTEND, MIXED) through
``qo_indptr`` with no padding at all. ``plan`` picks the tile config and the number of KV splits
on the host once per step (no device sync in ``forward``, so it is CUDA-graph safe). The paged
tile config comes from ``PAGED_DEFAULTS`` (``mla_spec/kernels/mla/choice.py``: per (KV dtype,
rows per request, batch) class, the H200 sweep winners; edit it after a sweep) and, where the
winner changes with the context, ``PAGED_CONTEXT_DEFAULTS`` (read with the plan's longest KV),
which can select the V-split / fused-combine variants (``kernels/mla/triton_vsplit.py``) or the
CUDA kernels on Hopper (``kernels/mla/sm90_*.py``).
"""

import torch

from mla_spec.attention.base import AttnPlan, MLABackend, write_output
from mla_spec.device import triton_interpreting
from mla_spec.forward_batch import ForwardBatch
from mla_spec.forward_mode import ForwardMode
from mla_spec.kernels.mla import (
    MLAKernelConfig,
    PagedConfig,
    default_config,
    mla_decode,
    mla_decode_paged,
    paged_choice,
    paged_supported,
    pick_num_splits,
    splits_for,
)

__all__ = ["TritonMLABackend"]

_KERNELS = ("auto", "paged", "generic")
_ANY_ROWS = 1 << 20  # deterministic: every shape takes the kernel of the largest class


class TritonMLABackend(MLABackend):
    """Triton split-KV MLA. Options: ``kernel`` ("auto" | "paged" | "generic"), ``num_splits``
    (None = heuristic), ``fp8_dot`` (generic kernel: 0 / 1), ``config`` (``MLAKernelConfig`` /
    ``PagedConfig``); on an FP8 cache ``e4m3_queries`` / ``e4m3_probs`` (default True) let the
    defaults round queries / softmax weights to e4m3 for e4m3 MMAs, as TRT-LLM-gen does (errors:
    ``quant.fp8.fp8_query_attention_error_bound``, ``fp8_probability_attention_error_bound``);
    ``early_kv`` (default False): the wgmma kernels load their first KV tile before their PDL
    wait (docs/bench_mla.md), sound only where the step's KV store writes just the step's rows
    and the page table and lengths were written at the step's start (a decode loop);
    ``deterministic`` (default False): one kernel and one KV split for every mode, batch and
    context, so a query row's result does not depend on the batch or mode it runs in
    (``Engine(deterministic=True)``)."""

    name = "triton"
    graph_safe = True

    def __init__(self, num_heads, softmax_scale, kv_pool, req_to_token, device=None, *,
                 num_splits: int | None = None, fp8_dot: int = 0,
                 config: MLAKernelConfig | PagedConfig | None = None, kernel: str = "auto",
                 e4m3_queries: bool = True, e4m3_probs: bool = True, early_kv: bool = False,
                 deterministic: bool = False):
        super().__init__(num_heads, softmax_scale, kv_pool, req_to_token, device)
        if kernel not in _KERNELS:
            raise ValueError(f"kernel {kernel!r}: choose one of {', '.join(_KERNELS)}")
        if isinstance(config, PagedConfig) and kernel == "generic":
            raise ValueError("a PagedConfig needs kernel='paged' or 'auto'")
        self.num_splits, self.fp8_dot, self.config = num_splits, fp8_dot, config
        self.e4m3_queries, self.e4m3_probs = e4m3_queries, e4m3_probs
        self.early_kv = bool(early_kv)
        self.deterministic = bool(deterministic)
        self._sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                     if self.device.type == "cuda" else 4)
        pool = kv_pool
        pcfg = config if isinstance(config, PagedConfig) else None
        why = paged_supported(self.device, pool.kv_lora_rank, pool.qk_rope_head_dim,
                              pool.page_size, pool.dtype, pcfg)
        if kernel == "paged" and why:
            raise ValueError(f"kernel='paged' cannot run here: {why}")
        self.paged = kernel != "generic" and why is None and not fp8_dot \
            and not isinstance(config, MLAKernelConfig)
        self._flat: dict[int, torch.Tensor] = {}  # layer -> its cache as [slots, 576]

    @classmethod
    def device_reason(cls, device: torch.device) -> str | None:
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            return None if cap[0] >= 8 else f"needs SM80 or newer, device is SM{cap[0]}{cap[1]}"
        if device.type == "cpu" and triton_interpreting():
            return None
        return "needs a CUDA GPU (or TRITON_INTERPRET=1 on CPU)"

    def plan(self, batch: ForwardBatch) -> AttnPlan:
        plan = self.common_plan(batch)
        if not plan.mode.is_idle():
            self._pick_kernel_config(plan, batch)
        batch.extra[self.name] = plan
        return plan

    def _pick_kernel_config(self, plan: AttnPlan, batch: ForwardBatch) -> None:
        """Tile config and KV splits of this step, for the paged and the generic kernel."""
        pool = self.kv_pool
        rows = (plan.fixed_q or plan.max_q) * self.num_heads
        # ragged draft extend (v1): pick the tile by the most rows a request can have, not by
        # this step's longest accept, so that the variant (a compiled binary) stays the same
        # from step to step (eager steps would otherwise compile mid-run)
        ndt = batch.num_draft_tokens if batch.forward_mode == ForwardMode.DRAFT_EXTEND else None
        rows_cfg = max(rows, (ndt or 0) * self.num_heads)
        if self.deterministic:  # the same kernel whatever the shape: the largest class's
            rows_cfg = _ANY_ROWS
        # v1 draft extend stays ragged even when every request accepted as many tokens: the
        # fixed-q_len binary (RAGGED is a constexpr) would otherwise be compiled mid-run the
        # first time the accept lengths differ (bench_e2e's "compiles" column, bs 32)
        plan.extra["ragged"] = plan.fixed_q is None or plan.mode == ForwardMode.DRAFT_EXTEND
        shape = (dict(qo_indptr=plan.qo_indptr, max_q=plan.max_q) if plan.extra["ragged"]
                 else dict(q_len=plan.fixed_q))  # both kernels' row keywords, built once
        plan.extra["shape_kw"] = shape
        if self.paged:
            det = self.deterministic
            # v1 draft extend: variant and splits by the most rows and the longest context a
            # request can have, so its binaries (the combine's too) stay the same as contexts grow
            stable = ndt is not None
            kv = self.req_to_token.shape[1] if stable else plan.max_kv
            cfg, pinned = ((self.config, None) if self.config is not None else
                           paged_choice(rows_cfg, pool.dtype, self.device, pool.page_size,
                                        _ANY_ROWS if det else plan.bs,
                                        None if det or stable else plan.max_kv,
                                        fixed=not (det or plan.extra["ragged"]),
                                        e4m3_queries=self.e4m3_queries,
                                        e4m3_probs=self.e4m3_probs))
            r = rows_cfg if stable else rows
            splits = self.num_splits or pinned or splits_for(
                cfg, plan.bs, -(-r // cfg.block_m), kv, r,
                pool.kv_cache_dim * pool.kv_buffer[0].element_size(), self._sms,
                pool.kv_lora_rank)
            if ndt:  # ragged draft extend: always the split binary (SPLIT is a constexpr), so
                splits = max(splits, 2)  # growing contexts never switch binaries mid-run
            if det:  # one split: a row's KV is reduced in one order, whatever the batch
                splits = 1
            plan.extra["paged_config"] = cfg
            plan.extra["paged_splits"] = splits
            plan.extra["paged_kw"] = dict(
                page_size=pool.page_size, max_kv=plan.max_kv, num_splits=splits, config=cfg,
                early_kv=self.early_kv and not plan.extra["ragged"], **shape)
        cfg = (self.config if isinstance(self.config, MLAKernelConfig)
               else default_config(rows_cfg, torch.bfloat16, pool.dtype, self.device))
        plan.extra["config"] = cfg
        plan.extra["num_splits"] = 1 if self.deterministic else self.num_splits or \
            pick_num_splits(plan.bs, -(-rows // cfg.block_m), plan.max_kv, cfg.block_n, self._sms)

    def forward(self, q_nope, q_pe, layer_id: int, batch: ForwardBatch, *, out=None):
        plan = self.checked_plan(q_nope, q_pe, layer_id, batch)
        if plan is None:
            return self.empty_output(q_nope, out)
        pool = self.kv_pool
        k_scale, v_scale = pool.read_scales(layer_id)
        kv_flat = self._flat.get(layer_id)
        if kv_flat is None:
            kv_flat = self._flat[layer_id] = pool.get_kv(layer_id).view(pool.num_slots,
                                                                        pool.kv_cache_dim)
        if self.paged and (q_nope.dtype == pool.dtype or q_nope.device.type == "cpu"
                           or pool.is_fp8):
            res = mla_decode_paged(
                q_nope, q_pe, kv_flat, self.req_to_token, plan.req_pool_indices, plan.kv_lens,
                self.softmax_scale, k_scale=k_scale, v_scale=v_scale, **plan.extra["paged_kw"])
            return write_output(res, out)
        common = dict(k_scale=k_scale, v_scale=v_scale, **plan.extra["shape_kw"])
        rows = _ANY_ROWS if self.deterministic else (plan.fixed_q or plan.max_q) * self.num_heads
        cfg = (self.config if isinstance(self.config, MLAKernelConfig)
               else default_config(rows, q_nope.dtype, pool.dtype, self.device))
        res = mla_decode(
            q_nope, q_pe, kv_flat, self.req_to_token, plan.req_pool_indices, plan.kv_lens,
            self.softmax_scale, num_splits=plan.extra["num_splits"], fp8_dot=self.fp8_dot,
            config=cfg, **common)
        return write_output(res, out)
