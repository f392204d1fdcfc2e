"""Tensor-parallel group state and collectives: the one distributed module the models import.

DeepSeek-V3 is split Megatron-style: attention heads and MLP / expert intermediate dims over
``tp_size`` ranks (the 576-wide latent KV cache is replicated), one all-reduce after attention
and one after the MLP / MoE; everything else is replicated, so all ranks hold the same logits.
Here: :func:`init_distributed` (NCCL when every rank has a GPU, else gloo), rank / size, and the
collectives, which time out after ``timeout_s`` (300 s gloo, 30 s NCCL). :func:`track_progress`
counts collectives so a hung rank can be named. Process management: :mod:`mla_spec.runtime`.
Imports nothing from the package.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT_S", "default_timeout_s", "init_distributed", "resolve_backend",
           "rank_device", "tp_rank", "tp_size", "tp_all_reduce", "tp_all_gather", "track_progress",
           "note_progress"]

DEFAULT_TIMEOUT_S = {"gloo": 300.0, "nccl": 30.0}


def default_timeout_s(backend: str) -> float:
    """Collective timeout when none is given: 300 s under gloo (CPU), 30 s under NCCL."""
    return DEFAULT_TIMEOUT_S.get(backend, DEFAULT_TIMEOUT_S["gloo"])


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


def _debug_hooks() -> None:
    """Opt-in diagnostics on every rank: ``MLA_SPEC_STACK_DUMP_S=N`` dumps all Python stacks
    every N seconds; ``MLA_SPEC_LOG_LEVEL=INFO`` turns on progress logs."""
    every = os.environ.get("MLA_SPEC_STACK_DUMP_S")
    if every:
        import faulthandler

        faulthandler.dump_traceback_later(float(every), repeat=True)
    level = os.environ.get("MLA_SPEC_LOG_LEVEL")
    if level:
        import logging

        logging.basicConfig(format=f"%(asctime)s pid {os.getpid()} %(name)s: %(message)s")
        logging.getLogger("mla_spec").setLevel(level.upper())


def init_distributed(rank: int | None = None, world_size: int | None = None, *,
                     backend: str = "auto", init_method: str | None = None,
                     timeout_s: float | None = None) -> str:
    """Initialize the default process group (no-op if it already is); return the backend.
    Without arguments, rank and rendezvous come from the environment, as ``torchrun`` sets them."""
    if dist.is_initialized():
        return dist.get_backend()
    _debug_hooks()
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    backend = resolve_backend(backend, world_size)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    timeout = default_timeout_s(backend) if timeout_s is None else timeout_s
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout))
    return backend


_progress: tuple | None = None  # (shared counters, this rank's slot)


def track_progress(counters=None, rank: int = 0) -> None:
    """Count this rank's progress (:func:`note_progress`) into the shared ``counters[rank]`` the
    workers' watchdog reads; None stops counting."""
    global _progress
    _progress = None if counters is None else (counters, rank)


def note_progress() -> None:
    if _progress is not None:
        _progress[0][_progress[1]] += 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_all_reduce(x: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """Sum ``x`` over the TP ranks in place (returns ``x``); no-op when ``size`` is 1.
    Inference only: NotImplementedError under autograd. Every rank receives the same bits."""
    n = tp_size() if size is None else size
    if n == 1:
        return x
    if x.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "training under tensor parallelism is not supported (replicated tensors feeding "
            "sharded ones would need their gradients reduced): run forward_train at TP 1, or "
            "under torch.no_grad() for evaluation")
    note_progress()
    if x.dtype == torch.bfloat16 and not x.is_cuda:
        # gloo sums bf16 correctly but in bf16 steps; fp32 keeps TP results close to TP 1.
        y = x.float()
        dist.all_reduce(y)
        return x.copy_(y)
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (rank order). No-op at TP 1.
    Inference only, like :func:`tp_all_reduce`; every rank receives the same bits."""
    n = tp_size() if size is None else size
    if n == 1:
        return x
    if x.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("training under tensor parallelism is not supported: run at "
                                  "TP 1, or under torch.no_grad() for evaluation")
    note_progress()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)
