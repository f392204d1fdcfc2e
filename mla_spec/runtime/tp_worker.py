"""Tensor-parallel worker ranks of the Engine: ranks 1..N-1 replay rank 0's step plans.

Rank 0 schedules and sends every ``StepPlan`` through a queue per worker; a worker
(:func:`serve_plans`) builds its shard once with ``build_rank`` and runs plans until "stop", so
its collectives pair with rank 0's. The transport knows nothing of plans beyond ``plan.kind``.
"""

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mla_spec.distributed import note_progress

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
    return [mp.get_context("spawn").Queue() for _ in range(tp_size - 1)]


def start_tp_workers(queues: list, build_rank: Callable[..., RankExecutor],
                     args: Sequence[Any] = (), *, timeout_s: float | None):
    """Start ranks ``1..len(queues)`` serving :func:`serve_plans` with a picklable ``build_rank``;
    this process becomes rank 0. Returns the ``Workers`` handle."""
    from mla_spec.runtime.workers import spawn_workers
    # every worker gets its own queue: start them one by one through a shared list
    return spawn_workers(len(queues) + 1, _serve_rank, (queues, build_rank, tuple(args)),
                         timeout_s=timeout_s, interrupt_main=False)


def broadcast_plan(queues: list, plan: Any) -> None:
    """Send one step's plan to every worker rank (before rank 0 executes it)."""
    for q in queues:
        q.put(plan)


def stop_tp_workers(workers, queues: list, stop_plan: Any) -> None:
    """Send ``stop_plan`` to the live workers, stop them, release their queues (safe on failure)."""
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
        note_progress()  # the driver's watchdog sees a rank that never got its plan
        logger.debug("rank %d: plan %s, bs %d", rank, plan.kind, plan.batch_size)
        executor.execute(plan)
        executor.after_step()
        if plan.kind == "stop":
            executor.close()  # before the process exits and rank 0 drops the group
            return
