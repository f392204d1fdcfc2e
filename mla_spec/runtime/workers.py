"""Process management for tensor parallelism: start the ranks, watch them, fail fast.

Why a module of its own: the collectives of :mod:`mla_spec.distributed` only work once every
rank is a live process in one group, and the hard part of that is not the group but the
processes: starting them, handing results back, and noticing at once when one dies, instead of
leaving the others blocked in a collective until its timeout
(``mla_spec.distributed.default_timeout_s``).

Two ways to start ranks. :func:`mla_spec.runtime.launch.launch` runs a function on
``world_size`` fresh processes and returns their results (every rank a child; see that module).
:func:`spawn_workers` (here) starts ranks ``1..N-1`` as processes and makes the *calling* process
rank 0, so a notebook or the :class:`~mla_spec.engine.Engine` drives rank 0 in-process. Each
worker says it is up through a pipe before its rendezvous, and rank 0 joins the rendezvous
(uninterruptible C++) only once all have: one that dies while starting is an error at once, not
after the timeout. A :class:`Workers` watchdog thread then polls the children.

Under NCCL a dead peer does not fail the survivors' collectives: their kernels spin and the host
thread waiting on them is stuck in a CUDA sync, out of reach of ``KeyboardInterrupt``. So the
watchdog first aborts the NCCL communicators (:mod:`mla_spec.runtime.nccl_abort`), which returns
the blocked call, then interrupts the main thread. A CLI or script may also ask for a last resort:
``hard_exit_after_s`` (or ``MLA_SPEC_HARD_EXIT_S`` in the environment) kills the workers and
leaves the process with exit code 1 if rank 0 has not shut the workers down by then. Every child
also leaves on its own once its parent is gone (no orphan keeps a GPU busy).

Workers leave with ``os._exit`` (never blocking in process-group teardown) after running the
multiprocessing finalizers, so semaphores they created (tqdm's lock, queues) are released.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mla_spec.distributed import default_timeout_s, init_distributed, rank_device, resolve_backend
from mla_spec.runtime.nccl_abort import abort_nccl_bounded, release_aborted_group

__all__ = ["spawn_workers", "Workers", "RankFailedError", "HARD_EXIT_ENV"]

log = logging.getLogger(__name__)

#: Environment variable read by :func:`spawn_workers` when ``hard_exit_after_s`` is not given.
HARD_EXIT_ENV = "MLA_SPEC_HARD_EXIT_S"


class RankFailedError(RuntimeError):
    """A rank died, raised, or the run timed out (the message names the rank)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# leaving a child process, stopping children (shared with mla_spec.runtime.launch)
# ---------------------------------------------------------------------------------------------
def _exit_now(code: int) -> None:
    """Leave this child process at once, without waiting for peers in process-group teardown
    (a slow or dead peer must not hang us). The multiprocessing finalizers run first, as at a
    normal exit, so semaphores created here (tqdm's lock, queues) are unlinked instead of being
    reported as leaked by the resource tracker at shutdown."""
    import multiprocessing.util as mp_util

    try:
        mp_util._exit_function()  # what multiprocessing runs after a process target returns
    finally:
        os._exit(code)


def _exit_when_orphaned(parent_pid: int, poll_s: float = 0.5) -> None:
    """Leave this child (exit code 1) once its parent is gone: a rank-0 process killed hard
    (SIGKILL, a time limit) must not leave ranks spinning in NCCL kernels on their GPUs."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _stop_processes(procs, timeout_s: float) -> None:
    """Terminate the live ones, wait up to ``timeout_s`` in all, then kill the stragglers."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=1)


# ---------------------------------------------------------------------------------------------
# spawn_workers: the caller is rank 0
# ---------------------------------------------------------------------------------------------
def _worker_main(rank, world_size, backend, init_method, timeout_s, worker_fn, args,
                 started) -> None:
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    _exit_when_orphaned(os.getppid())
    started.send(rank)  # up: rank 0 may start its (uninterruptible) rendezvous
    started.close()
    code = 0
    try:
        init_distributed(rank, world_size, backend=backend, init_method=init_method,
                         timeout_s=timeout_s)
        worker_fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - rank 0's watchdog sees the exit code
        traceback.print_exc()
        code = 1
    _exit_now(code)


@dataclass
class Workers:
    """Ranks ``1..N-1`` running in child processes; the caller is rank 0.

    A watchdog thread polls the children every 0.2 s. When one dies with a non-zero exit code
    it records :attr:`failure` and logs it; under NCCL it aborts the communicators (rank 0 may be
    blocked in a CUDA sync on a collective that cannot complete: the abort returns it;
    :attr:`aborted` names the call that did it); then (``interrupt_main``) it raises
    ``KeyboardInterrupt`` in the main thread. With ``hard_exit_after_s`` set, a rank 0 that has
    not called :meth:`shutdown` that long after the failure is ended: workers killed, then
    ``os._exit(1)`` (for CLIs and scripts only; a notebook keeps its kernel).
    Call :meth:`check` at safe points to turn a failure into :class:`RankFailedError`.
    """

    world_size: int
    backend: str
    device: torch.device
    processes: list = field(default_factory=list)
    failure: str | None = None
    aborted: str | None = None
    hard_exit_after_s: float | None = None
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
                    self._on_failure(interrupt_main, _thread.interrupt_main)
                    return

    def _on_failure(self, interrupt_main: bool, interrupt) -> None:
        if self.backend == "nccl":
            self.aborted = abort_nccl_bounded(timeout_s=5.0)
        if interrupt_main:
            interrupt()
        if self.hard_exit_after_s is not None and not self._stop.wait(self.hard_exit_after_s):
            log.error("%s and rank 0 is still not unblocked %.0f s later: killing the workers "
                      "and exiting (hard_exit_after_s)", self.failure, self.hard_exit_after_s)
            for p in self.processes:
                if p.is_alive():
                    p.kill()
            for h in logging.getLogger().handlers:
                h.flush()
            os._exit(1)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the watchdog, join the workers for up to ``timeout_s`` in all (1 s after a
        failure: survivors may be stuck in a collective), terminate then kill the stragglers,
        and release the group (under NCCL: aborted locally, without waiting for any peer).
        """
        self._stop.set()  # the watchdog stops: look for dead workers here too
        failed = self.failure is not None or any(
            not p.is_alive() and p.exitcode not in (0, None) for p in self.processes)
        deadline = time.monotonic() + (min(timeout_s, 1.0) if failed else timeout_s)
        for p in self.processes:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        _stop_processes(self.processes, timeout_s=5.0)
        if not dist.is_initialized():
            return
        if self.backend == "nccl":
            # The workers left without a collective teardown (os._exit), and a peer may have
            # died: destroy_process_group would wait for them (on the H200s it hung after a
            # run with CUDA graphs). Abort the communicators locally and forget the groups.
            if not release_aborted_group(timeout_s=10.0):
                log.error("the NCCL process group could not be released")
        else:
            dist.destroy_process_group()


def spawn_workers(
    world_size: int,
    worker_fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    backend: str = "auto",
    timeout_s: float | None = None,
    interrupt_main: bool = True,
    hard_exit_after_s: float | None = None,
) -> Workers:
    """Start ``worker_fn(rank, world_size, *args)`` on ranks 1..N-1; make this process rank 0.

    Returns a :class:`Workers` handle (``.device`` is rank 0's device). Rank 0's process group is
    initialized on return; call ``workers.shutdown()`` when done.

    ``hard_exit_after_s``: for CLIs and scripts only, see :class:`Workers`. None (the default)
    reads ``MLA_SPEC_HARD_EXIT_S`` from the environment; unset or empty means never.
    """
    if hard_exit_after_s is None and os.environ.get(HARD_EXIT_ENV, "").strip():
        hard_exit_after_s = float(os.environ[HARD_EXIT_ENV])
    if world_size < 1:
        raise ValueError(f"world_size {world_size}: must be >= 1")
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; shut it down first")
    backend = resolve_backend(backend, world_size)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    workers = Workers(world_size, backend, rank_device(0, backend),
                      hard_exit_after_s=hard_exit_after_s)
    started = []  # read ends: a worker sends one message once it is up, before its rendezvous
    try:
        for r in range(1, world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker_main,
                args=(r, world_size, backend, init_method, timeout_s, worker_fn, tuple(args),
                      send),
                daemon=True,
            )
            p.start()
            send.close()  # the child holds the write end: EOF here once it exits
            workers.processes.append(p)
            started.append(recv)
        _wait_started(workers.processes, started, default_timeout_s(backend)
                      if timeout_s is None else timeout_s)
        init_distributed(0, world_size, backend=backend, init_method=init_method,
                         timeout_s=timeout_s)
    except BaseException:
        workers.shutdown(timeout_s=0.0)  # the others wait in the rendezvous: terminate them
        raise
    finally:
        for c in started:
            c.close()
    threading.Thread(target=workers._watch, args=(interrupt_main,), daemon=True).start()
    return workers


def _wait_started(procs: list, started: list, timeout_s: float) -> None:
    """Wait until every worker is up (imports and arguments unpickled); raise
    :class:`RankFailedError` as soon as one dies first.

    Rank 0's rendezvous blocks in C++ and cannot be interrupted, so it starts only once every
    worker is about to join it: a worker that dies while starting is an error within a fraction
    of a second instead of after the rendezvous timeout.
    """
    deadline = time.monotonic() + timeout_s
    waiting = dict(enumerate(started, start=1))
    while waiting:
        for r, conn in list(waiting.items()):
            try:
                if conn.poll(0.05):
                    conn.recv()
                    del waiting[r]
                    continue
            except (EOFError, OSError):
                pass  # it exited before saying it was up
            else:
                if procs[r - 1].is_alive():
                    continue
            procs[r - 1].join(timeout=1)
            raise RankFailedError(f"rank {r} died (exit code {procs[r - 1].exitcode}) while "
                                  "starting, before joining the process group")
        if waiting and time.monotonic() > deadline:
            raise RankFailedError(f"ranks {sorted(waiting)} not up after {timeout_s:.0f} s")
