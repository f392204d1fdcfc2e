"""TRT-LLM-gen MLA through ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`` (SM100).

The kernel takes a fixed-shape query ``[bs, q_len, H, 576]`` (in the KV dtype when the cache is
FP8), the cache as ``[num_pages, 1, page_size, 576]`` (page size 32 or 64), ``block_tables
[bs, max_pages]`` int32 padded to a multiple of ``128 / page_size`` with -1, ``seq_lens`` (KV
lengths), and two static scales: ``bmm1_scale = q_scale * k_scale * sm_scale`` and ``bmm2_scale =
v_scale`` (SGLang passes no bmm2_scale, so it never applies v_scale). Rows are causal, aligned to
the end of each request's KV.

Ragged v1 DRAFT_EXTEND is padded to ``max_q`` rows (``pad_draft_extend_query``, ``align="end"``:
real rows last, each sees its own causal window; ``"start"`` is SGLang's layout, kept to measure
its cost) and unpadded after. Prefill (EXTEND / MIXED) is unsupported (SGLang runs ragged MHA).

The kernel call is injectable (``kernel=``): the CPU tests pass :func:`reference_trtllm_kernel`,
an fp32 torch implementation of the same contract, so everything around the kernel (block tables,
padding, q cast, scales, unpadding) is tested without SM100.
"""

from collections.abc import Callable

import torch

from mla_spec.attention.base import AttnPlan, MLABackend, write_output
from mla_spec.forward_batch import ForwardBatch
from mla_spec.forward_mode import ForwardMode
from mla_spec.kernels.pad import pad_draft_extend_query, unpad_draft_extend_output
from mla_spec.kv_cache import build_block_tables
from mla_spec.quant.fp8 import FP8_DTYPE, quantize_fp8

__all__ = ["TRTLLMMLABackend", "reference_trtllm_kernel"]

_WORKSPACE_BYTES = 128 * 1024 * 1024
TRTLLM_BLOCK_CONSTRAINT = 128


def reference_trtllm_kernel(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank,
                            qk_rope_head_dim, block_tables, seq_lens, max_seq_len,
                            out=None, bmm1_scale=1.0, bmm2_scale=1.0, **_):
    """Torch stand-in with trtllm-gen's contract: ``query [bs, q, H, D]`` -> ``[bs, q, H, Dv]``;
    ``kv_cache [num_pages, 1, page_size, D]``; row ``i`` of request ``b`` sees KV positions
    ``< seq_lens[b] - q + i + 1``; scores ``= bmm1_scale * q.k``; output ``= bmm2_scale * P V``."""
    bs, ql, h, d = query.shape
    page = kv_cache.shape[2]
    res = torch.zeros((bs, ql, h, kv_lora_rank), dtype=torch.float32, device=query.device)
    for b in range(bs):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pages = block_tables[b, : -(-n // page)].to(torch.int64)
        kv = kv_cache[pages, 0].reshape(-1, d)[:n].float()
        s = torch.einsum("qhd,kd->qhk", query[b].float(), kv) * bmm1_scale
        vis = torch.arange(n, device=s.device)[None, :] < (
            n - ql + torch.arange(ql, device=s.device) + 1)[:, None]
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        res[b] = torch.einsum("qhk,kd->qhd", p, kv[:, :kv_lora_rank]) * bmm2_scale
    out_dtype = torch.bfloat16 if query.dtype == FP8_DTYPE else query.dtype
    if out is None:
        return res.to(out_dtype)
    out.copy_(res.view(out.shape).to(out.dtype))
    return out


def _load_trtllm_kernel() -> Callable:
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla
    return trtllm_batch_decode_with_kv_cache_mla


class TRTLLMMLABackend(MLABackend):
    """trtllm-gen MLA (SM100). ``kernel=`` injects the kernel call (tests: the torch stand-in)."""

    name = "trtllm"
    kv_dtypes = (torch.bfloat16, FP8_DTYPE)

    def __init__(self, num_heads, softmax_scale, kv_pool, req_to_token, device=None, *,
                 kernel: Callable | None = None, q_scale: float = 1.0, align: str = "end"):
        self._kernel, self.align = kernel, align  # the base's __init__ asks supports()
        self._pad_buffers: dict[tuple, torch.Tensor] = {}  # see _pad_buffer
        super().__init__(num_heads, softmax_scale, kv_pool, req_to_token, device)
        if kv_pool.page_size not in (32, 64):
            raise ValueError(f"trtllm-gen MLA supports page_size 32 or 64, not {kv_pool.page_size}")
        self.q_scale = float(q_scale)
        self._kernel = kernel or _load_trtllm_kernel()
        self._workspace = torch.zeros(
            _WORKSPACE_BYTES if kernel is None else 1, dtype=torch.uint8, device=self.device)

    @classmethod
    def device_reason(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs a Blackwell GPU (SM100); tests inject a stand-in kernel on CPU"
        cap = torch.cuda.get_device_capability(device)
        if cap[0] != 10:
            return f"trtllm-gen MLA needs SM100, device is SM{cap[0]}{cap[1]}"
        try:
            _load_trtllm_kernel()
        except Exception as e:
            return f"flashinfer trtllm MLA not importable ({type(e).__name__}: {e})"
        return None

    def _instance_device_reason(self, device: torch.device) -> str | None:
        return None if self._kernel is not None else self.device_reason(device)

    @classmethod
    def mode_reason(cls, mode: ForwardMode) -> str | None:
        if mode.is_decode() or mode.is_target_verify() or mode.is_draft_extend(include_v2=True):
            return None
        return ("trtllm-gen MLA is a decode/verify kernel; prefill (EXTEND/MIXED) runs ragged MHA "
                "over decompressed K/V in SGLang (use the triton or flashinfer backend)")

    def plan(self, batch: ForwardBatch) -> AttnPlan:
        plan = self.common_plan(batch)
        if not plan.mode.is_idle():
            ps = self.kv_pool.page_size
            plan.extra["block_tables"] = build_block_tables(
                self.req_to_token, plan.req_pool_indices, plan.kv_lens_cpu, ps,
                pad_multiple=TRTLLM_BLOCK_CONSTRAINT // ps)
        batch.extra[self.name] = plan
        return plan

    def _pad_buffer(self, plan, q: torch.Tensor) -> torch.Tensor:
        """``[bs, max_q, H, D]``: the first ``bs`` rows of a zeroed buffer kept per (max_q, dtype)
        and grown to the largest batch seen."""
        key = (plan.max_q, *q.shape[1:], q.dtype)
        buf = self._pad_buffers.get(key)
        if buf is None or buf.shape[0] < plan.bs:
            buf = torch.zeros((plan.bs, *key[:-1]), dtype=q.dtype, device=q.device)
            self._pad_buffers[key] = buf
        return buf[: plan.bs]

    def forward(self, q_nope, q_pe, layer_id: int, batch: ForwardBatch, *, out=None):
        plan = self.checked_plan(q_nope, q_pe, layer_id, batch)
        if plan is None:
            return self.empty_output(q_nope, out)
        pool = self.kv_pool
        k_scale, v_scale = pool.read_scales(layer_id)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [N, H, 576]
        # trtllm-gen takes q in the KV dtype
        if pool.is_fp8:
            q = quantize_fp8(q, self.q_scale)
        elif self.q_scale != 1.0:
            raise ValueError("q_scale applies to FP8 queries only")
        else:
            q = q.to(pool.dtype)
        ragged = plan.fixed_q is None
        if ragged:
            # Padded rows stay stale (fill_padding=False): an output row depends only on its own
            # query row and the unpad drops padded ones. The buffer, zeroed once per shape (no NaN
            # bits), is reused: no allocation, no host sync (validate=False: the plan checked).
            query = pad_draft_extend_query(q, plan.seq_lens_q, plan.qo_indptr, plan.max_q,
                                           align=self.align, out=self._pad_buffer(plan, q),
                                           fill_padding=False, validate=False)
        else:
            query = q.view(plan.bs, plan.fixed_q, self.num_heads, -1)
        kv_cache = pool.get_kv(layer_id).unsqueeze(1)  # [pages, 1, page, 576]
        bmm1 = (self.q_scale if pool.is_fp8 else 1.0) * k_scale * self.softmax_scale
        raw = self._kernel(
            query=query, kv_cache=kv_cache, workspace_buffer=self._workspace,
            qk_nope_head_dim=128, kv_lora_rank=pool.kv_lora_rank,
            qk_rope_head_dim=pool.qk_rope_head_dim, block_tables=plan.extra["block_tables"],
            seq_lens=plan.kv_lens, max_seq_len=plan.max_kv, bmm1_scale=bmm1, bmm2_scale=v_scale,
        )
        if ragged:
            res = unpad_draft_extend_output(raw, plan.seq_lens_q, plan.qo_indptr, plan.total_q,
                                            align=self.align)
        else:
            res = raw.reshape(plan.total_q, self.num_heads, -1)
        return write_output(res.to(q_nope.dtype), out)
