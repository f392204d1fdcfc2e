"""The decode call chain: a spec-v2 verify, from ``Engine.step`` to the attention kernel launch.

One real speculative round of the embedded model (TP 1, the triton backend; on CPU its kernels
run in Triton's interpreter) runs under ``sys.setprofile``. At the first kernel launch below the
attention backend inside ``EagleWorker.verify`` the Python stack is recorded;
the files of the package that its frames live in, from ``Engine.step`` down to the function
that launches the kernel, are the chain (torch's own frames, ``nn.Module.__call__`` and the
``no_grad`` wrapper, are not the package's and are not counted). docs/architecture.md prints it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import mla_spec
from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.data import EMBEDDED_MODEL
from mla_spec.engine import Engine

PKG = Path(mla_spec.__file__).resolve().parent
MAX_FILES = 8

pytestmark = pytest.mark.triton


def _in_package(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(PKG)


def _is_kernel_launch(frame) -> bool:
    """A call that launches a kernel: ``kernel[grid](...)`` enters a Triton ``KernelInterface``
    (a JIT function, the interpreter's stand-in, an autotuner) through ``__getitem__`` / ``run``
    / ``__call__`` (helpers such as ``triton.cdiv`` are not kernels); the launchers of
    ``kernels/launch/`` are the launch too: a hand-written CUDA kernel's ``CudaKernel`` (GPU
    only) and the cached relauncher of a Triton kernel (``TritonLauncher.launch`` / call)."""
    if frame.f_code.co_name not in ("__getitem__", "run", "__call__", "launch"):
        return False
    from triton.runtime.jit import KernelInterface

    from mla_spec.kernels.launch.cuda_driver import CudaKernel
    from mla_spec.kernels.launch.triton_launcher import TritonLauncher

    return isinstance(frame.f_locals.get("self"), (KernelInterface, CudaKernel, TritonLauncher))


def record_verify_chain(engine: Engine) -> list[tuple[str, int, str]]:
    """``(file relative to the repository, line, function)`` of every package frame from
    ``Engine.step`` to the function that launches the first attention kernel of a verify."""
    found: list = []

    def profile(frame, event, arg):
        if found or event != "call" or not _is_kernel_launch(frame):
            return
        stack = []
        f = frame.f_back
        while f is not None:
            stack.append(f)
            f = f.f_back
        stack.reverse()  # outermost first
        names = [(Path(f.f_code.co_filename).resolve(), f.f_code.co_name) for f in stack]
        if not any(n == "verify" for _, n in names) or not any(
                p.is_relative_to(PKG / "attention") for p, _ in names):
            return
        start = max(i for i, (p, n) in enumerate(names)
                    if n == "step" and p == PKG / "engine.py")
        found.extend((str(Path(f.f_code.co_filename).resolve().relative_to(PKG.parent)),
                      f.f_lineno, f.f_code.co_name)
                     for f in stack[start:] if _in_package(f.f_code.co_filename))

    sys.setprofile(profile)
    try:
        rec = engine.step()
    finally:
        sys.setprofile(None)
    assert rec is not None and rec.kind == "spec", "the profiled step was not a speculative round"
    return found


def chain_files(chain: list[tuple[str, int, str]]) -> list[str]:
    return list(dict.fromkeys(f for f, _, _ in chain))


@pytest.fixture(params=["fp8_e4m3", "auto"])
def engine(request):
    """The demo's FP8 cache (the paged kernel) and the model's dtype (fp32 on CPU: the generic
    kernel)."""
    torch.manual_seed(0)
    eng = Engine(EMBEDDED_MODEL, tp_size=1, spec=SpecConfig(version="v2"),
                 cache=CacheConfig(kv_dtype=request.param), attention_backend="triton",
                 device="cpu", max_reqs=4, max_context_len=128, cuda_graph=False)
    yield eng
    eng.shutdown()


def test_verify_reaches_the_attention_kernel_through_few_files(engine):
    engine.add_request([5, 6, 7, 8, 9, 10, 11], max_new_tokens=12)
    assert engine.step().kind == "prefill"
    chain = record_verify_chain(engine)
    assert chain, "no attention kernel launch seen inside EagleWorker.verify"
    files = chain_files(chain)
    kv = engine.cache.kv_dtype
    print(f"\nspec-v2 verify, KV {kv}: {len(chain)} package frames in {len(files)} files")
    for f, line, fn in chain:
        print(f"  {f}:{line} {fn}")
    assert chain[0][2] == "step" and chain[0][0].endswith("engine.py")
    assert any(f.startswith("mla_spec/attention/") for f in files)
    assert any(f.startswith("mla_spec/kernels/") for f in files)
    assert len(files) <= MAX_FILES, f"{len(files)} files (at most {MAX_FILES}): {files}"
