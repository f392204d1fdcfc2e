"""Device helpers: pick the GPU when there is one, and say whether Triton can run here.

Two environment variables decide how Triton kernels run on a machine without a CUDA device:

- ``TRITON_INTERPRET`` (Triton's own): when "1", every ``@triton.jit`` decorated afterwards runs in
  Triton's CPU interpreter. Triton reads it when a decorator runs, not when the kernel launches,
  and ``import triton`` decorates Triton's own helpers: it must be set before ``import triton``.
  ``import mla_spec`` sets it to "1" by itself when no CUDA device is available, the variable is
  unset and triton is not imported yet (``interpret_triton_without_gpu``), so the package's
  kernels can run on CPU tensors with no setup; set it yourself ("1", or "0" for compiled
  kernels) to override.
- ``MLA_SPEC_TRITON_ON_CPU``: whether the dispatching entry points (``use_triton``: the NVFP4
  GEMMs, the fused MoE, the KV store, the pad / unpad, ...) take the Triton kernel or its torch
  twin for a CPU tensor. Unset means on, as when ``TRITON_INTERPRET=1`` is asked for (tests and
  kernel notebooks); when ``import mla_spec`` switched the interpreter on by itself it sets this
  to "0", so serving on CPU keeps the torch twins (``OMP_NUM_THREADS=1 mla-spec demo --tp 1
  --num-questions 4`` on a 2-core CPU, 2026-12-01: 190 tokens/s with the twins, 18 with the
  kernels in the interpreter). Kernels called directly run in the interpreter either way.

Both variables pass on to spawned worker ranks through the environment.
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
    "false" and "False" are off, anything else on (the kernels' ``MLA_SPEC_*`` switches, read
    once at import)."""
    return os.environ.get(name, "1" if default else "0") not in ("0", "", "false", "False")


def interpret_triton_without_gpu() -> bool:
    """Switch Triton to its CPU interpreter where no CUDA device is available; returns
    ``triton_interpreting()``.

    Sets ``TRITON_INTERPRET=1`` when the variable is unset, ``torch.cuda.is_available()`` is False
    and ``triton`` is not imported yet (then also ``MLA_SPEC_TRITON_ON_CPU=0`` unless set: see the
    module docstring); a value the user set is left alone. ``import mla_spec`` calls this in its
    first lines, before anything imports ``triton``, and every module with a kernel lives in the
    package, so importing one imports ``mla_spec`` first.

    Triton reads the variable when each ``@triton.jit`` decorator runs, and ``import triton``
    decorates Triton's own helpers (``tl.sum``, ``tl.max``, ``tl.cdiv``, ... in
    ``triton.language.standard``): it must be set before ``import triton``, not only before a
    kernel's decoration, or interpreted kernels fail in those helpers ("Cannot call @triton.jit'd
    outside of the scope of a kernel"). So when ``triton`` was imported before ``mla_spec`` with
    the variable unset, this warns and sets nothing: the dispatching entry points use their torch
    twins, and a kernel called directly fails ("0 active drivers"). Set ``TRITON_INTERPRET=1``
    before importing triton, or import ``mla_spec`` first.
    """
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
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``, set by the user
    or by ``import mla_spec`` on a machine without a CUDA device)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_on_cpu() -> bool:
    """Whether the dispatching entry points take the Triton kernel for a CPU tensor: the
    interpreter is on and ``MLA_SPEC_TRITON_ON_CPU`` is not off (module docstring)."""
    return triton_interpreting() and env_flag(TRITON_ON_CPU, True)


def use_triton(t: torch.Tensor) -> bool:
    """Whether a dispatching entry point takes its Triton kernel for ``t``: on CUDA always, on CPU
    when ``triton_on_cpu()`` (the interpreter, asked for), else the torch twin."""
    return t.is_cuda or (t.device.type == "cpu" and triton_on_cpu())


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
