"""Fused RMSNorm kernel vs its torch twin (CPU: Triton interpreter), and the RMSNorm module.

GPU check + timing (H200, ~20 s): ``python -m pytest -m gpu tests/kernels/test_rmsnorm.py -q``
prints a table of the two torch norms vs the fused kernel per batch (CUDA graphs, median µs), and
writes it to ``$OUT/rmsnorm_timing.{md,json}`` when ``$OUT`` is set.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from mla_spec.kernels.ops import rmsnorm as K
from mla_spec.models.norm import RMSNorm

BF16 = torch.bfloat16
F32 = torch.float32


def _inputs(shape, dtype, wdtype, device="cpu", scale=3.0):
    x = (torch.randn(shape, device=device) * scale + 0.5).to(dtype)
    w = (torch.rand(shape[-1], device=device) + 0.5).to(wdtype)
    return x, w


def _close(y, ref, exact_cast: bool):
    """fp32 outputs from fp32 math agree to rounding; anything that went through a bf16 cast
    may differ by one bf16 ulp (interpreter casts truncate; the GPU's are RTNE)."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    if exact_cast:
        torch.testing.assert_close(y, ref, rtol=2e-6, atol=2e-6)
    else:
        torch.testing.assert_close(y.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


# ---- kernel vs twin (interpreter on CPU) ---------------------------------------------------
@pytest.mark.parametrize("rows", [0, 1, 7])
@pytest.mark.parametrize("hidden", [7, 96, 1000])
@pytest.mark.parametrize("dtype,wdtype", [(F32, F32), (BF16, BF16), (BF16, F32)])
def test_kernel_matches_twin(rows, hidden, dtype, wdtype):
    x, w = _inputs((rows, hidden), dtype, wdtype)
    y = K.rms_norm(x, w, 1e-6)
    ref = K.rms_norm_ref(x, w, 1e-6)
    assert y.dtype == torch.promote_types(wdtype, dtype)  # torch's promotion, as the module
    _close(y, ref, dtype == F32)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kernel_chunked_rows_and_big_hidden(dtype):
    # the two-pass path (rows wider than max_block) and a DeepSeek-size row in one tile
    x, w = _inputs((3, 200), dtype, dtype)
    _close(K.rms_norm(x, w, 1e-5, max_block=64), K.rms_norm_ref(x, w, 1e-5), dtype == F32)
    x, w = _inputs((1, 7168), dtype, dtype)
    _close(K.rms_norm(x, w), K.rms_norm_ref(x, w), dtype == F32)


def test_kernel_strided_rows_and_leading_dims():
    # the ckv slice of kv_a_proj's output [N, 512 + 64]: strided rows, no copy needed
    latent = torch.randn(5, 72)
    ckv = latent[:, :64]
    w = torch.rand(64) + 0.5
    _close(K.rms_norm(ckv, w), K.rms_norm_ref(ckv, w), True)
    x, w = _inputs((2, 3, 40), BF16, BF16)
    y = K.rms_norm(x, w)
    assert y.shape == (2, 3, 40)
    _close(y, K.rms_norm_ref(x, w), False)


@pytest.mark.parametrize("rows,hidden,max_block", [(0, 7, 8192), (1, 7, 8192), (7, 96, 8192),
                                                   (3, 200, 64)])
@pytest.mark.parametrize("dtype,wdtype", [(F32, F32), (BF16, BF16), (BF16, F32)])
def test_add_kernel_matches_twin(rows, hidden, max_block, dtype, wdtype):
    x, w = _inputs((rows, hidden), dtype, wdtype)
    r = torch.randn(rows, hidden).to(dtype)
    x0, r0 = x.clone(), r.clone()
    out, s = K.rms_norm_add(x, r, w, 1e-6, max_block=max_block)
    ref_out, ref_s = K.rms_norm_add_ref(x, r, w, 1e-6)
    assert s.dtype == dtype
    _close(s, ref_s, dtype == F32)
    _close(out, ref_out, dtype == F32)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs untouched


def test_bad_inputs_raise():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        K.rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="supported"):
        K.rms_norm(x.double(), torch.ones(8))
    with pytest.raises(ValueError, match="residual must match"):
        K.rms_norm_add(x, torch.randn(2, 7), torch.ones(8))
    with pytest.raises(ValueError, match="tensor"):
        K.rms_norm(torch.tensor(1.0), torch.ones(1))


def test_compiles_once_per_specialization():
    before = K._LAUNCH.compile_count()
    x, w = _inputs((3, 96), F32, F32)
    for rows in (1, 2, 5):  # the row count is the grid, not a specialization
        K.rms_norm(x[:rows], w)
    assert K._LAUNCH.compile_count() - before <= 1


# ---- the module ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,wdtype", [(F32, F32), (BF16, BF16), (BF16, F32), (F32, BF16)])
def test_module_is_the_original_code_on_cpu(dtype, wdtype, monkeypatch):
    """On CPU (even under the interpreter) the module runs the torch twin: bit-identical to the
    original forward, dtype included; the kernel is never called."""
    def boom(*a, **k):
        raise AssertionError("the Triton kernel must not run on CPU from the module")

    monkeypatch.setattr("mla_spec.models.norm.rms_norm", boom)
    monkeypatch.setattr("mla_spec.models.norm.rms_norm_add", boom)
    norm = RMSNorm(33, 1e-6, dtype=wdtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(33) + 0.5)
    x = (torch.randn(4, 33) * 2).to(dtype)
    xf = x.float()
    original = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    y = norm(x)
    assert y.dtype == original.dtype == torch.promote_types(wdtype, dtype)
    assert torch.equal(y, original)
    r = torch.randn(4, 33).to(dtype)
    out, s = norm.forward_add(x, r)
    assert torch.equal(s, x + r) and torch.equal(out, norm(x + r))


def test_module_keeps_autograd_on_the_torch_path():
    norm = RMSNorm(16)
    x = torch.randn(3, 16, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


# ---- GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [0, 1, 7, 128, 513])
@pytest.mark.parametrize("hidden", [7, 96, 512, 1536, 7168, 10000])
@pytest.mark.parametrize("dtype,wdtype", [(F32, F32), (BF16, BF16), (BF16, F32)])
def test_gpu_kernel_matches_twin(rows, hidden, dtype, wdtype):
    x, w = _inputs((rows, hidden), dtype, wdtype, "cuda")
    r = torch.randn(rows, hidden, device="cuda").to(dtype)
    for _ in range(2):  # the second call takes the launcher's direct path
        y = K.rms_norm(x, w)
        out, s = K.rms_norm_add(x, r, w)
    ref = K.rms_norm_ref(x, w)
    ref_out, ref_s = K.rms_norm_add_ref(x, r, w)
    assert torch.equal(s, ref_s)  # one RTNE rounding of an exact fp32 sum: bit-exact
    for a, b in ((y, ref), (out, ref_out)):
        assert a.dtype == b.dtype
        if dtype == F32:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
        else:
            # an fp32 rsqrt one ulp apart can flip the bf16 rounding of x * rsqrt, and the
            # weight multiply scales that ulp: up to two bf16 ulps (2**-6), on few elements
            torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-5)
            if a.numel():
                assert (a != b).float().mean().item() < 0.02


@pytest.mark.gpu
def test_gpu_module_uses_kernel_and_graph_capture():
    norm = RMSNorm(7168, 1e-6, dtype=BF16, device="cuda")
    with torch.no_grad():
        norm.weight.copy_(torch.rand(7168, device="cuda") + 0.5)
        x = torch.randn(4, 7168, device="cuda", dtype=BF16)
        before = K._LAUNCH.compile_count()
        y = norm(x)
        assert K._LAUNCH.compile_count() >= max(before, 1)
        torch.testing.assert_close(y.float(), K.rms_norm_ref(x, norm.weight, 1e-6).float(),
                                   rtol=1.6e-2, atol=1e-5)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            norm(x), norm.forward_add(x, x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gy = norm(x)
            gout, gs = norm.forward_add(x, y)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(gy, norm(x))
        ref_out, ref_s = norm.forward_add(x, y)
        assert torch.equal(gout, ref_out) and torch.equal(gs, ref_s)


def _graph_us(fn, reps=20):
    """Median µs of one call of ``fn`` replayed from a CUDA graph (``do_bench``, L2 flushed)."""
    import triton.testing

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=10, rep=reps, return_mode="median") * 1e3


@pytest.mark.gpu
def test_gpu_timing_table(capsys):
    """The two norms of a DeepSeek-V3 layer (hidden 7168, bf16), torch vs fused, per batch; and
    the attention's q_a (1536) / kv_a (512) norms at batch 1."""
    ln1 = RMSNorm(7168, 1e-6, dtype=BF16, device="cuda")
    ln2 = RMSNorm(7168, 1e-6, dtype=BF16, device="cuda")
    rows = []
    with torch.no_grad():
        for m in (1, 4, 32, 128, 512):
            x = torch.randn(m, 7168, device="cuda", dtype=BF16)
            t_torch = _graph_us(lambda x=x: (K.rms_norm_ref(x, ln1.weight, 1e-6),
                                             K.rms_norm_ref(x, ln2.weight, 1e-6)))
            t_fused = _graph_us(lambda x=x: (ln1(x), ln2(x)))
            t_add = _graph_us(lambda x=x: ln2.forward_add(x, x))
            rows.append({"piece": "2 norms, hidden 7168", "rows": m, "torch_us": t_torch,
                         "fused_us": t_fused, "fused_add_us": t_add})
        for n in (1536, 512):
            x = torch.randn(1, n, device="cuda", dtype=BF16)
            w = torch.rand(n, device="cuda", dtype=BF16)
            rows.append({"piece": f"1 norm, hidden {n}", "rows": 1,
                         "torch_us": _graph_us(lambda x=x, w=w: K.rms_norm_ref(x, w)),
                         "fused_us": _graph_us(lambda x=x, w=w: K.rms_norm(x, w)),
                         "fused_add_us": float("nan")})
    head = "| piece | rows | torch µs | fused µs | speed-up | fused add+norm µs |"
    lines = [f"rmsnorm on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA "
             "graphs, do_bench median)", head, "|---|---|---|---|---|---|"]
    lines += [f"| {r['piece']} | {r['rows']} | {r['torch_us']:.1f} | {r['fused_us']:.1f} | "
              f"{r['torch_us'] / r['fused_us']:.2f}x | {r['fused_add_us']:.1f} |" for r in rows]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "rmsnorm_timing.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(os.environ["OUT"], "rmsnorm_timing.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    assert rows[0]["fused_us"] < rows[0]["torch_us"]  # one kernel beats ~16 at batch 1
