"""Device helpers: pick the GPU when there is one, and say whether Triton can run here.

``TRITON_INTERPRET=1`` runs Triton in its CPU interpreter (set before ``import triton``;
``import mla_spec`` sets it when there is no CUDA device). ``MLA_SPEC_TRITON_ON_CPU`` decides
whether dispatching entry points (:func:`use_triton`) take the Triton kernel or its torch twin
for a CPU tensor: unset means on; "0" (set with the automatic interpreter) keeps the faster
torch twins. Both are passed on to worker ranks.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

import torch

__all__ = ["TRITON_ON_CPU", "cuda_capability", "default_device", "env_flag",
           "interpret_triton_without_gpu", "sm_count", "triton_interpreting", "triton_on_cpu",
           "use_triton"]

TRITON_ON_CPU = "MLA_SPEC_TRITON_ON_CPU"


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def env_flag(name: str, default: bool) -> bool:
    """The on / off switch in environment variable ``name``: unset gives ``default``; "0", "",
    "false" and "False" are off, anything else on."""
    return os.environ.get(name, "1" if default else "0") not in ("0", "", "false", "False")


def interpret_triton_without_gpu() -> bool:
    """Switch Triton to its CPU interpreter where there is no CUDA device; returns
    ``triton_interpreting()``. If ``triton`` was imported first this only warns."""
    if "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        return triton_interpreting()
    if "triton" in sys.modules:
        warnings.warn("no CUDA device and TRITON_INTERPRET is unset, but triton was imported "
                      "before mla_spec, so its own @triton.jit helpers (tl.sum, tl.max, ...) are "
                      "built for a GPU: mla_spec leaves the interpreter off and its Triton kernels "
                      "cannot run here (the torch twins still can). Set TRITON_INTERPRET=1 before "
                      "importing triton, or import mla_spec first.", RuntimeWarning, stacklevel=2)
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault(TRITON_ON_CPU, "0")
    return True


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_on_cpu() -> bool:
    """Whether the dispatching entry points take the Triton kernel for a CPU tensor: the
    interpreter is on and ``MLA_SPEC_TRITON_ON_CPU`` is not off."""
    return triton_interpreting() and env_flag(TRITON_ON_CPU, True)


def use_triton(t: torch.Tensor) -> bool:
    """Whether a dispatching entry point takes its Triton kernel for ``t`` (else its torch twin):
    on CUDA always, on CPU when ``triton_on_cpu()``."""
    return t.is_cuda or (t.device.type == "cpu" and triton_on_cpu())


def cuda_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, or None on CPU; cached (the attention path asks on
    every eager call)."""
    dev = torch.device(device) if device is not None else default_device()
    return _capability(_index(dev)) if dev.type == "cuda" else None


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
