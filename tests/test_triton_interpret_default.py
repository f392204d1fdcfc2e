"""``import mla_spec`` without a CUDA device switches Triton to its CPU interpreter by itself.

The subprocess checks start a fresh interpreter with ``TRITON_INTERPRET`` and
``MLA_SPEC_TRITON_ON_CPU`` removed from the environment (the root conftest.py sets both for the
tests), so they see what a notebook or script started with no variable sees.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mla_spec.device import TRITON_ON_CPU, interpret_triton_without_gpu, triton_on_cpu

no_gpu = pytest.mark.skipif(torch.cuda.is_available(),
                            reason="checks the default where no CUDA device is available")

# Runs a Triton kernel of the package on CPU through public top-level names, counting the launches
# that go through Triton's interpreter (a compiled kernel would raise "0 active drivers").
_SCRIPT = '''
import os, sys, warnings

import torch

if os.environ.get("IMPORT_TRITON_FIRST"):
    import triton  # decorates Triton's own helpers (tl.sum, ...) before mla_spec can act

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import mla_spec

import triton
from triton.runtime.interpreter import InterpretedFunction

launches = []
_run = InterpretedFunction.run
def counting_run(self, *args, **kwargs):
    launches.append(self.fn.__module__ + "." + self.fn.__name__)
    return _run(self, *args, **kwargs)
InterpretedFunction.run = counting_run

seq = torch.tensor([1, 0, 3], dtype=torch.int32)  # lengths 1, 0 and 3 of at most 3 rows
cu = torch.tensor([0, 1, 1, 4], dtype=torch.int32)
q = torch.randn(4, 3, 40).to(torch.bfloat16)  # 4 rows, 3 heads, 40 dims
padded = mla_spec.pad_draft_extend_query(q, seq, cu, 3)
back = mla_spec.unpad_draft_extend_output(padded, seq, cu, 4)
assert torch.equal(back.view(torch.int16), q.view(torch.int16)), "pad then unpad lost rows"
assert padded[0, :2].abs().sum() == 0 and torch.equal(padded[2].view(torch.int16),
                                                      q[1:].view(torch.int16))
print("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
print("MLA_SPEC_TRITON_ON_CPU", os.environ.get("MLA_SPEC_TRITON_ON_CPU"))
print("warnings", [str(w.message) for w in caught if w.category is RuntimeWarning])
print("launches", sorted(set(launches)))
'''


def _run(tmp_path, **env_overrides) -> dict[str, str]:
    script = tmp_path / "interpret_default.py"  # @triton.jit needs its source in a file
    script.write_text(textwrap.dedent(_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", TRITON_ON_CPU)}
    env.update(env_overrides)
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        out[key] = value
    return out


@no_gpu
def test_import_switches_the_interpreter_on_and_keeps_the_torch_twins(tmp_path):
    out = _run(tmp_path)
    assert out["TRITON_INTERPRET"] == "1"
    assert out["MLA_SPEC_TRITON_ON_CPU"] == "0"  # serving on CPU keeps the torch twins
    assert out["launches"] == "[]" and out["warnings"] == "[]"


@no_gpu
def test_a_package_kernel_runs_in_the_interpreter_without_triton_interpret(tmp_path):
    out = _run(tmp_path, **{TRITON_ON_CPU: "1"})
    assert out["TRITON_INTERPRET"] == "1" and out["MLA_SPEC_TRITON_ON_CPU"] == "1"
    launched = ast.literal_eval(out["launches"])
    assert launched and all(name.startswith("mla_spec.") for name in launched), launched
    assert any("pad" in name for name in launched), launched


@no_gpu
def test_a_value_the_user_set_is_left_alone(tmp_path):
    out = _run(tmp_path, TRITON_INTERPRET="0")
    assert out["TRITON_INTERPRET"] == "0" and out["MLA_SPEC_TRITON_ON_CPU"] == "None"
    assert out["launches"] == "[]"  # the dispatchers take the torch twins


@no_gpu
def test_triton_imported_first_warns_and_leaves_the_interpreter_off(tmp_path):
    out = _run(tmp_path, IMPORT_TRITON_FIRST="1", **{TRITON_ON_CPU: "1"})
    assert out["TRITON_INTERPRET"] == "None" and out["launches"] == "[]"  # the twins ran
    assert "triton was imported before mla_spec" in out["warnings"], out["warnings"]


def test_interpret_triton_without_gpu_in_process(monkeypatch):
    import triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(TRITON_ON_CPU, raising=False)
    monkeypatch.delitem(sys.modules, "triton")  # as if triton were not imported yet
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert interpret_triton_without_gpu() is False  # a GPU: Triton compiles, nothing is set
    assert "TRITON_INTERPRET" not in os.environ and TRITON_ON_CPU not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert interpret_triton_without_gpu() is True
    assert os.environ["TRITON_INTERPRET"] == "1" and not triton_on_cpu()
    monkeypatch.setenv(TRITON_ON_CPU, "1")
    assert triton_on_cpu()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert interpret_triton_without_gpu() is False and not triton_on_cpu()
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setitem(sys.modules, "triton", triton)  # imported before mla_spec: too late
    with pytest.warns(RuntimeWarning, match="Set TRITON_INTERPRET=1 before importing triton"):
        assert interpret_triton_without_gpu() is False
    assert "TRITON_INTERPRET" not in os.environ
