"""Cached direct relaunch of a compiled ``@triton.jit`` kernel (a few µs per eager call), keyed by
all Triton specializes on; normal launches with a hook set, after a failed direct call and in the
interpreter.
"""

from __future__ import annotations

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - Triton < 3.4
    _knobs = None

__all__ = ["TritonLauncher", "hooks_unset"]


class TritonLauncher:
    """Launch a ``@triton.jit`` kernel ``fn``; on CUDA relaunch its binary directly."""

    def __init__(self, fn, unspecialized: tuple[int, ...] = ()):
        self.fn = fn
        self.unspecialized = frozenset(unspecialized)
        self.binaries: dict = {}
        self.direct = True
        self.interp_keys: set = set()  # specializations launched under the interpreter

    def __call__(self, grid: int | tuple, key: tuple, tensors: tuple, ptrs: tuple,
                 scalars: tuple, num_warps: int, options: dict | None = None) -> None:
        """Launch ``fn[grid](*tensors, *scalars)``; ``key`` names the specialization and options."""
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

    def launch(self, grid: int | tuple, tensors: tuple, scalars: tuple, constexprs: tuple,
               num_warps: int, options: dict | None = None) -> None:
        """``fn[grid](*tensors, *scalars, *constexprs)`` (the kernel's argument order), keyed by
        what Triton specializes on: each tensor's dtype and 16-byte alignment, each int scalar's
        ``== 1`` and ``% 16 == 0``, the constexpr values and the launch options."""
        self(grid, self._key(tensors, scalars, constexprs, num_warps, options), tensors,
             tuple(t.data_ptr() for t in tensors), scalars + constexprs, num_warps, options)

    @staticmethod
    def _key(tensors, scalars, constexprs, num_warps, options) -> tuple:
        return (tuple((t.dtype, t.data_ptr() & 15 == 0) for t in tensors),
                tuple((a == 1, a % 16 == 0) if type(a) is int else type(a) for a in scalars),
                constexprs, num_warps, tuple(options.items()) if options else ())

    def relauncher(self, grid: int | tuple, tensors: tuple, scalars: tuple, constexprs: tuple,
                   num_warps: int, options: dict | None = None):
        """After :meth:`launch` with these arguments: ``go(ptrs, scalars) -> bool`` relaunching
        its binary with other pointers and scalars of the same specialization (the caller's
        promise: same dtypes, alignment and scalar classes) and no key work; False where only
        the normal launch can run it (then call :meth:`launch`). None without a direct binary."""
        entry = self.binaries.get(self._key(tensors, scalars, constexprs, num_warps, options))
        if entry is None or not self.direct:
            return None
        run, function, metadata = entry
        gx, gy, gz = (*((grid,) if isinstance(grid, int) else tuple(grid)), 1, 1)[:3]
        dev = tensors[0].get_device()
        stream = torch._C._cuda_getCurrentRawStream

        def go(ptrs: tuple, scal: tuple) -> bool:
            if not (self.direct and hooks_unset()):
                return False
            try:
                run(gx, gy, gz, stream(dev), function, metadata, None, None, None, *ptrs, *scal,
                    *constexprs)
            except Exception:  # noqa: BLE001 - as in __call__: the normal launch from now on
                self.direct = False
                return False
            return True
        return go

    def compile_count(self) -> int:
        """Binaries in Triton's JIT cache for ``fn`` (interpreter: specializations launched)."""
        caches = getattr(self.fn, "device_caches", None)
        if caches is None:  # InterpretedFunction: count the specializations it ran
            return len(self.interp_keys)
        return sum(len(entry[0]) for entry in caches.values())


def hooks_unset() -> bool:
    """No launch hook is installed (Triton >= 3.4: empty ``HookChain`` objects)."""
    if _knobs is None:  # pragma: no cover - Triton without knobs: always the normal launch
        return False
    enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    return not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave)
