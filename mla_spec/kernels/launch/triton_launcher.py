"""Cached direct relaunch of a compiled ``@triton.jit`` kernel: a few microseconds per eager call.

Why: a normal ``kernel[grid](*args)`` call re-derives Triton's specialization key in Python
(dtypes, which ints are 1 or multiples of 16, pointer alignment, constexprs) on every launch,
tens of microseconds that dominate tiny copy kernels such as the draft-extend pad / unpad, which
run once per layer and step. :class:`TritonLauncher` makes the first launch of a specialization
the normal way, keeps the compiled binary under a key the caller builds from everything Triton
specializes on (dtypes, exact strides, pointer alignment mod 16, constexprs), and relaunches that
binary directly on the current CUDA stream afterwards. Because the key covers the whole
specialization, a binary is never reused outside the inputs it was compiled for (the hazard
SGLang's removed kernel cache had).

The direct call passes the tensors' data pointers as ints: Triton's generated launcher then
skips the ``cuPointerGetAttribute`` check it makes for every tensor argument (a driver call each).

Fallbacks: the normal launch whenever a launch hook is set (profilers, :func:`hooks_unset`), and
for good once a direct call fails (an unexpected Triton ABI). Under the interpreter (CPU) it
always launches normally and records the specializations Triton would have compiled, so
:meth:`TritonLauncher.compile_count` means the same on CPU as on a GPU.
"""

from __future__ import annotations

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - Triton < 3.4
    _knobs = None

__all__ = ["TritonLauncher", "hooks_unset"]


class TritonLauncher:
    """Launch one ``@triton.jit`` kernel on a 1-3-d grid; on CUDA relaunch its compiled binary.

    Parameters
    ----------
    fn : the ``@triton.jit`` kernel (an ``InterpretedFunction`` under ``TRITON_INTERPRET=1``).
    unspecialized : positions of the arguments marked ``do_not_specialize`` (left out of the
        interpreter's specialization record).
    """

    def __init__(self, fn, unspecialized: tuple[int, ...] = ()):
        self.fn = fn
        self.unspecialized = frozenset(unspecialized)
        self.binaries: dict = {}
        self.direct = True
        self.interp_keys: set = set()  # specializations launched under the interpreter

    def __call__(self, grid: int | tuple, key: tuple, tensors: tuple, ptrs: tuple,
                 scalars: tuple, num_warps: int, options: dict | None = None) -> None:
        """Launch ``fn[grid](*tensors, *scalars)`` (``grid``: an int or up to 3 ints; CUDA
        allows 2**31 - 1 programs on axis 0 and 65535 on axes 1 and 2). ``key`` must identify
        Triton's specialization of the arguments; ``ptrs`` are the tensors' ``data_ptr()``
        values, passed as plain ints on the direct path (Triton's launcher then skips a
        ``cuPointerGetAttribute`` driver call per tensor). ``options``: compile options of the
        normal launch (e.g. ``launch_pdl``), which ``key`` must then cover too."""
        grid = (grid,) if isinstance(grid, int) else tuple(grid)
        entry = self.binaries.get(key)
        if entry is not None and self.direct and hooks_unset():
            try:
                run, function, metadata = entry
                gx, gy, gz = (*grid, 1, 1)[:3]
                run(gx, gy, gz, torch._C._cuda_getCurrentRawStream(tensors[0].get_device()),
                    function, metadata, None, None, None, *ptrs, *scalars)
                return
            except Exception:  # noqa: BLE001 - an unexpected Triton ABI: use the normal launch
                self.direct = False
        args = (*tensors, *scalars)
        if not tensors[0].is_cuda:  # the interpreter: record what Triton would key on
            self.interp_keys.add(tuple(
                (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                else (a == 1, a % 16 == 0) if isinstance(a, int) and not isinstance(a, bool)
                else a for i, a in enumerate(args) if i not in self.unspecialized))
            self.fn[grid](*args, num_warps=num_warps)
            return
        kernel = self.fn[grid](*args, num_warps=num_warps, **(options or {}))
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        if len(self.binaries) > 256:
            self.binaries.clear()
        self.binaries[key] = (kernel.run, kernel.function, kernel.packed_metadata)

    def compile_count(self) -> int:
        """Binaries in Triton's JIT cache for ``fn`` (interpreter: specializations launched)."""
        caches = getattr(self.fn, "device_caches", None)
        if caches is None:  # InterpretedFunction: count the specializations it ran
            return len(self.interp_keys)
        return sum(len(entry[0]) for entry in caches.values())


def hooks_unset() -> bool:
    """No launch hook is installed (Triton >= 3.4 keeps them as empty ``HookChain`` objects,
    older versions as None); the direct path then passes None and skips launch metadata."""
    if _knobs is None:  # pragma: no cover - Triton without knobs: always the normal launch
        return False
    enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    return not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave)
