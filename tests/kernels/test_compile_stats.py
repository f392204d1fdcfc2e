"""Recompile guards: batch-dependent integers of the serving kernels stay unspecialized; and the
benchmarks' binary counter (``benchmarks/compile_stats.py``) that reports a compile mid-run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from mla_spec.kernels.mla import combine, triton_gather, triton_paged, triton_vsplit
from mla_spec.kernels.nvfp4 import gemv as nvfp4_gemv
from mla_spec.kernels.nvfp4 import moe_gemv as nvfp4_moe_gemv


def _compile_stats():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "compile_stats.py"
    spec = importlib.util.spec_from_file_location("compile_stats", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compile_stats"] = mod
    spec.loader.exec_module(mod)
    return mod


def _unspecialized(kernel) -> set[str]:
    """``do_not_specialize`` of a JITFunction, or of an InterpretedFunction (kept in kwargs)."""
    dns = getattr(kernel, "do_not_specialize", None)
    if dns is None:
        dns = getattr(kernel, "kwargs", {}).get("do_not_specialize", ())
    return {kernel.arg_names[i] if isinstance(i, int) else i for i in dns}


@pytest.mark.parametrize("kernel, names", [
    # stride_ps (rows x Dv, Dv = 512) is always a multiple of 16: it stays specialized, since
    # unspecializing it cost ptxas 236 bytes of spills in the split kernels (sm_90, offline)
    (triton_gather._mla_fwd_kernel, {"H", "q_len_fixed", "num_splits", "stride_lse_s"}),
    (triton_paged._mla_paged_kernel, {"H", "q_len_fixed", "num_splits", "stride_lse_s"}),
    (triton_paged._mla_swapab_kernel, {"H", "q_len_fixed", "num_splits", "stride_lse_s"}),
    (triton_vsplit._mla_vsplit_kernel, {"H", "num_splits", "stride_lse_s"}),
    (combine._combine_kernel, {"num_splits", "H", "stride_ls"}),
    (nvfp4_gemv._nvfp4_gemv_kernel, {"M"}),
    (nvfp4_moe_gemv._moe_gemv_kernel, {"R"}),
])
def test_batch_dependent_ints_are_not_specialized(kernel, names):
    missing = names - _unspecialized(kernel)
    assert not missing, f"{kernel.fn.__name__}: {sorted(missing)} would recompile per batch"


def test_kernel_binaries_lists_the_kernels():
    cs = _compile_stats()
    counts = cs.kernel_binaries()
    assert "mla_spec.kernels.mla.triton_gather._mla_fwd_kernel" in counts
    assert all(isinstance(n, int) and n >= 0 for n in counts.values())
    assert cs.new_compiles(counts, counts) == {}
    assert cs.new_compiles({"a": 1}, {"a": 3, "b": 0}) == {"a": 2}


def test_kernel_keys_lists_the_kernels():
    keys = _compile_stats().kernel_keys()
    assert all(isinstance(v, set) for v in keys.values())
