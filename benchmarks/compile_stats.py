"""How many binaries every ``@triton.jit`` kernel of ``mla_spec`` holds: a recompile detector.

Triton compiles one binary per specialization of a kernel's arguments: every ``tl.constexpr``
value, and for plain integers whether they equal 1 or are multiples of 16 (unless the argument
is listed in ``do_not_specialize``). An integer that follows the batch (a token count, a split
count, a partial buffer's stride) can therefore trigger a new compile -- about a second for the
576-wide MLA kernels -- in the middle of serving, long after warm-up. Benchmarks snapshot the
counts around their timed region and report any growth (``new_compiles``).
"""

from __future__ import annotations

import sys

__all__ = ["kernel_binaries", "kernel_keys", "new_compiles"]


def _jit_caches() -> dict[str, list[dict]]:
    """``{"module.kernel": [per-device binary cache, ...]}`` for every Triton kernel of the
    loaded ``mla_spec`` modules (an interpreted kernel keeps no cache: an empty list)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton is a dependency
        return {}
    out: dict[str, list[dict]] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("mla_spec") or mod is None:
            continue
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, (JITFunction, InterpretedFunction)):
                caches = getattr(obj, "device_caches", None) or {}
                out[f"{mod_name}.{name}"] = [entry[0] for entry in caches.values()]
    return out


def kernel_binaries() -> dict[str, int]:
    """``{"module.kernel": binaries}`` for every Triton kernel in the loaded ``mla_spec`` modules.

    On a GPU the count comes from Triton's JIT cache (``device_caches``); under the interpreter
    kernels keep no cache and count as 0.
    """
    return {name: sum(len(c) for c in caches) for name, caches in _jit_caches().items()}


def new_compiles(before: dict[str, int], after: dict[str, int] | None = None) -> dict[str, int]:
    """Kernels whose binary count grew between two ``kernel_binaries()`` snapshots."""
    after = kernel_binaries() if after is None else after
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


def kernel_keys() -> dict[str, set[str]]:
    """``{"module.kernel": {specialization key, ...}}``: what each binary was compiled for (the
    key strings name the constexprs, dtypes and the integer / pointer specializations), so two
    snapshots show *why* a kernel compiled again."""
    return {name: {str(k) for c in caches for k in c} for name, caches in _jit_caches().items()}
