"""Tensor-parallel worker ranks of the Engine: ranks 1..N-1 replay rank 0's step plans.

Why: scheduling is host-only work done once, on rank 0 (the caller's process). The other ranks
only need to run the same forward passes so that their collectives (one all-reduce after
attention and one after the MLP / MoE, :func:`mla_spec.parallel.tp_all_reduce`) pair with rank
0's. So rank 0 sends every :class:`~mla_spec.scheduler.StepPlan` to each worker through a queue
of its own, and every rank executes it through the same :class:`~mla_spec.spec.eagle.EagleWorker`
code; a ``StepPlan("stop")`` ends a worker's loop.

Layout. Rank 0 side (used by :class:`~mla_spec.engine.Engine`): :func:`plan_queues`,
:func:`start_tp_workers` (through :func:`mla_spec.workers.spawn_workers`, so a rank that dies is
seen by its watchdog), :func:`broadcast_plan`, :func:`stop_tp_workers`. Worker side:
``_tp_worker`` builds the rank's shard with :meth:`ModelRunner.from_checkpoint` (and its CUDA
graphs on GPU), then loops on plans.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mla_spec.config import SpecConfig
from mla_spec.model_runner import ModelRunner
from mla_spec.scheduler import StepPlan
from mla_spec.spec.eagle import EagleWorker

logger = logging.getLogger(__name__)

__all__ = ["plan_queues", "start_tp_workers", "broadcast_plan", "stop_tp_workers",
           "attach_graphs"]


def attach_graphs(runner, worker, graph_batch_sizes: Sequence[int] | None) -> None:
    """Capture the fixed-shape forwards of ``runner`` / ``worker`` per batch-size bucket."""
    from mla_spec.cuda_graph import CudaGraphRunner

    runner.graphs = CudaGraphRunner.capture(runner, worker, graph_batch_sizes)
    logger.info("rank %d: %d CUDA graphs (%s)", runner.tp_rank, len(runner.graphs.graphs),
                runner.graphs.disabled_reason or "captured")


def plan_queues(tp_size: int) -> list:
    """One (spawn-context) plan queue per worker rank 1..tp_size-1."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    return [ctx.Queue() for _ in range(tp_size - 1)]


def start_tp_workers(queues: list, runner_kw: dict, spec: SpecConfig, *,
                     cuda_graph: bool | None, graph_batch_sizes: Sequence[int] | None,
                     timeout_s: float | None):
    """Start ranks ``1..len(queues)`` on ``ModelRunner.from_checkpoint(**runner_kw)`` shards; this
    process becomes rank 0. Returns the :class:`~mla_spec.workers.Workers` handle (its ``.device``
    is rank 0's device). On GPU the workers capture CUDA graphs unless ``cuda_graph is False``.
    """
    from mla_spec.workers import spawn_workers

    worker_kw = dict(runner_kw)
    if runner_kw["device"].type == "cuda" and cuda_graph is not False:
        worker_kw.update(cuda_graph=True, graph_batch_sizes=graph_batch_sizes)
    # every worker gets its own queue: start them one by one through a shared list
    return spawn_workers(len(queues) + 1, _tp_worker_dispatch, (queues, worker_kw, spec),
                         timeout_s=timeout_s, interrupt_main=False)


def broadcast_plan(queues: list, plan: StepPlan) -> None:
    """Send one step's plan to every worker rank (before rank 0 executes it)."""
    for q in queues:
        q.put(plan)


def stop_tp_workers(workers, queues: list) -> None:
    """Stop the worker ranks and release their queues.

    Safe after a failure: queues to dead workers are not flushed (nobody reads them), every queue
    is closed and its feeder thread joined, so no semaphore or thread outlives the engine.
    """
    procs = workers.processes if workers is not None else []
    for q, p in zip(queues, procs):
        if p.is_alive():
            q.put(StepPlan("stop"))
    if workers is not None:
        workers.shutdown()  # joins them (terminates stragglers), destroys the group
    for i, q in enumerate(queues):
        if i >= len(procs) or procs[i].exitcode != 0:
            q.cancel_join_thread()  # nobody read it to the end: never block on unsent plans
        q.close()
        q.join_thread()


def _tp_worker_dispatch(rank: int, world_size: int, queues, runner_kw: dict,
                        spec: SpecConfig) -> None:
    _tp_worker(rank, world_size, queues[rank - 1], dict(runner_kw), spec)


def _tp_worker(rank: int, world_size: int, queue, runner_kw: dict, spec: SpecConfig) -> None:
    """Ranks 1..N-1: build this rank's shard, then execute every plan rank 0 sends."""
    from mla_spec.parallel import rank_device, resolve_backend

    device = runner_kw.pop("device")
    if device.type == "cpu":
        torch.set_num_threads(1)  # N CPU ranks share the cores: one thread each
    graphs = runner_kw.pop("cuda_graph", False)
    sizes = runner_kw.pop("graph_batch_sizes", None)
    if device.type == "cuda":
        device = rank_device(rank, resolve_backend("auto", world_size))
    runner = ModelRunner.from_checkpoint(**runner_kw, device=device, tp_rank=rank,
                                         tp_size=world_size, with_draft=spec.enabled)
    logger.info("rank %d: shard loaded on %s", rank, device)
    worker = EagleWorker(runner, spec)
    if graphs:
        attach_graphs(runner, worker, sizes)
    while True:
        plan = queue.get()
        logger.debug("rank %d: plan %s, bs %d", rank, plan.kind, plan.batch_size)
        worker.execute(plan)
        runner.timer.collect()
        if plan.kind == "stop":
            runner.release_graphs()  # before the process exits and rank 0 drops the group
            return
