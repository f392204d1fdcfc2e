"""Device helpers: pick the GPU when there is one, and say whether Triton can run here."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["cuda_capability", "default_device", "env_flag", "sm_count", "triton_interpreting",
           "use_triton"]


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def env_flag(name: str, default: bool) -> bool:
    """The on / off switch in environment variable ``name``: unset gives ``default``; "0", "",
    "false" and "False" are off, anything else on (the kernels' ``MLA_SPEC_*`` switches, read
    once at import)."""
    return os.environ.get(name, "1" if default else "0") not in ("0", "", "false", "False")


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``'s device: CUDA, or CPU under the interpreter."""
    return t.is_cuda or (t.device.type == "cpu" and triton_interpreting())


def cuda_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, or None on CPU. Cached per device: the attention path
    asks on every eager call, and ``torch.cuda.get_device_capability`` costs ~10 µs of host
    time."""
    dev = torch.device(device) if device is not None else default_device()
    if dev.type != "cuda":
        return None
    return _capability(_index(dev))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device, as above)."""
    return _sms(_index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
