"""ModelRunner: one tensor-parallel rank's models, KV pools, request table and attention backends.

Target and draft (MTP) each own a paged latent KV pool and a backend; both are indexed by the
same slots, so one page allocation serves both. ``prepare`` builds the batch's
``out_cache_loc`` and plans (host work); ``run`` calls the model or replays a CUDA graph. They
are separate so a speculative step can plan all its batches before its no-sync region.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import torch

from mla_spec.config import CacheConfig, ModelConfig
from mla_spec.forward_batch import ForwardBatch
from mla_spec.kv_cache import MLATokenToKVPool, ReqToTokenPool
from mla_spec.metrics import ModeTimer
from mla_spec.models.batch_invariant import batch_invariant

__all__ = ["ModelRunner"]

logger = logging.getLogger(__name__)


class ModelRunner:
    """Models + pools + backends of one rank. ``target`` has ``compute_logits``; ``draft`` may
    be None; both share ``req_to_token_pool``."""

    def __init__(self, target, draft, *, target_pool, draft_pool, req_to_token_pool,
                 backend, draft_backend, page_size: int, device=None,
                 tp_rank: int = 0, tp_size: int = 1, deterministic: bool = False) -> None:
        self.target, self.draft = target, draft
        self.pools = {"target": target_pool, "draft": draft_pool}
        self.backends = {"target": backend, "draft": draft_backend}
        self.req_to_token_pool = req_to_token_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.page_size = page_size
        self.device = torch.device(device) if device is not None else self.req_to_token.device
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.timer = ModeTimer(self.device)
        self.graphs = None  # CudaGraphRunner, attached by the engine on GPU
        self.step_graphs = None  # StepGraphs (whole decode steps and v2 rounds), likewise
        self.capturing = False  # a step graph is being captured: plain forwards, no timing
        self.deterministic = deterministic  # batch-invariant forwards and logits
        self.prepared: list | None = None  # a list: (which, batch) of every prepare

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, cache: CacheConfig,
                        attention_backend: str = "auto", device=None,
                        dtype: torch.dtype | None = None, num_pages: int = 256,
                        max_reqs: int = 64, max_context_len: int = 2048, tp_rank: int = 0,
                        tp_size: int = 1, with_draft: bool = True,
                        check_finite: bool = True, deterministic: bool = False) -> ModelRunner:
        """Load this rank's shard of a DeepSeek-V3 checkpoint (+ its MTP layer) and build pools.
        ``deterministic``: batch-invariant forwards (``models.batch_invariant``) over a backend
        built with ``deterministic=True``."""
        from mla_spec.attention import create_backend
        from mla_spec.loader import load_checkpoint

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        loaded = load_checkpoint(path, tp_rank=tp_rank, tp_size=tp_size, device=device,
                                 dtype=dtype, load_mtp=with_draft, progress=False,
                                 check_finite=check_finite)
        target, draft = loaded.model, loaded.mtp
        cfg: ModelConfig = loaded.cfg
        model_dtype = getattr(target, "dtype", None) or _param_dtype(target)
        kv_dtype = cache.torch_dtype(model_dtype)
        req_pool = ReqToTokenPool(max_reqs, max_context_len, device)
        kw = dict(kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim)
        tpool = MLATokenToKVPool(cfg.num_hidden_layers, num_pages, cache.page_size, kv_dtype,
                                 device, cache.k_scale, cache.v_scale, **kw)
        n = cfg.num_hidden_layers
        for layer, (ks, vs) in (loaded.kv_scales or {}).items():
            if tpool.is_fp8 and layer < n:
                tpool.set_scales(layer, ks, vs)
        heads = cfg.num_attention_heads // tp_size
        if deterministic and attention_backend == "auto":
            attention_backend = "triton" if device.type == "cuda" else "torch"
        opts = {"deterministic": True} if deterministic else {}

        def mk(pool):
            try:
                return create_backend(attention_backend, num_heads=heads, device=device,
                                      softmax_scale=cfg.softmax_scale, kv_pool=pool,
                                      req_to_token=req_pool, **opts)
            except TypeError as e:
                raise ValueError(f"deterministic mode needs an attention backend with a "
                                 f"deterministic option (triton, torch): {e}") from e

        dpool = dbackend = None
        if draft is not None:
            dpool = MLATokenToKVPool(1, num_pages, cache.page_size, kv_dtype, device,
                                     cache.k_scale, cache.v_scale, **kw)
            if dpool.is_fp8 and n in (loaded.kv_scales or {}):
                dpool.set_scales(0, *loaded.kv_scales[n])
            dbackend = mk(dpool)
        return cls(target, draft, target_pool=tpool, draft_pool=dpool,
                   req_to_token_pool=req_pool, backend=mk(tpool), draft_backend=dbackend,
                   page_size=cache.page_size, device=device, tp_rank=tp_rank, tp_size=tp_size,
                   deterministic=deterministic)

    def apply_slot_updates(self, updates) -> None:
        """Write ``(row, first_page_index, pages)`` page assignments into req_to_token."""
        ps, width = self.page_size, self.req_to_token.shape[1]
        for row, first, pages in updates:
            start = first * ps
            stop = min(start + len(pages) * ps, width)
            if stop <= start:
                continue
            slots = (torch.tensor(pages, dtype=torch.int64)[:, None] * ps
                     + torch.arange(ps)[None, :]).reshape(-1)[: stop - start]
            self.req_to_token[row, start:stop] = slots.to(self.device, torch.int32)

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs and wait for the GPU. Under TP this must come before the
        process group goes: a graph holding NCCL collectives keeps their communicator alive, and
        destroying or aborting the group would block."""
        if self.graphs is None and self.step_graphs is None:
            return
        self.graphs = self.step_graphs = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prepare(self, which: str, batch: ForwardBatch, row_req: list[int] | None = None,
                *, plan: bool = True) -> ForwardBatch:
        """Attach ``out_cache_loc``, pool and backend to ``batch`` and plan its attention (every
        host-to-device copy of a step happens here). ``row_req[i]``: the request row of packed
        row ``i`` (derived from the batch when omitted)."""
        if batch.out_cache_loc is None and batch.total_q:
            if row_req is None:
                rpi = batch.req_pool_indices.tolist()
                row_req = [r for r, q in zip(rpi, batch.seq_lens_q_cpu) for _ in range(q)]
            rows = torch.tensor(row_req, dtype=torch.int64).to(self.device)
            batch.out_cache_loc = self.req_to_token[rows, batch.positions].to(torch.int64)
        if self.prepared is not None:  # mla_spec.pipeline shows what each phase ran
            self.prepared.append((which, batch))
        batch.token_to_kv_pool = self.pools[which]
        batch.attn_backend = self.backends[which]
        if plan and self.backends[which] is not None:
            self.backends[which].plan(batch)
        return batch

    def run(self, which: str, batch: ForwardBatch, input_ids: torch.Tensor,
            target_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One forward of ``which`` ("target" or "draft") on a prepared batch -> hidden [N, D]."""
        if batch.token_to_kv_pool is None:
            self.prepare(which, batch)
        if self.capturing:
            return self.forward_eager(which, batch, input_ids, target_hidden)
        graph = self.graphs is not None and self.graphs.can_run(which, batch)
        with self.timer.section(batch.forward_mode, which, batch.total_q, batch.batch_size,
                                graph=graph):
            if graph:
                return self.graphs.replay(which, batch, input_ids, target_hidden)
            return self.forward_eager(which, batch, input_ids, target_hidden)

    def forward_eager(self, which: str, batch: ForwardBatch, input_ids: torch.Tensor,
                      target_hidden: torch.Tensor | None = None) -> torch.Tensor:
        if which == "draft" and self.draft is None:
            raise ValueError("this runner has no draft (MTP) model: speculation needs one")
        with batch_invariant(self.deterministic):
            if which == "target":
                return self.target(input_ids, batch.positions, batch)
            return self.draft(input_ids, batch.positions, target_hidden, batch)

    def logits(self, which: str, hidden: torch.Tensor) -> torch.Tensor:
        """``[M, vocab]`` fp32 logits (identical on every rank)."""
        model = self.draft if which == "draft" and hasattr(self.draft, "compute_logits") \
            else self.target
        with batch_invariant(self.deterministic):
            return model.compute_logits(hidden)

    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    @property
    def config(self) -> Any:
        return getattr(self.target, "cfg", getattr(self.target, "config", None))


def _param_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
