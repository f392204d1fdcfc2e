"""Registers, spills and shared memory of the paged Triton MLA kernels on sm_90, without a GPU
(``benchmarks/sweep_mla.py --sm90-offline``).

Why: the paged kernels' speed on the H200 hinges on register pressure (the 255-register cap and
spills, see docs/bench_mla.md), and ptxas reports it at compile time. Triton ships ptxas, so
``triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90,
32))`` builds the exact sm_90a binary on a CPU-only machine. The signature mirrors a real launch
(bf16 queries, bf16 / e4m3 cache, int64 request indices) and ``attrs`` marks pointers and
16-divisible integers as Triton's launcher specializes them (without this, loads are not
vectorized and the counts are far off). Numbers match the GPU when the Triton version matches
(3.6 on the H200; e.g. ``pip install --target /tmp/t36 triton==3.6.0`` and ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

__all__ = ["sm90_resources"]

_PTR = {"R2T": "*i32", "RPI": "*i64", "KVL": "*i32", "QO": "*i32", "Lse": "*fp32",
        "PLse": "*fp32", "Qn": "*bf16", "Qp": "*bf16"}


def _signature(kern, cfg, fp8: bool, split: bool, const: dict) -> dict:
    part = "*bf16" if cfg.part_bf16 else "*fp32"
    sig = {}
    for a in kern.arg_names:
        if a in const:
            sig[a] = "constexpr"
        elif a == "KV":
            sig[a] = "*fp8e4nv" if fp8 else "*bf16"
        elif a == "Part" or (a == "Out" and split and not cfg.sibling_kernel):
            sig[a] = part
        elif a == "Out":
            sig[a] = "*bf16"
        else:
            sig[a] = _PTR.get(a) or ("fp32" if a in ("qk_scale_log2", "v_scale") else "i32")
    return sig


def sm90_resources(cfg, fp8: bool, split: bool, dv: int = 512, dpe: int = 64,
                   gdc: bool = True) -> dict:
    """Compile one ``PagedConfig`` variant for sm_90a (no GPU needed); ``gdc``: as launched
    with PDL (the default on Hopper: the L2 prefetch and wait of ``kernels.launch.pdl``).

    Returns
    -------
    dict with ``regs`` (per thread), ``spill_st`` / ``spill_ld`` (bytes, from ``ptxas -v``) and
    ``smem`` (bytes of dynamic shared memory).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mla_spec.kernels.mla.triton_paged import _mla_paged_kernel, _mla_swapab_kernel
    from mla_spec.kernels.mla.triton_vsplit import _mla_vsplit_kernel

    kern = (_mla_swapab_kernel if cfg.swap else _mla_vsplit_kernel if cfg.sibling_kernel
            else _mla_paged_kernel)
    const = dict(DV=dv, DPE=dpe, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, RAGGED=False,
                 SPLIT=split, WRITE_LSE=False, DOT_F32=False, F16=fp8, TMA=cfg.tma,
                 USE_GDC=gdc, L2PF=gdc)
    if cfg.sibling_kernel:
        const.update(NV=cfg.vsplit)
    sig = _signature(kern, cfg, fp8, split, const)
    dns = {kern.arg_names[i] if isinstance(i, int) else i for i in kern.do_not_specialize}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kern.arg_names)
             if sig[a].startswith("*") or (sig[a] == "i32" and a not in dns)}
    k = triton.compile(ASTSource(kern, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                    launch_pdl=gdc))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not triton.__version__.startswith("3.6") and os.path.exists(ptxas + "-blackwell"):
        ptxas += "-blackwell"  # newer Triton emits a PTX version only this ptxas reads
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(k.asm["ptx"])
        f.flush()
        log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(regs=int(regs.group(1)) if regs else -1,
                spill_st=int(sp.group(1)) if sp else -1, spill_ld=int(sp.group(2)) if sp else -1,
                smem=k.metadata.shared)
