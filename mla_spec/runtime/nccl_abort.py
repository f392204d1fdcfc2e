"""Unblock a rank stuck in an NCCL collective whose peer died: abort the communicators.

Under NCCL a dead peer fails nothing: the survivors' kernels spin, their host threads stuck in
the CUDA driver (beyond ``KeyboardInterrupt`` and the collective timeout). ``ncclCommAbort`` sets
the flag the kernels poll, so the call returns and the next collective raises. :func:`abort_nccl`
tries, never raising, ``ProcessGroupNCCL.abort()``, ``ProcessGroup.abort()``,
``_abort_process_group()``, then ``shutdown``. The abort can block (a stream sync): the
``_bounded`` variants run it, and the later release of the groups, on a thread of their own.
"""

import logging
import threading

__all__ = ["abort_nccl", "abort_nccl_bounded", "release_aborted_group"]

log = logging.getLogger(__name__)


def _default_group():
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return None
        c10d = dist.distributed_c10d
        if hasattr(c10d, "_get_default_group"):
            return c10d._get_default_group()
        return getattr(dist.group, "WORLD", None)
    except Exception:  # noqa: BLE001 - never raise from the abort path
        return None


def _cuda_backend(pg):
    """The group's NCCL backend object, or None (gloo group, old torch, no CUDA)."""
    try:
        import torch
        return pg._get_backend(torch.device("cuda")) if hasattr(pg, "_get_backend") else None
    except Exception:  # noqa: BLE001 - a group without a CUDA backend
        return None


def _try(name: str, call) -> bool:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - try the next method
        log.warning("NCCL abort via %s failed: %s: %s", name, type(e).__name__, e)
        return False
    log.warning("NCCL communicators aborted via %s", name)
    return True


def abort_nccl() -> str | None:
    """Abort the NCCL communicators of the default group; never raises. Returns the name of the
    call that worked, or None. Idempotent in effect."""
    pg = _default_group()
    if pg is None:
        return None
    backend = _cuda_backend(pg)
    if hasattr(backend, "abort") and _try("ProcessGroupNCCL.abort", backend.abort):
        return "ProcessGroupNCCL.abort"
    if hasattr(pg, "abort") and _try("ProcessGroup.abort", pg.abort):
        return "ProcessGroup.abort"
    try:
        import torch.distributed as dist
        c10d_abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    except Exception:  # noqa: BLE001
        c10d_abort = None
    if c10d_abort is not None and _try("_abort_process_group", c10d_abort):
        return "_abort_process_group"
    for name in ("_shutdown", "shutdown"):
        if hasattr(backend, name) and _try(f"ProcessGroupNCCL.{name}", getattr(backend, name)):
            return f"ProcessGroupNCCL.{name}"
    log.error("could not abort the NCCL communicators (no method worked)")
    return None


def _bounded(fn, timeout_s: float, what: str):
    """Run ``fn()`` on a daemon thread; its result, or None if it is still running after
    ``timeout_s`` (the thread is left behind: it may be stuck in the driver)."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn()), name=what, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.error("%s still running after %.1f s; going on without it", what, timeout_s)
        return None
    return box[0] if box else None


def abort_nccl_bounded(timeout_s: float = 5.0) -> str | None:
    """:func:`abort_nccl` on a thread of its own, waited for at most ``timeout_s``."""
    return _bounded(abort_nccl, timeout_s, "nccl-abort")


def _release() -> str:
    import torch.distributed as dist
    if not dist.is_initialized():
        return "already released"
    c10d_abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if c10d_abort is not None:
        c10d_abort()  # aborts (again: a no-op on aborted communicators) and unregisters
        return "_abort_process_group"
    abort_nccl()  # then destroy skips the aborted communicators instead of flushing them
    dist.destroy_process_group()
    return "destroy_process_group"


def release_aborted_group(timeout_s: float = 10.0) -> bool:
    """Abort, then forget the process groups without waiting for any peer (after a failure and
    at every NCCL shutdown of rank 0; release CUDA graphs first). True when they are gone."""
    import torch.distributed as dist

    def run():
        try:
            return _release()
        except Exception as e:  # noqa: BLE001 - reported below
            log.warning("releasing the aborted process group: %s: %s", type(e).__name__, e)
            return None

    _bounded(run, timeout_s, "nccl-release")
    return not dist.is_initialized()
