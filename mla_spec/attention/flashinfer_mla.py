"""FlashInfer's ``BatchMLAPagedAttentionWrapper`` (SM80 / SM90), the peer we measure against.

``plan`` builds FlashInfer's page form (``kv_indptr`` / ``kv_indices`` / ``kv_len_arr``) and calls
``wrapper.plan(qo_indptr, ..., causal=True)``; its causal mask is end-aligned like ours, so every
mode is one ragged call over two strided views of the pages (``ckv [pages, page, 512]``, ``kpe
[pages, page, 64]``). FP8 KV goes in with unit scales and ours are applied around the call
(queries times ``k_scale``, output times ``v_scale``): one bf16 rounding of the scaled queries
(none for a power-of-two ``k_scale``), independent of FlashInfer's scale conventions.
"""

import torch

from mla_spec.attention.base import AttnPlan, MLABackend, UnsupportedError, write_output
from mla_spec.forward_batch import ForwardBatch
from mla_spec.kv_cache import build_kv_indices

__all__ = ["FlashInferMLABackend"]

_WORKSPACE_BYTES = 128 * 1024 * 1024


def _flashinfer_missing() -> str | None:
    try:
        import flashinfer.mla  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA toolchain
        return f"flashinfer is not importable ({type(e).__name__}: {e})"
    return None


class FlashInferMLABackend(MLABackend):
    name = "flashinfer"
    kv_dtypes = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)

    def __init__(self, num_heads, softmax_scale, kv_pool, req_to_token, device=None, *,
                 fi_backend: str = "auto"):
        super().__init__(num_heads, softmax_scale, kv_pool, req_to_token, device)
        reason = self.dims_reason(kv_pool.kv_lora_rank, kv_pool.qk_rope_head_dim, kv_pool.dtype)
        if reason is not None:
            raise UnsupportedError(f"backend 'flashinfer': {reason}")
        import flashinfer.mla
        self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self._workspace, backend=fi_backend)

    @staticmethod
    def dims_reason(kv_lora_rank: int, qk_rope_head_dim: int, kv_dtype: torch.dtype) -> str | None:
        """FlashInfer's fa2/fa3 MLA kernels: ckv a multiple of 128 and kpe of 64; FP8 KV only at
        DeepSeek's 512 / 64 (the torch and triton backends take any dims)."""
        if kv_dtype == torch.float8_e4m3fn and (kv_lora_rank, qk_rope_head_dim) != (512, 64):
            return (f"FP8 KV needs kv_lora_rank 512 and qk_rope_head_dim 64, got "
                    f"{kv_lora_rank} / {qk_rope_head_dim}")
        if kv_lora_rank % 128 or qk_rope_head_dim % 64:
            return (f"needs kv_lora_rank a multiple of 128 and qk_rope_head_dim a multiple of 64, "
                    f"got {kv_lora_rank} / {qk_rope_head_dim}")
        return None

    @classmethod
    def device_reason(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs a CUDA GPU (SM80 / SM90)"
        cap = torch.cuda.get_device_capability(device)
        if cap[0] not in (8, 9):
            return f"the MLA wrapper here targets SM80/SM90, device is SM{cap[0]}{cap[1]}"
        return _flashinfer_missing()

    def plan(self, batch: ForwardBatch) -> AttnPlan:
        plan = self.common_plan(batch)
        if not plan.mode.is_idle():
            self._plan_wrapper(plan)
        batch.extra[self.name] = plan
        return plan

    def _plan_wrapper(self, plan: AttnPlan) -> None:
        pool = self.kv_pool
        kv_indptr, kv_indices, _ = build_kv_indices(
            self.req_to_token, plan.req_pool_indices, plan.kv_lens_cpu, pool.page_size)
        q_dtype = torch.bfloat16 if pool.dtype in (torch.float8_e4m3fn, torch.bfloat16) \
            else pool.dtype
        self.wrapper.plan(
            qo_indptr=plan.qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
            kv_len_arr=plan.kv_lens, num_heads=self.num_heads, head_dim_ckv=pool.kv_lora_rank,
            head_dim_kpe=pool.qk_rope_head_dim, page_size=pool.page_size, causal=True,
            sm_scale=self.softmax_scale, q_data_type=q_dtype, kv_data_type=pool.dtype)
        plan.extra["q_dtype"] = q_dtype

    def forward(self, q_nope, q_pe, layer_id: int, batch: ForwardBatch, *, out=None):
        plan = self.checked_plan(q_nope, q_pe, layer_id, batch)
        if plan is None:
            return self.empty_output(q_nope, out)
        pool = self.kv_pool
        k_scale, v_scale = pool.read_scales(layer_id)
        kv = pool.get_kv(layer_id)
        ckv, kpe = kv[..., : pool.kv_lora_rank], kv[..., pool.kv_lora_rank:]
        qd = plan.extra["q_dtype"]
        qn, qp = q_nope.to(qd), q_pe.to(qd)
        if k_scale != 1.0:
            qn, qp = qn * k_scale, qp * k_scale
        kw = {"ckv_scale": 1.0, "kpe_scale": 1.0} if pool.is_fp8 else {}
        res = self.wrapper.run(qn, qp, ckv, kpe, **kw)
        if v_scale != 1.0:
            res = res * v_scale
        return write_output(res.to(q_nope.dtype), out)
