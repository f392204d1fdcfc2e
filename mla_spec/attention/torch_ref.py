"""The oracle: absorbed MLA over the paged cache with einsum and fp32 (or fp64) accumulation.

Every other backend is tested against this one. It is deliberately plain: per request, gather
the KV rows through ``req_to_token``, dequantize them (``s * k_scale`` for keys, ``s[:512] *
v_scale`` for values), score all heads with one einsum, apply the end-aligned causal mask, softmax
in fp32, and multiply by the values. A row whose causal window is empty gets zeros. It runs on any
device, in every forward mode (the mode only decides the rows per request, which the batch
already carries).
"""

from collections.abc import Sequence

import torch

from mla_spec.attention.base import MLABackend, write_output
from mla_spec.forward_batch import ForwardBatch

__all__ = ["TorchMLABackend", "mla_attention_ref"]


def mla_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_flat: torch.Tensor,
                      req_to_token: torch.Tensor, req_pool_indices: Sequence[int],
                      seq_lens_q: Sequence[int], kv_lens: Sequence[int], sm_scale: float,
                      k_scale: float = 1.0, v_scale: float = 1.0, *,
                      compute_dtype: torch.dtype = torch.float32, return_lse: bool = False):
    """Reference absorbed-MLA attention over a paged cache: ``q_nope [N, H, Dv]`` / ``q_pe [N, H,
    Dpe]`` rows packed request after request, ``kv_flat [num_slots, Dv + Dpe]`` stored rows (any
    dtype, fp8 included), ``req_to_token [max_reqs, max_ctx]``; per request (host sequences)
    ``req_pool_indices``, ``seq_lens_q``, ``kv_lens``; the softmax and dequant scales;
    ``compute_dtype`` fp32 (the oracle) or fp64 (its own reference). Returns ``[N, H, Dv]`` in
    ``q_nope.dtype`` (and with ``return_lse`` the natural-log ``lse [N, H]`` fp32, -inf for an
    empty window)."""
    n, h, dv = q_nope.shape
    out = torch.zeros((n, h, dv), dtype=compute_dtype, device=q_nope.device)
    lse = torch.full((n, h), float("-inf"), dtype=torch.float32, device=q_nope.device)
    start = 0
    for b, (ql, kl) in enumerate(zip(seq_lens_q, kv_lens)):
        ql, kl = int(ql), int(kl)
        rows = slice(start, start + ql)
        start += ql
        if ql == 0 or kl == 0:
            continue
        slots = req_to_token[int(req_pool_indices[b]), :kl].to(torch.int64)
        kv = kv_flat.index_select(0, slots.to(kv_flat.device)).to(compute_dtype)  # [kl, D]
        q = torch.cat([q_nope[rows], q_pe[rows]], dim=-1).to(compute_dtype)  # [ql, H, D]
        s = torch.einsum("qhd,kd->qhk", q, kv) * (sm_scale * k_scale)
        i = torch.arange(ql, device=q.device)[:, None]
        j = torch.arange(kl, device=q.device)[None, :]
        visible = j < (kl - ql + i + 1)  # [ql, kl]: end-aligned causal window
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.einsum("qhk,kd->qhd", p, kv[:, :dv]) * v_scale
        out[rows] = torch.where(denom > 0, o / denom.clamp_min(1e-300), torch.zeros_like(o))
        lse[rows] = (torch.log(denom) + m).squeeze(-1).to(torch.float32)
    res = out.to(q_nope.dtype)
    return (res, lse) if return_lse else res


class TorchMLABackend(MLABackend):
    """The oracle as a backend: any device, every mode, every KV dtype. ``deterministic``: each
    query row alone (a one-row request over its visible KV), so a row's result does not depend
    on the rows beside it (``Engine(deterministic=True)``)."""

    name = "torch"

    def __init__(self, num_heads, softmax_scale, kv_pool, req_to_token, device=None, *,
                 deterministic: bool = False):
        super().__init__(num_heads, softmax_scale, kv_pool, req_to_token, device)
        self.deterministic = bool(deterministic)

    def forward(self, q_nope, q_pe, layer_id: int, batch: ForwardBatch, *, out=None):
        plan = self.checked_plan(q_nope, q_pe, layer_id, batch)
        if plan is None:
            return self.empty_output(q_nope, out)
        pool = self.kv_pool
        k_scale, v_scale = pool.read_scales(layer_id)
        kv_flat = pool.get_kv(layer_id).view(pool.num_slots, pool.kv_cache_dim)
        rpi, q_lens, kv_lens = plan.req_pool_indices.tolist(), plan.seq_lens_q_cpu, \
            plan.kv_lens_cpu
        if self.deterministic:  # row i of a request sees kv_len - q_len + i + 1 positions
            rpi, kv_lens = ([x for x, q in zip(rpi, q_lens) for _ in range(q)],
                            [k - q + i + 1 for q, k in zip(q_lens, kv_lens) for i in range(q)])
            q_lens = [1] * len(rpi)
        res = mla_attention_ref(q_nope, q_pe, kv_flat, self.req_to_token, rpi, q_lens, kv_lens,
                                self.softmax_scale, k_scale, v_scale)
        return write_output(res, out)
