"""MLABackend: the one interface every attention backend implements (plan once, run per layer).

Absorbed MLA (DeepSeek-V3): every local head ``h`` of query row ``t`` has a 576-wide query
``[q_nope[t, h] (512, already multiplied by W_UK) | q_pe[t, h] (64, roped)]``; all heads share
one latent KV head whose rows ``[ckv | kpe]`` live in the paged pool. For request ``b`` with
``q_len`` rows and ``kv_len`` KV positions, row ``i`` sees positions ``j < kv_len - q_len + i + 1``
(causal, aligned to the end of the KV) and

    out[t, h] = v_scale * softmax_j(sm_scale * k_scale * q[t, h] . s_j) @ s_j[:512]

(``s_j`` the stored row; scales are 1.0 for non-FP8 pools, see ``mla_spec.kv_cache``).

Life cycle, per step::

    backend.plan(batch)                                   # host work, once, before layer 0
    pool.store(layer_id, batch.out_cache_loc, ckv, kpe)   # the model writes the new rows
    out = backend.forward(q_nope, q_pe, layer_id, batch)  # [N, H, 512] in q_nope's dtype

Each backend implements ``forward`` itself (one frame from the model to its kernel); the base
class is a library of helpers, not a dispatcher. The contract: :class:`MLABackend`'s docstring.
"""

import copyreg
import sys
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from mla_spec.forward_batch import ForwardBatch
from mla_spec.forward_mode import ForwardMode

__all__ = ["MLABackend", "AttnPlan", "UnsupportedError", "write_output"]


class UnsupportedError(ValueError):
    """A backend was asked for a mode / dtype / device it cannot run."""


@dataclass
class AttnPlan:
    """Per-step metadata shared by the backends (built on the host in ``plan``).

    ``fixed_q`` is the common rows-per-request when every request has the same number of query
    rows (decode, verify, draft-extend v2), else None (ragged: v1 draft extend, prefill).
    """

    mode: ForwardMode
    bs: int
    total_q: int
    seq_lens_q_cpu: list[int]
    kv_lens_cpu: list[int]
    max_q: int
    max_kv: int
    fixed_q: int | None
    kv_lens: torch.Tensor  # [bs] int32 on the device
    seq_lens_q: torch.Tensor  # [bs] int32
    qo_indptr: torch.Tensor  # [bs + 1] int32
    req_pool_indices: torch.Tensor  # [bs] int64
    extra: dict


def _req_to_token_tensor(req_to_token) -> torch.Tensor:
    t = getattr(req_to_token, "req_to_token", req_to_token)
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError("req_to_token must be a ReqToTokenPool or a [max_reqs, max_ctx] tensor")
    return t


_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` name one device (``cuda`` without an index matches any ``cuda:i``)."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_queries(q_nope: torch.Tensor, q_pe: torch.Tensor, layer_id: int, pool) -> None:
    """Dtype / device / layer checks of ``forward`` (host metadata only, no device sync)."""
    if q_nope.dtype not in _Q_DTYPES or q_pe.dtype != q_nope.dtype:
        names = ", ".join(str(d).replace("torch.", "") for d in _Q_DTYPES)
        raise ValueError(f"q_nope {q_nope.dtype} / q_pe {q_pe.dtype}: queries must share one "
                         f"dtype among {names}")
    for nm, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        if not same_device(t.device, pool.device):
            raise ValueError(f"{nm} is on {t.device} but the KV cache is on {pool.device}: "
                             "queries must be on the cache's device")
    if not 0 <= layer_id < pool.num_layers:
        raise ValueError(f"layer_id {layer_id}: the KV pool has layers 0..{pool.num_layers - 1}")


class _BackendMeta(ABCMeta):
    """Backend classes pickle by reference when importable, else by value (cloudpickle): one
    defined in a notebook or a function still reaches the spawned tensor-parallel ranks."""


def _reduce_backend_class(cls):
    obj = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    if obj is cls and cls.__module__ != "__main__":
        return cls.__qualname__  # pickle's own by-reference form
    import cloudpickle
    return cloudpickle.loads, (cloudpickle.dumps(cls),)


copyreg.pickle(_BackendMeta, _reduce_backend_class)


class MLABackend(metaclass=_BackendMeta):
    """Base class of the attention backends; a new one subclasses it (or a backend) and is
    registered with ``mla_spec.register_backend(name, cls)``. The contract, checked by
    ``mla_spec.attention.conformance.check_backend``:

    * ``__init__(num_heads, softmax_scale, kv_pool, req_to_token, device=None, **options)``:
      call ``super().__init__`` first. ``num_heads`` is the rank's share (128 / TP).
    * ``plan(batch)``: host work once per step, before layer 0 (no device sync): the
      :class:`AttnPlan` of ``common_plan(batch)``, stored in ``batch.extra[self.name]`` and
      returned. Rows per request by mode: ``ForwardBatch``'s table (v2 keeps all
      ``num_draft_tokens`` rows; ragged modes allow 0); ``kv_lens`` count the new rows too.
    * ``forward(q_nope, q_pe, layer_id, batch, *, out=None)``: ``q_nope [N, H, 512]`` (times
      W_UK), ``q_pe [N, H, 64]`` (roped), one dtype (bf16 / fp16 / fp32), rows request after
      request (``plan.qo_indptr``); the layer's new KV rows are already in the pool. Returns
      ``[N, H, 512]`` in ``q_nope.dtype`` (into ``out`` when given), never writes the pool. Move
      one: ``checked_plan`` (None for IDLE: return ``empty_output``); last: ``write_output``.
    * The pool: ``kv_pool.get_kv(layer_id)`` is ``[pages, page_size, 576]`` rows ``[ckv 512 |
      kpe 64]``, slot ``page * page_size + offset``, ``req_to_token[req, pos]`` a position's
      slot. With an FP8 pool the row holds e4m3 values ``s``; the key is ``s * k_scale``, the
      value ``s[:512] * v_scale`` (``kv_pool.read_scales(layer_id)``: per layer, 1.0 unless FP8).
    * ``supports`` / ``kv_dtypes`` / ``device_reason`` / ``mode_reason`` declare what it cannot
      run (a reason string); ``checked_plan`` then raises :class:`UnsupportedError`.
    * CUDA graphs (``graph_safe = True`` asks for capture): ``forward`` never syncs with the
      host (no ``.item()`` / ``.tolist()``); it reads lengths from the plan's device tensors
      (``kv_lens``, ``seq_lens_q``, ``qo_indptr``, ``req_pool_indices``: refreshed in place
      before each replay); its host values stay those of the capture (planned at
      ``max_context_len``), and tensors in ``plan.extra`` are not refreshed. Spec v1's round
      graph captures DRAFT_EXTEND at its capacity: ``2 * bs`` requests whose rows (0 to
      ``num_draft_tokens`` each, ``plan.max_q`` at most) only the device ``qo_indptr`` /
      ``seq_lens_q`` give, the last ``bs`` of them padding on the scratch request row 0.
    """

    name: ClassVar[str] = "base"
    graph_safe: ClassVar[bool] = False
    kv_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
    )

    def __init__(self, num_heads: int, softmax_scale: float, kv_pool, req_to_token, device=None):
        if num_heads < 1:
            raise ValueError(f"num_heads {num_heads}: must be >= 1")
        self.num_heads = num_heads
        self.softmax_scale = float(softmax_scale)
        self.kv_pool = kv_pool
        self.req_to_token = _req_to_token_tensor(req_to_token)
        self.device = torch.device(device) if device is not None else kv_pool.device
        reason = self._instance_device_reason(self.device)
        if reason is not None:
            raise UnsupportedError(f"backend {self.name!r} cannot run on {self.device}: {reason}")

    @classmethod
    def device_reason(cls, device: torch.device) -> str | None:
        """None if this backend can run on ``device`` at all, else why not."""
        return None

    def _instance_device_reason(self, device: torch.device) -> str | None:
        """Like :meth:`device_reason`, for this instance (an injected kernel may lift it)."""
        return self.device_reason(device)

    @classmethod
    def mode_reason(cls, mode: ForwardMode) -> str | None:
        """None if the backend handles ``mode`` (every mode by default)."""
        return None

    def supports(self, mode: ForwardMode, kv_dtype: torch.dtype | None = None,
                 device=None) -> str | None:
        """None when ``(mode, kv_dtype, device)`` can run here, else a human-readable reason."""
        if device is not None:
            r = self._instance_device_reason(torch.device(device))
            if r is not None:
                return r
        if kv_dtype is not None and kv_dtype not in self.kv_dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.kv_dtypes)
            kd = str(kv_dtype).replace("torch.", "")
            return f"kv dtype {kd} not supported (supports {names})"
        if mode.is_idle():
            return None
        return self.mode_reason(mode)

    def common_plan(self, batch: ForwardBatch) -> AttnPlan:
        """The metadata every backend needs for this step (validated; not stored)."""
        if batch.req_pool_indices is None and not batch.forward_mode.is_idle():
            raise ValueError("batch.req_pool_indices is required (rows of req_to_token)")
        q_cpu, kv_cpu = list(batch.seq_lens_q_cpu), list(batch.kv_lens_cpu)
        for b, (q, k) in enumerate(zip(q_cpu, kv_cpu)):
            if q > k:
                raise ValueError(f"request {b}: {q} query rows but only {k} KV positions")
            if k > self.req_to_token.shape[1]:
                raise ValueError(f"request {b}: kv_len {k} > max_context_len "
                                 f"{self.req_to_token.shape[1]}")
        dev = self.device
        fixed = q_cpu[0] if q_cpu and all(q == q_cpu[0] for q in q_cpu) else None
        rpi = batch.req_pool_indices
        return AttnPlan(
            mode=batch.forward_mode, bs=batch.batch_size, total_q=sum(q_cpu),
            seq_lens_q_cpu=q_cpu, kv_lens_cpu=kv_cpu, max_q=max(q_cpu, default=0),
            max_kv=max(kv_cpu, default=0), fixed_q=fixed,
            kv_lens=torch.tensor(kv_cpu, dtype=torch.int32, device=dev),
            seq_lens_q=batch.seq_lens_q.to(dev, torch.int32),
            qo_indptr=batch.qo_indptr.to(dev, torch.int32),
            req_pool_indices=(torch.zeros(0, dtype=torch.int64, device=dev) if rpi is None
                              else rpi.to(dev, torch.int64)),
            extra={},
        )

    def plan(self, batch: ForwardBatch) -> AttnPlan:
        """Host-side metadata for this step, stored in ``batch.extra[self.name]`` (an override:
        ``common_plan``, its extras (not for IDLE), then store)."""
        plan = self.common_plan(batch)
        batch.extra[self.name] = plan
        return plan

    def checked_plan(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer_id: int,
                     batch: ForwardBatch) -> AttnPlan | None:
        """``forward``'s first move: check the queries against the batch and this backend (no
        device sync); the batch's plan (planned now if need be), or None when it has no rows."""
        plan = batch.extra.get(self.name)
        if isinstance(plan, AttnPlan) and plan.extra.get("checked") == (
                q_nope.shape, q_pe.shape, q_nope.dtype, q_pe.dtype, q_nope.device) and \
                0 <= layer_id < self.kv_pool.num_layers:
            return plan  # queries like these passed the checks below on an earlier layer
        mode = batch.forward_mode
        if mode.is_idle() or batch.total_q == 0:
            return None
        H, dv, n = self.num_heads, self.kv_pool.kv_lora_rank, batch.total_q
        _check_queries(q_nope, q_pe, layer_id, self.kv_pool)
        exp_pe = (n, H, self.kv_pool.qk_rope_head_dim)
        if tuple(q_nope.shape) != (n, H, dv) or tuple(q_pe.shape) != exp_pe:
            raise ValueError(
                f"q_nope {tuple(q_nope.shape)} / q_pe {tuple(q_pe.shape)}: expected "
                f"{(n, H, dv)} / {exp_pe} (N rows of the batch, {H} heads)"
            )
        reason = self.supports(mode, self.kv_pool.dtype)
        if reason is not None:
            raise UnsupportedError(f"backend {self.name!r}, mode {mode.name}: {reason}")
        if not isinstance(plan, AttnPlan):
            plan = self.plan(batch)
        plan.extra["checked"] = (q_nope.shape, q_pe.shape, q_nope.dtype, q_pe.dtype,
                                 q_nope.device)
        return plan

    def empty_output(self, q_nope: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``forward``'s result when ``checked_plan`` found no rows: ``[0, H, 512]``."""
        res = q_nope.new_zeros((0, self.num_heads, self.kv_pool.kv_lora_rank))
        return res if out is None else out[:0]

    @abstractmethod
    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer_id: int,
                batch: ForwardBatch, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer: q_nope ``[N, H, 512]``, q_pe ``[N, H, 64]`` -> ``[N, H, 512]``
        in ``q_nope.dtype`` (into ``out`` when given); see the class docstring."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, num_heads={self.num_heads}, "
                f"softmax_scale={self.softmax_scale:.7g}, kv_dtype={self.kv_pool.dtype}, "
                f"device={self.device})")


def write_output(res: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``forward``'s last move: ``res``, or ``res`` copied into the caller's ``out``."""
    return res if out is None else out.copy_(res)
