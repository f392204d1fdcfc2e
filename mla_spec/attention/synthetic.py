"""Random paged-KV scenes for tests, notebooks and benchmarks (every forward mode).

:func:`make_scene` builds what the engine has at one attention call: a pool whose pages go to
requests in *random order*, ``req_to_token``, a ``ForwardBatch`` of the mode (with
``req_pool_indices``, ``out_cache_loc``), prefix and new rows stored (as the model does before
``backend.forward``), random absorbed queries ``q_nope [N, H, Dv]``, ``q_pe [N, H, Dpe]``. Rows per
request (``q_lens``) follow ``ForwardBatch``'s table of modes.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mla_spec.forward_batch import ForwardBatch
from mla_spec.forward_mode import ForwardMode
from mla_spec.kv_cache import MLATokenToKVPool, ReqToTokenPool, assign_request_slots

__all__ = ["Scene", "make_scene", "make_batch", "ALL_MODES"]

ALL_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
             ForwardMode.DRAFT_EXTEND_V2, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.IDLE)


@dataclass
class Scene:
    pool: MLATokenToKVPool
    req_pool: ReqToTokenPool
    batch: ForwardBatch
    q_nope: torch.Tensor  # [N, H, Dv]
    q_pe: torch.Tensor  # [N, H, Dpe]
    layer_id: int = 0


def make_batch(mode: ForwardMode, prefix_lens: Sequence[int], q_lens: Sequence[int],
               num_draft_tokens: int | None = None, **kw) -> ForwardBatch:
    """A ``ForwardBatch`` of ``mode`` whose request ``b`` has ``q_lens[b]`` rows after
    ``prefix_lens[b]`` cached positions (so ``kv_len = prefix + q``)."""
    prefix, q = list(prefix_lens), list(q_lens)
    ndt = num_draft_tokens or max(q, default=1)
    if mode.is_idle():
        return ForwardBatch.idle(device=kw.get("device"))
    if mode.is_decode():
        return ForwardBatch.decode([p + 1 for p in prefix], **kw)
    if mode.is_target_verify():
        return ForwardBatch.target_verify(prefix, ndt, **kw)
    if mode.is_draft_extend_v2():
        return ForwardBatch.draft_extend_v2(prefix, ndt, [max(1, min(a, ndt)) for a in q], **kw)
    if mode.is_draft_extend():
        return ForwardBatch.draft_extend([p + a for p, a in zip(prefix, q)], q, ndt, **kw)
    if mode.is_extend_or_draft_extend_or_mixed():
        return ForwardBatch.extend(prefix, q, mixed=mode.is_mixed(), **kw)
    raise ValueError(f"make_batch: mode {mode.name} not supported")


def make_scene(mode: ForwardMode, prefix_lens: Sequence[int], q_lens: Sequence[int], *,
               num_heads: int = 2, num_draft_tokens: int | None = None,
               kv_dtype: torch.dtype = torch.float32, q_dtype: torch.dtype = torch.float32,
               page_size: int = 4, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
               k_scale: float = 1.0, v_scale: float = 1.0, device=None, seed: int = 0,
               shuffle_pages: bool = True, spare_pages: int = 3,
               kv_amplitude: float = 1.0) -> Scene:
    """Build a random scene (see the module docstring). ``kv_amplitude`` scales the KV values."""
    device = torch.device(device or "cpu")
    g = torch.Generator().manual_seed(seed)
    probe = make_batch(mode, prefix_lens, q_lens, num_draft_tokens)
    kv_lens, prefix, bs = probe.kv_lens_cpu, probe.extend_prefix_lens_cpu, probe.batch_size
    pages_per = [-(-k // page_size) for k in kv_lens]
    num_pages = sum(pages_per) + spare_pages
    order = (torch.randperm(num_pages, generator=g).tolist() if shuffle_pages
             else list(range(num_pages)))
    max_ctx = max([*kv_lens, 1]) + page_size
    req_pool = ReqToTokenPool(2 * max(bs, 1), max_ctx, device)
    pool = MLATokenToKVPool(1, num_pages, page_size, kv_dtype, device, k_scale, v_scale,
                            kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
    req_idx, used = [], 0
    for b in range(bs):
        req_pool.alloc()  # skip a row so indices are not trivially 0..bs-1
        r = req_pool.alloc()
        req_idx.append(r)
        assign_request_slots(req_pool.req_to_token, r, order[used: used + pages_per[b]],
                             page_size, 0, kv_lens[b])
        used += pages_per[b]
    r2t = req_pool.req_to_token
    # prefix rows (already cached) and the new rows' slots
    old, new = [], []
    for b in range(bs):
        slots = r2t[req_idx[b], : kv_lens[b]].to(torch.int64)
        old.append(slots[: prefix[b]])
        new.append(slots[prefix[b]:])
    dv, dpe = kv_lora_rank, qk_rope_head_dim
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    loc_old = torch.cat(old) if old else empty
    loc_new = torch.cat(new) if new else empty
    rnd = lambda *s: (torch.randn(*s, generator=g) * kv_amplitude).to(device)
    pool.store(0, loc_old, rnd(loc_old.numel(), dv), rnd(loc_old.numel(), dpe))
    batch = make_batch(mode, prefix_lens, q_lens, num_draft_tokens, device=device,
                       req_pool_indices=req_idx, out_cache_loc=loc_new.cpu())
    n = batch.total_q
    if n:
        pool.store(0, batch.out_cache_loc, rnd(n, dv), rnd(n, dpe))
    qn = torch.randn(n, num_heads, dv, generator=g).to(device, q_dtype)
    qp = torch.randn(n, num_heads, dpe, generator=g).to(device, q_dtype)
    return Scene(pool, req_pool, batch, qn, qp)
