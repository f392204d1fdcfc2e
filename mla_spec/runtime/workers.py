"""Process management for tensor parallelism: start the ranks, watch them, fail fast.

:func:`spawn_workers` starts ranks ``1..N-1`` and makes the caller rank 0 (``launch.launch``
runs every rank as a child). A worker reports through a pipe before its rendezvous, so one dying
at start is an error at once. A watchdog thread polls the children; between :meth:`Workers.arm`
and ``disarm`` it also names a hung rank (no progress counter moved for the timeout: a stopped
rank or the one behind) and kills the workers, so pending collectives fail. Under NCCL it aborts
the communicators (:mod:`~mla_spec.runtime.nccl_abort`), then interrupts the main thread. Workers
ignore SIGINT, leave with their parent, and ``os._exit`` after the multiprocessing finalizers.
"""

import logging
import os
import signal
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

from mla_spec.distributed import (
    default_timeout_s,
    init_distributed,
    rank_device,
    resolve_backend,
    track_progress,
)
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


# leaving a child process, stopping children (shared with mla_spec.runtime.launch)
def _exit_now(code: int) -> None:
    """Leave this child at once, after the multiprocessing finalizers (no teardown wait)."""
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


# spawn_workers: the caller is rank 0
def _child_signals() -> None:
    """A rank's child process: Ctrl-C is the parent's to handle (the terminal sends it to the
    whole group), and tqdm gets a thread lock, not a semaphore a killed rank would leak."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _worker_main(rank, world_size, backend, init_method, timeout_s, worker_fn, args,
                 started, progress) -> None:
    _child_signals()
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    _exit_when_orphaned(os.getppid())
    started.send(rank)  # up: rank 0 may start its (uninterruptible) rendezvous
    started.close()
    code = 0
    try:
        init_distributed(rank, world_size, backend=backend, init_method=init_method,
                         timeout_s=timeout_s)
        track_progress(progress, rank)
        worker_fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - rank 0's watchdog sees the exit code
        traceback.print_exc()
        code = 1
    _exit_now(code)


@dataclass
class Workers:
    """Ranks ``1..N-1`` in child processes, the caller rank 0, watched every 0.2 s (see the module
    docstring): a failure is recorded in :attr:`failure` (:attr:`aborted`: the NCCL abort call
    that worked). ``hard_exit_after_s``: kill the workers and ``os._exit(1)`` if :meth:`shutdown`
    has not come that long after a failure (CLIs only)."""

    world_size: int
    backend: str
    device: torch.device
    processes: list = field(default_factory=list)
    failure: str | None = None
    aborted: str | None = None
    hard_exit_after_s: float | None = None
    progress: Any = None  # shared int64 counters, one per rank
    _stop: threading.Event = field(default_factory=threading.Event)
    _limit_s: float | None = None
    _seen: list | None = None
    _since: float = 0.0

    def check(self) -> None:
        if self.failure is not None:
            raise RankFailedError(self.failure)

    def arm(self, timeout_s: float) -> None:
        """A step starts: fail once no rank makes progress for ``timeout_s``."""
        self._seen, self._since, self._limit_s = None, time.monotonic(), timeout_s

    def disarm(self) -> None:
        self._limit_s = None

    def blame(self, err: BaseException) -> str | None:
        """Rank 0's step raised ``err``: the rank that died or hung (waited for up to 2 s), or None
        for rank 0's own error (then recorded as the failure)."""
        deadline = time.monotonic() + (2.0 if isinstance(err, Exception) else 0.0)
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.failure is not None:
            return self.failure
        self.failure = f"rank 0 left a step ({type(err).__name__})"
        return None

    def _hung(self) -> str | None:
        limit, now = self._limit_s, time.monotonic()
        if limit is None or self.progress is None:
            return None
        seen = list(self.progress)
        if seen != self._seen:
            self._seen, self._since = seen, now
            return None
        if now - self._since < limit:
            return None
        stopped = [r for r, p in enumerate(self.processes, 1) if _proc_state(p.pid) in ("T", "t")]
        behind = [r for r, c in enumerate(seen) if c < max(seen)]
        if stopped:
            who = f"{_ranks(stopped)} stopped (process state T: SIGSTOP or a debugger)"
        elif behind:
            who = f"{_ranks(behind)} behind the others (progress per rank {seen})"
        else:
            who = "no rank is stopped or behind (all wait in one collective)"
        return f"{who}: no rank made progress for {now - self._since:.0f} s (timeout_s {limit:g})"

    def _watch(self, interrupt_main: bool) -> None:
        import _thread
        while not self._stop.wait(0.2):
            dead = [f"rank {r} died (exit code {p.exitcode})"
                    for r, p in enumerate(self.processes, 1)
                    if not p.is_alive() and p.exitcode not in (0, None)]
            hung = None if dead else self._hung()
            if dead or hung:
                self.failure = dead[0] if dead else hung
                log.error("%s; stopping rank 0", self.failure)
                for p in self.processes if hung else ():
                    p.kill()  # SIGKILL ends a stopped rank too: pending collectives fail now
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
        """Stop the watchdog, join the workers for up to ``timeout_s`` (1 s after a failure), kill
        stragglers and release the group (under NCCL: aborted locally, not waiting for peers)."""
        self._stop.set()  # the watchdog stops: look for dead workers here too
        track_progress(None)
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


def spawn_workers(world_size: int, worker_fn: Callable[..., Any], args: Sequence[Any] = (), *,
                  backend: str = "auto", timeout_s: float | None = None,
                  interrupt_main: bool = True, hard_exit_after_s: float | None = None) -> Workers:
    """Start ``worker_fn(rank, world_size, *args)`` on ranks 1..N-1 and make this process rank 0
    (group initialized); call ``.shutdown()`` on the returned :class:`Workers` when done.
    ``hard_exit_after_s`` None reads ``MLA_SPEC_HARD_EXIT_S`` (unset or empty: never)."""
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
                      hard_exit_after_s=hard_exit_after_s,
                      progress=ctx.RawArray("q", world_size))
    started = []  # read ends: a worker sends one message once it is up, before its rendezvous
    try:
        for r in range(1, world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker_main, daemon=True, args=(
                r, world_size, backend, init_method, timeout_s, worker_fn, tuple(args), send,
                workers.progress))
            p.start()
            send.close()  # the child holds the write end: EOF here once it exits
            workers.processes.append(p)
            started.append(recv)
        _wait_started(workers.processes, started,
                      default_timeout_s(backend) if timeout_s is None else timeout_s)
        init_distributed(0, world_size, backend=backend, init_method=init_method,
                         timeout_s=timeout_s)
        track_progress(workers.progress, 0)
    except BaseException:
        workers.shutdown(timeout_s=0.0)  # the others wait in the rendezvous: terminate them
        raise
    finally:
        for c in started:
            c.close()
    threading.Thread(target=workers._watch, args=(interrupt_main,), daemon=True).start()
    return workers


def _wait_started(procs: list, started: list, timeout_s: float) -> None:
    """Wait until every worker is up; raise :class:`RankFailedError` as soon as one dies first
    (rank 0's rendezvous blocks uninterruptibly in C++, so it starts only after this)."""
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


def _proc_state(pid: int | None) -> str:
    """The state letter of ``/proc/PID/stat`` (``T``: stopped); "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {ranks} are"
