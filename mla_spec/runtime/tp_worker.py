"""Tensor-parallel worker ranks of the Engine: ranks 1..N-1 replay rank 0's step plans.

Why: scheduling is host-only work done once, on rank 0 (the caller's process). The other ranks
only need to run the same forward passes so that their collectives (one all-reduce after
attention and one after the MLP / MoE, :func:`mla_spec.distributed.tp_all_reduce`) pair with
rank 0's. So rank 0 sends every step plan (:class:`~mla_spec.scheduler.StepPlan`, plain lists)
to each worker through a queue of its own, and every rank executes it through the same code.

This module is the transport only; it knows nothing of models or plans beyond ``plan.kind``.
Rank 0 side (used by :class:`~mla_spec.engine.Engine`): :func:`plan_queues`,
:func:`start_tp_workers` (through :func:`mla_spec.runtime.workers.spawn_workers`, so a rank that
dies is seen by its watchdog), :func:`broadcast_plan`, :func:`stop_tp_workers`. Worker side:
:func:`serve_plans` runs ``build_rank(rank, world_size, *args)`` once (the rank's shard: the
engine passes :func:`mla_spec.spec.eagle.build_rank`), then executes every plan until a
``"stop"`` plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

__all__ = ["RankExecutor", "plan_queues", "start_tp_workers", "broadcast_plan",
           "stop_tp_workers", "serve_plans"]


class RankExecutor(Protocol):
    """What a worker rank runs plans on (the engine's: :class:`mla_spec.spec.eagle.EagleWorker`)."""

    def execute(self, plan: Any) -> Any: ...

    def after_step(self) -> None: ...

    def close(self) -> None: ...


def plan_queues(tp_size: int) -> list:
    """One (spawn-context) plan queue per worker rank 1..tp_size-1."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    return [ctx.Queue() for _ in range(tp_size - 1)]


def start_tp_workers(queues: list, build_rank: Callable[..., RankExecutor],
                     args: Sequence[Any] = (), *, timeout_s: float | None):
    """Start ranks ``1..len(queues)``, each serving :func:`serve_plans` with
    ``build_rank(rank, world_size, *args)`` (a module-level, picklable function); this process
    becomes rank 0. Returns the :class:`~mla_spec.runtime.workers.Workers` handle (its ``.device``
    is rank 0's device).
    """
    from mla_spec.runtime.workers import spawn_workers

    # every worker gets its own queue: start them one by one through a shared list
    return spawn_workers(len(queues) + 1, _serve_rank, (queues, build_rank, tuple(args)),
                         timeout_s=timeout_s, interrupt_main=False)


def broadcast_plan(queues: list, plan: Any) -> None:
    """Send one step's plan to every worker rank (before rank 0 executes it)."""
    for q in queues:
        q.put(plan)


def stop_tp_workers(workers, queues: list, stop_plan: Any) -> None:
    """Send ``stop_plan`` to the live worker ranks, stop them and release their queues.

    Safe after a failure: queues to dead workers are not flushed (nobody reads them), every queue
    is closed and its feeder thread joined, so no semaphore or thread outlives the engine.
    """
    procs = workers.processes if workers is not None else []
    for q, p in zip(queues, procs):
        if p.is_alive():
            q.put(stop_plan)
    if workers is not None:
        workers.shutdown()  # joins them (terminates stragglers), destroys the group
    for i, q in enumerate(queues):
        if i >= len(procs) or procs[i].exitcode != 0:
            q.cancel_join_thread()  # nobody read it to the end: never block on unsent plans
        q.close()
        q.join_thread()


def _serve_rank(rank: int, world_size: int, queues, build_rank, args) -> None:
    serve_plans(queues[rank - 1], build_rank(rank, world_size, *args), rank)


def serve_plans(queue, executor: RankExecutor, rank: int) -> None:
    """Ranks 1..N-1: execute every plan rank 0 sends, until (and including) a ``"stop"`` plan."""
    while True:
        plan = queue.get()
        logger.debug("rank %d: plan %s, bs %d", rank, plan.kind, plan.batch_size)
        executor.execute(plan)
        executor.after_step()
        if plan.kind == "stop":
            executor.close()  # before the process exits and rank 0 drops the group
            return
