"""``check_backend``: the built-in backends pass it where they run; each broken contract fails with
its reason."""

from __future__ import annotations

import importlib.util

import pytest

from mla_spec.attention.base import write_output
from mla_spec.attention.conformance import CASES, check_backend
from mla_spec.attention.torch_ref import TorchMLABackend
from mla_spec.attention.trtllm_mla import reference_trtllm_kernel

SMALL = dict(kv_lora_rank=32, qk_rope_head_dim=16)
TOL = {"flashinfer": 2e-2}  # H200 2026-12-02: FlashInfer FP8 rows at up to 1.3e-2


@pytest.fixture
def torch_stores(monkeypatch):
    """Scenes write their KV rows with the torch twin instead of the Triton kernel in the CPU
    interpreter (seconds a case): the backend under test is what matters here."""
    monkeypatch.setenv("MLA_SPEC_TRITON_ON_CPU", "0")


@pytest.mark.parametrize("name", [
    "torch", pytest.param("triton", marks=pytest.mark.triton),
    pytest.param("flashinfer", marks=[pytest.mark.gpu, pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")])])
def test_builtin_backends_conform(name, device, monkeypatch):
    if name == "torch":
        monkeypatch.setenv("MLA_SPEC_TRITON_ON_CPU", "0")
    report = check_backend(name, device, **({} if name == "flashinfer" else SMALL))  # 512 / 64
    assert report.ok and report.skipped is None, str(report)
    assert report.count("pass") == 2 * len(CASES) == 14
    errors = {(r.case, str(r.kv_dtype)): r.error for r in report.results if r.case != "IDLE"}
    assert all(e is not None and e < TOL.get(name, 1e-2) for e in errors.values()), errors


def test_trtllm_declares_prefill_unsupported_and_skips_without_its_gpu(torch_stores):
    kw = dict(backend_kwargs={"kernel": reference_trtllm_kernel}, tol=0.2)  # e4m3 queries
    report = check_backend("trtllm", "cpu", **kw, **SMALL)
    assert report.ok and report.count("unsupported") == 4  # EXTEND, MIXED x 2 KV dtypes
    assert {r.case for r in report.results if r.status == "unsupported"} == {"EXTEND", "MIXED"}
    for name in ("trtllm", "flashinfer"):
        skipped = check_backend(name, "cpu", **SMALL)
        assert skipped.ok and skipped.results == [] and "cannot run on cpu" in skipped.skipped
        assert "skipped:" in str(skipped)


class IgnoresVScale(TorchMLABackend):
    def forward(self, q_nope, q_pe, layer_id, batch, *, out=None):
        res = super().forward(q_nope, q_pe, layer_id, batch)
        return write_output(res / self.kv_pool.read_scales(layer_id)[1], out)


class ReturnsFloat32(TorchMLABackend):
    def forward(self, q_nope, q_pe, layer_id, batch, *, out=None):
        return super().forward(q_nope, q_pe, layer_id, batch).float()


class WritesThePool(TorchMLABackend):
    def forward(self, q_nope, q_pe, layer_id, batch, *, out=None):
        self.kv_pool.get_kv(layer_id)[0, 0, 0] = 3.0
        return super().forward(q_nope, q_pe, layer_id, batch, out=out)


class IgnoresOut(TorchMLABackend):
    def forward(self, q_nope, q_pe, layer_id, batch, *, out=None):
        return super().forward(q_nope, q_pe, layer_id, batch)


class RaggedCrash(TorchMLABackend):
    def forward(self, q_nope, q_pe, layer_id, batch, *, out=None):
        plan = self.checked_plan(q_nope, q_pe, layer_id, batch)
        if plan is not None and plan.fixed_q is None:
            raise RuntimeError("ragged rows not handled")
        return super().forward(q_nope, q_pe, layer_id, batch, out=out)


@pytest.mark.parametrize("cls, failing, reason", [
    (IgnoresVScale, {"fp8_e4m3"}, "> tol"),
    (ReturnsFloat32, {"bfloat16", "fp8_e4m3"}, "expected"),
    (WritesThePool, {"bfloat16", "fp8_e4m3"}, "forward wrote the KV pool"),
    (IgnoresOut, {"bfloat16", "fp8_e4m3"}, "out= was not filled"),
    (RaggedCrash, {"bfloat16", "fp8_e4m3"}, "RuntimeError: ragged rows not handled"),
])
def test_broken_contracts_fail_with_their_reason(cls, failing, reason, torch_stores):
    report = check_backend(cls, "cpu", **SMALL)
    assert not report.ok
    assert {r.kv_dtype for r in report.failures} == failing
    assert all(reason in r.detail for r in report.failures), str(report)
    if cls is RaggedCrash:
        assert {r.case for r in report.failures} == {"DRAFT_EXTEND (v1, ragged)", "EXTEND",
                                                     "MIXED"}
        assert all(r.status == "ERROR" for r in report.failures)
