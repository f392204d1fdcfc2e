"""Tensor parallelism: process launch, the TP all-reduce (linears: ``mla_spec.models.linear``).

DeepSeek-V3 is split Megatron-style over ``tp_size`` ranks: attention heads (``q_b_proj`` /
``kv_b_proj`` column-parallel, ``o_proj`` row-parallel; the 576-wide latent KV cache is shared by
all heads, so it is replicated), MLP and expert intermediate dims (``gate_proj`` / ``up_proj``
column, ``down_proj`` row), with one all-reduce after attention and one after the MLP / MoE.
Everything else is replicated, so all ranks hold the same hidden state and the same logits.

Processes. :func:`launch` runs ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes
(``torch.multiprocessing`` spawn, a free TCP port on 127.0.0.1, NCCL when every rank gets a GPU,
gloo otherwise) and returns each rank's result. A watchdog polls the children: a rank that dies or
raises ends the whole run with an error naming it within about a second, instead of leaving the
others blocked in a collective (collectives also time out after ``timeout_s``).
:func:`spawn_workers` starts ranks ``1..N-1`` as processes and makes the *calling* process rank 0,
so a notebook can drive rank 0 in-process. Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` in the environment) :func:`launch` runs ``fn`` in place on the current rank.
"""

from __future__ import annotations

import io
import logging
import os
import queue as queue_mod
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "launch",
    "spawn_workers",
    "Workers",
    "RankFailedError",
    "init_distributed",
    "resolve_backend",
    "rank_device",
    "tp_rank",
    "tp_size",
    "tp_all_reduce",
    "ReplicatedLinear",  # noqa: F822 - lazy, see __getattr__
    "ColumnParallelLinear",  # noqa: F822 - lazy, see __getattr__
    "RowParallelLinear",  # noqa: F822 - lazy, see __getattr__
]

log = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A rank died, raised, or the run timed out (the message names the rank)."""


# ---------------------------------------------------------------------------------------------
# process groups
# ---------------------------------------------------------------------------------------------
def resolve_backend(backend: str, world_size: int) -> str:
    """``"auto"`` -> ``"nccl"`` when there are >= world_size GPUs, else ``"gloo"``."""
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"backend {backend!r}: supported 'auto', 'nccl', 'gloo'")
    if backend == "auto":
        ok = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
        return "nccl" if ok and dist.is_nccl_available() else "gloo"
    return backend


def rank_device(rank: int, backend: str) -> torch.device:
    """The device a rank computes on: ``cuda:rank`` under NCCL, CPU under gloo."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    backend: str = "auto",
    init_method: str | None = None,
    timeout_s: float = 30.0,
) -> str:
    """Initialize the default process group (no-op if it already is); return the backend.

    Without arguments the rank, world size and rendezvous come from the environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), as ``torchrun`` sets them.
    """
    if dist.is_initialized():
        return dist.get_backend()
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    backend = resolve_backend(backend, world_size)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        backend,
        init_method=init_method or "env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return backend


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_all_reduce(x: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place; returns ``x``). No-op at TP 1.
    Inference only: raises NotImplementedError when autograd would need it (training is TP 1).

    ``size`` is the caller's TP size (skips the call when 1 even if a group exists). Every rank
    receives the same bits, so replicated code after it stays identical across ranks.
    """
    n = tp_size() if size is None else size
    if n == 1:
        return x
    if x.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "training under tensor parallelism is not supported (replicated tensors feeding "
            "sharded ones would need their gradients reduced): run forward_train at TP 1, or "
            "under torch.no_grad() for evaluation"
        )
    if x.dtype == torch.bfloat16 and not x.is_cuda:
        # gloo sums bf16 correctly but in bf16 steps; fp32 keeps TP results close to TP 1.
        y = x.float()
        dist.all_reduce(y)
        return x.copy_(y)
    dist.all_reduce(x)
    return x


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------------------------
# launch: all ranks in child processes
# ---------------------------------------------------------------------------------------------
def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(_to_cpu(obj), buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _child(rank, world_size, backend, init_method, timeout_s, fn, args, results) -> None:
    code = 0
    if backend == "gloo":  # CPU ranks share the cores: avoid oversubscribing them (as torchrun)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        init_distributed(
            rank, world_size, backend=backend, init_method=init_method, timeout_s=timeout_s
        )
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", _pack(out)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        code = 1
    results.close()
    results.join_thread()  # flush the queue before leaving
    # Leave without waiting for peers in destroy_process_group (a slow peer must not hang us).
    os._exit(code)


def _running_under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def launch(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "auto",
    args: Sequence[Any] = (),
    timeout_s: float = 30.0,
    run_timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return ``[result_0, ...]``.

    ``fn`` must be picklable (a module-level function). Results come back through a queue
    (tensors moved to CPU). Raises :class:`RankFailedError` naming the rank as soon as one dies or
    raises (the others are terminated), or when ``run_timeout_s`` passes.
    Under ``torchrun`` runs ``fn`` on this rank only and all-gathers the results.
    """
    if world_size < 1:
        raise ValueError(f"world_size {world_size}: must be >= 1")
    if _running_under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(
                f"world_size {world_size} but torchrun started {os.environ['WORLD_SIZE']} ranks"
            )
        owns_group = not dist.is_initialized()
        init_distributed(backend=backend, timeout_s=timeout_s)
        out = fn(dist.get_rank(), world_size, *args)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, _to_cpu(out))
        if owns_group:  # as in spawn mode, the group lives for the duration of fn only
            dist.barrier()
            dist.destroy_process_group()
        return gathered
    backend = resolve_backend(backend, world_size)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, backend, init_method, timeout_s, fn, tuple(args), results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, run_timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
        results.close()
        results.join_thread()


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _failure_message(procs, out, errors) -> str:
    """Root cause first: ranks that died without a word, then errors not caused by a lost peer."""
    dead = [
        f"rank {r} died (exit code {p.exitcode})"
        for r, p in enumerate(procs)
        if r not in out and r not in errors and not p.is_alive() and p.exitcode not in (0, None)
    ]
    ranked = sorted(errors.items(), key=lambda kv: (any(s in kv[1] for s in _PEER_LOST), kv[0]))
    raised = [f"rank {r} raised {msg}" for r, msg in ranked]
    return "; then ".join(dead + raised[:1]) + (
        f" ({len(raised) - 1} more ranks failed after it)" if len(raised) > 1 else "")


def _collect(procs, results, world_size: int, run_timeout_s: float | None) -> list[Any]:
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = None if run_timeout_s is None else time.monotonic() + run_timeout_s
    while len(out) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            gone = [r for r, p in enumerate(procs)
                    if r not in out and r not in errors and not p.is_alive()]
            if gone:
                time.sleep(0.3)  # a result or error queued just before exit may still arrive
                _drain(results, out, errors)
                if any(r not in out and r not in errors for r in gone):
                    raise RankFailedError(_failure_message(procs, out, errors)) from None
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(out))
                raise RankFailedError(
                    f"ranks {missing} still running after run_timeout_s"
                ) from None
            continue
        if status == "error":
            errors[rank] = payload
            time.sleep(0.3)  # let the other ranks' reports (and deaths) land
            _drain(results, out, errors)
            raise RankFailedError(_failure_message(procs, out, errors))
        out[rank] = _unpack(payload)
    return [out[r] for r in range(world_size)]


def _drain(results, out, errors) -> None:
    while True:
        try:
            rank, status, payload = results.get_nowait()
        except queue_mod.Empty:
            return
        if status == "error":
            errors[rank] = payload
        else:
            out[rank] = _unpack(payload)


# ---------------------------------------------------------------------------------------------
# spawn_workers: the caller is rank 0
# ---------------------------------------------------------------------------------------------
def _worker_main(rank, world_size, backend, init_method, timeout_s, worker_fn, args) -> None:
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_distributed(rank, world_size, backend=backend, init_method=init_method,
                     timeout_s=timeout_s)
    worker_fn(rank, world_size, *args)
    os._exit(0)


@dataclass
class Workers:
    """Ranks ``1..N-1`` running in child processes; the caller is rank 0.

    A watchdog thread polls the children every 0.2 s. When one dies with a non-zero exit code
    it records :attr:`failure`, logs it, and (``interrupt_main``) raises ``KeyboardInterrupt`` in
    the main thread so rank 0 stops instead of waiting for a collective that cannot complete.
    Call :meth:`check` at safe points to turn a failure into :class:`RankFailedError`.
    """

    world_size: int
    backend: str
    device: torch.device
    processes: list = field(default_factory=list)
    failure: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        if self.failure is not None:
            raise RankFailedError(self.failure)

    def _watch(self, interrupt_main: bool) -> None:
        import _thread

        while not self._stop.wait(0.2):
            for r, p in enumerate(self.processes, start=1):
                if not p.is_alive() and p.exitcode not in (0, None):
                    self.failure = f"rank {r} died (exit code {p.exitcode})"
                    log.error("%s; stopping rank 0", self.failure)
                    if interrupt_main:
                        _thread.interrupt_main()
                    return

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the watchdog, join the workers (terminate stragglers), destroy the group."""
        self._stop.set()
        for p in self.processes:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.terminate()
                p.join(timeout=1)
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_workers(
    world_size: int,
    worker_fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    backend: str = "auto",
    timeout_s: float = 30.0,
    interrupt_main: bool = True,
) -> Workers:
    """Start ``worker_fn(rank, world_size, *args)`` on ranks 1..N-1; make this process rank 0.

    Returns a :class:`Workers` handle (``.device`` is rank 0's device). Rank 0's process group is
    initialized on return; call ``workers.shutdown()`` when done.
    """
    if world_size < 1:
        raise ValueError(f"world_size {world_size}: must be >= 1")
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; shut it down first")
    backend = resolve_backend(backend, world_size)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    workers = Workers(world_size, backend, rank_device(0, backend))
    for r in range(1, world_size):
        p = ctx.Process(
            target=_worker_main,
            args=(r, world_size, backend, init_method, timeout_s, worker_fn, tuple(args)),
            daemon=True,
        )
        p.start()
        workers.processes.append(p)
    init_distributed(0, world_size, backend=backend, init_method=init_method, timeout_s=timeout_s)
    threading.Thread(target=workers._watch, args=(interrupt_main,), daemon=True).start()
    return workers


# The linears live in ``mla_spec.models.linear``; exported here lazily (PEP 562) so that module
# can import ``tp_all_reduce`` from this one without a cycle.
_LINEARS = ("ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear")


def __getattr__(name: str):
    if name in _LINEARS:
        from mla_spec.models import linear

        return getattr(linear, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
