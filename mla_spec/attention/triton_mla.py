"""Our backend: the split-KV Triton kernels of ``mla_spec/kernels/mla_decode.py``.

One kernel serves every mode: fixed rows per request (DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2)
go through the ``q_len`` path, ragged ones (v1 DRAFT_EXTEND, EXTEND, MIXED) through
``qo_indptr`` with no padding at all. ``plan`` picks the number of KV splits on the host (two
waves of programs over the SMs). KV slots are read straight from ``req_to_token``, so any page
size and any page order work. Runs on CUDA (SM80+) and, for tests, on the CPU interpreter.
"""

from __future__ import annotations

import torch

from mla_spec.attention.base import AttnPlan, MLABackend
from mla_spec.device import triton_interpreting
from mla_spec.forward_batch import ForwardBatch
from mla_spec.kernels.mla_decode import MLAKernelConfig, default_config, mla_decode, pick_num_splits

__all__ = ["TritonMLABackend"]


class TritonMLABackend(MLABackend):
    """Triton split-KV MLA. Options: ``num_splits`` (None = heuristic), ``fp8_dot`` (0 / 1),
    ``config`` (an ``MLAKernelConfig``)."""

    name = "triton"

    def __init__(self, num_heads, softmax_scale, kv_pool, req_to_token, device=None, *,
                 num_splits: int | None = None, fp8_dot: int = 0,
                 config: MLAKernelConfig | None = None):
        super().__init__(num_heads, softmax_scale, kv_pool, req_to_token, device)
        self.num_splits, self.fp8_dot, self.config = num_splits, fp8_dot, config
        self._sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                     if self.device.type == "cuda" else 4)

    @classmethod
    def device_reason(cls, device: torch.device) -> str | None:
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            return None if cap[0] >= 8 else f"needs SM80 or newer, device is SM{cap[0]}{cap[1]}"
        if device.type == "cpu" and triton_interpreting():
            return None
        return "needs a CUDA GPU (or TRITON_INTERPRET=1 on CPU)"

    def _plan_extra(self, plan: AttnPlan, batch: ForwardBatch) -> None:
        rows = (plan.fixed_q or plan.max_q) * self.num_heads
        cfg = self.config or default_config(rows, torch.bfloat16, self.kv_pool.dtype, self.device)
        m_blocks = -(-rows // cfg.block_m)
        plan.extra["config"] = cfg
        plan.extra["num_splits"] = self.num_splits or pick_num_splits(
            plan.bs, m_blocks, plan.max_kv, cfg.block_n, self._sms)

    def _forward(self, q_nope, q_pe, layer_id: int, batch: ForwardBatch, plan: AttnPlan):
        pool = self.kv_pool
        k_scale, v_scale = pool.read_scales(layer_id)
        kv_flat = pool.get_kv(layer_id).view(pool.num_slots, pool.kv_cache_dim)
        shape = (dict(q_len=plan.fixed_q) if plan.fixed_q is not None
                 else dict(qo_indptr=plan.qo_indptr, max_q=plan.max_q))
        cfg = self.config or default_config((plan.fixed_q or plan.max_q) * self.num_heads,
                                            q_nope.dtype, pool.dtype, self.device)
        return mla_decode(
            q_nope, q_pe, kv_flat, self.req_to_token, plan.req_pool_indices, plan.kv_lens,
            self.softmax_scale, k_scale=k_scale, v_scale=v_scale,
            num_splits=plan.extra["num_splits"], fp8_dot=self.fp8_dot, config=cfg, **shape,
        )
