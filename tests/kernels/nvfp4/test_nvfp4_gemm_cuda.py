"""The hand-written NVFP4 ``mma.sync`` kernel (``csrc/nvfp4_mma_sm90.cu``).

On the CPU: a model of what each lane loads, decodes and hands to which MMA slot, against the
torch twin (it fails if a load offset, a nibble pair, a byte permute or a fragment slot moves);
the parameter struct against the source; refusals with reasons. On the GPU: the kernel against
the twin on irregular shapes (1-16 tokens, N not a multiple of 16, K splits, rows with large
and zero scales), inside a CUDA graph, and under bad input.
"""

from __future__ import annotations

import re

import pytest
import torch

from mla_spec.kernels.launch.cuda_driver import CSRC, compile_cubin, nvcc_path
from mla_spec.kernels.nvfp4 import gemm_cuda as nc
from mla_spec.kernels.nvfp4 import nvfp4_gemm, nvfp4_gemm_ref
from mla_spec.kernels.nvfp4.configs import (
    PINNED_CUDA,
    PINNED_CUDA_REFUSED,
    CudaMmaConfig,
    parse_variant,
    variant_name,
)
from mla_spec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

SRC = CSRC / "nvfp4_mma_sm90.cu"


def _case(m, n, k, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.2
    w[: n // 3, : k // 2] *= 1e-4  # blocks with tiny (subnormal e4m3) scales
    if n > 2:
        w[1] = 0.0  # a zero row: zero scales
        w[2, :16] = 30.0  # a block at the tensor's amax: scale 448
    q = quantize_nvfp4(w)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    return [t.to(device) for t in (x, q.weight, q.weight_scale, q.weight_scale_2)]


# --- CPU model of the kernel's lanes --------------------------------------------------------

def _bf16(bits: torch.Tensor) -> torch.Tensor:
    """uint16 patterns (int64 tensor) -> their bf16 values as fp32."""
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16).float()


def _pair(word_lo: torch.Tensor, word_hi: torch.Tensor) -> torch.Tensor:
    """A bf16x2 register as its two fp32 values [..., 2] (low half first)."""
    return torch.stack([_bf16(word_lo & 0xFFFF), _bf16(word_hi & 0xFFFF)], -1)


def _mul_bf16x2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mul.rn.bf16x2`` on (lo, hi) fp32 pairs: fp32 product rounded to bf16."""
    return (a * b).to(torch.bfloat16).float()


def _scale_pair(byte: torch.Tensor) -> torch.Tensor:
    s = ((byte & 0xFF) * 0x10001) << 4
    v = _pair(s, s >> 16)
    two119 = torch.full_like(v, 2.0**119)
    return _mul_bf16x2(_mul_bf16x2(v, two119), two119)


def _decode_word(w: torch.Tensor, scale: torch.Tensor) -> list[torch.Tensor]:
    mag, sign = 0x01C001C0, 0x80008000
    bits = [((w << 6) & mag) | ((w << 12) & sign), ((w << 2) & mag) | ((w << 8) & sign),
            ((w >> 2) & mag) | ((w << 4) & sign), ((w >> 6) & mag) | (w & sign)]
    return [_mul_bf16x2(_pair(b, b >> 16), scale) for b in bits]


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _words(t: torch.Tensor) -> torch.Tensor:
    """int64 little-endian 32-bit words of a uint8 [..., 4 * w] tensor."""
    b = t.to(torch.int64).reshape(*t.shape[:-1], -1, 4)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


def _mma(acc, a_regs, b_regs, lane_g, lane_t):
    """``mma.m16n8k16`` from per-lane registers: a_regs 4 x [32, 2], b_regs 2 x [32, 2] (fp32
    values of bf16 pairs), placed in A [16, 16] / B [16, 8] as the PTX ISA lays them out."""
    a = torch.zeros(16, 16)
    b = torch.zeros(16, 8)
    for r, (dr, dk) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
        for h in range(2):
            a[lane_g + dr, 2 * lane_t + dk + h] = a_regs[r][:, h]
    for r, dk in enumerate([0, 8]):
        for h in range(2):
            b[2 * lane_t + dk + h, lane_g] = b_regs[r][:, h]
    return acc + a.double() @ b.double()


def kernel_model(x, w, ws, ws2, splits=1):
    """What the kernel computes, lane by lane (fp64 sums in place of the tensor cores')."""
    m, k = x.shape
    n = w.shape[0]
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    xw = _words(x.view(torch.uint8))  # [m, k/2] words: bf16 pairs
    ww = _words(w)  # [n, k/8] words
    sbytes = ws.view(torch.uint8).to(torch.int64)
    y = torch.zeros(m, n, dtype=torch.float64)
    for tile in range(-(-n // 16)):
        row_a = (tile * 16 + g).clamp(max=n - 1)
        row_b = (tile * 16 + g + 8).clamp(max=n - 1)
        for j in range(-(-m // 8)):
            tok = (8 * j + g).clamp(max=m - 1)
            acc = torch.zeros(16, 8, dtype=torch.float64)
            for chunk in range(k // 128):
                # the ring slot's scales: lane (g, t) copies 4 bytes of row g + 8 (t // 2)
                slot = torch.zeros(2, 8, 2, dtype=torch.int64)
                row_s = (tile * 16 + g + 8 * (t // 2)).clamp(max=n - 1)
                four = sbytes[row_s[:, None], 8 * chunk + 4 * (t % 2)[:, None] + torch.arange(4)]
                slot[t // 2, g, t % 2] = (four << torch.arange(0, 32, 8)).sum(1)
                sc_a = slot[0, g, t // 2] >> (16 * (t % 2))
                sc_b = slot[1, g, t // 2] >> (16 * (t % 2))
                for h in range(2):  # lane's 16 bytes at 64 chunk + 16 t: words 16 chunk + 4 t + q
                    s_a = _scale_pair(sc_a >> (8 * h))
                    s_b = _scale_pair(sc_b >> (8 * h))
                    for q in (2 * h, 2 * h + 1):
                        widx = 16 * chunk + 4 * t + q
                        pa = _decode_word(ww[row_a, widx], s_a)
                        pb = _decode_word(ww[row_b, widx], s_b)
                        e = 128 * chunk + 32 * t + 8 * q  # the word's first element
                        xv = [xw[tok, e // 2 + i] for i in range(4)]  # (e, e+1) .. (e+6, e+7)
                        b0, b1 = _prmt(xv[0], xv[2], 0x5410), _prmt(xv[0], xv[2], 0x7632)
                        b2, b3 = _prmt(xv[1], xv[3], 0x5410), _prmt(xv[1], xv[3], 0x7632)
                        acc = _mma(acc, [pa[0], pb[0], pa[1], pb[1]],
                                   [_pair(b0, b0 >> 16), _pair(b1, b1 >> 16)], g, t)
                        acc = _mma(acc, [pa[2], pb[2], pa[3], pb[3]],
                                   [_pair(b2, b2 >> 16), _pair(b3, b3 >> 16)], g, t)
            rows = torch.arange(tile * 16, min(tile * 16 + 16, n))
            toks = torch.arange(8 * j, min(8 * j + 8, m))
            y[toks[:, None], rows[None, :]] = acc[:len(rows), :len(toks)].t()
    return y * float(ws2) * 256.0


@pytest.mark.parametrize("m,n,k", [(1, 16, 128), (3, 21, 256), (11, 37, 384)])
def test_lane_model_matches_twin(m, n, k):
    x, w, ws, ws2 = _case(m, n, k, seed=m + n)
    got = kernel_model(x, w, ws, ws2)
    ref = x.double() @ dequantize_nvfp4(w, ws, ws2, torch.float64).t()
    # the twin's fp32 products E2M1 * s * ws2 round once: ~1e-7; a misplaced element is O(1)
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_decoded_weights_are_exact():
    """Every (code, scale) pair: the lane decode equals E2M1 * s * 2^-8 exactly."""
    codes = torch.arange(16)
    scales = torch.arange(0, 127)  # every finite non-negative e4m3 but NaN (0x7F)
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    for sb in scales:
        word = sum(codes[i].item() << (4 * i) for i in range(8))  # codes 0..7
        word2 = sum(codes[8 + i].item() << (4 * i) for i in range(8))  # codes 8..15
        sp = _scale_pair(torch.tensor([int(sb)]))
        s = torch.tensor([int(sb)], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        for wd, base in ((word, 0), (word2, 8)):
            pairs = _decode_word(torch.tensor([wd]), sp)
            for j in range(4):
                want = torch.stack([e2m1[base + j], e2m1[base + j + 4]]) * s * 2.0**-8
                assert torch.equal(pairs[j][0], want), (int(sb), base, j)


# --- the launcher on the CPU ----------------------------------------------------------------

def test_params_layout_matches_source():
    src = SRC.read_text()
    body = re.search(r"struct Nvfp4GemmParams \{(.*?)\};", src, re.S)[1]
    names = re.findall(r"(\w+)(?:,|;)", re.sub(r"//[^\n]*", "", body))
    assert names == [f for f, _ in nc._Params._fields_]
    built = re.findall(r"^NVFP4_MMA\((\d), (\d), (\d), (\d), (\d)\)", src, re.M)
    assert sorted(tuple(int(v) for v in b) for b in built) == sorted(
        (a, b, c, int(d), e) for a, b, c, d, e in nc.CUDA_MMA_BUILT)


def test_cpu_is_refused_with_a_reason():
    x, w, ws, ws2 = _case(4, 32, 256, seed=1)
    why = nc.cuda_gemm_supported(x, w, ws, ws2, torch.bfloat16)
    assert why and "CUDA" in why


def test_variant_names_round_trip():
    for cfg in (CudaMmaConfig(), CudaMmaConfig(8, 4, 3, False), CudaMmaConfig(4, 4, 1, True, 2)):
        assert parse_variant(variant_name(cfg)) == cfg
    assert parse_variant("cuda w4 st8 s2 xl") == CudaMmaConfig(4, 8, 2, False)
    assert parse_variant("cuda w8 st4 s1 r2") == CudaMmaConfig(8, 4, 1, True, 2)
    with pytest.raises(ValueError, match="unsupported token"):
        parse_variant("cuda w4 u1 s1")


def test_unbuilt_config_is_refused_with_the_list():
    x, w, ws, ws2 = _case(12, 32, 256, seed=1)
    why = nc.cuda_gemm_supported(x, w, ws, ws2, torch.bfloat16, CudaMmaConfig(8, 8, 1))
    assert "not built" in why and "(2, 4, 4, False, 1)" in why


def test_default_config_fills_the_gpu():
    assert nc.default_cuda_config(4, 9216, 7168).split_k == 1  # 576 tiles
    assert nc.default_cuda_config(4, 1024, 7168).split_k >= 8  # 64 tiles
    assert nc.default_cuda_config(4, 1024, 256).split_k == 1  # too short to split


def test_pinned_cuda_entries_are_built_and_chosen():
    for (n, k, mb), name in PINNED_CUDA.items():
        cfg = parse_variant(name)
        assert isinstance(cfg, CudaMmaConfig) and nc._key(mb, cfg) in nc._KERNELS, name
        assert nc._auto(mb, n, k, 132) == cfg
        assert (n, k, mb) not in PINNED_CUDA_REFUSED
    for n, k, mb in PINNED_CUDA_REFUSED:
        assert nc._auto(mb, n, k, 132) is None
    assert nc._auto(3, 4096, 2048, 132) == nc.default_cuda_config(3, 4096, 2048)  # unmeasured
    assert nc._auto(1, 4096, 2048, 132) is None and nc._auto(12, 4096, 2048, 132) is None


def test_cpu_calls_never_pick_the_cuda_kernel():
    x, w, ws, ws2 = _case(4, 32, 256, seed=1)
    assert nc.cuda_auto_config(x, w, ws, ws2, torch.bfloat16) is None


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_source_compiles_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_SPEC_CACHE", str(tmp_path))
    cubin = compile_cubin(SRC, "sm_90a")
    for kern in nc._KERNELS.values():
        assert kern.name.encode() in cubin


# --- the GPU --------------------------------------------------------------------------------

GPU_CASES = [  # m, n, k, config (every build at least once)
    (1, 16, 128, CudaMmaConfig()),
    (2, 37, 256, CudaMmaConfig(8, 4, 1)),
    (5, 129, 1152, CudaMmaConfig(4, 2, 1)),
    (8, 200, 896, CudaMmaConfig(4, 8, 3)),
    (7, 520, 3072, CudaMmaConfig(4, 4, 2, False)),
    (9, 48, 2048, CudaMmaConfig(4, 4, 5)),
    (16, 1000, 7168, CudaMmaConfig(4, 2, 1, False)),
    (13, 1024, 7168, CudaMmaConfig(8, 4, 8, False)),
    (16, 7168, 512, CudaMmaConfig(4, 4, 1, False)),
    (10, 300, 4608, CudaMmaConfig(4, 8, 2, False)),
    (3, 40, 384, CudaMmaConfig(4, 4, 64)),  # more splits than chunks: clamped
    # two 16-row tiles per warp: N not a multiple of 32, a tile past N, splits
    (6, 40, 1024, CudaMmaConfig(4, 4, 1, True, 2)),
    (8, 1000, 7168, CudaMmaConfig(8, 4, 1, True, 2)),
    (3, 300, 2048, CudaMmaConfig(4, 8, 3, True, 2)),
    (16, 520, 3072, CudaMmaConfig(4, 4, 1, False, 2)),
    (12, 72, 4608, CudaMmaConfig(8, 4, 4, False, 2)),
    (9, 1024, 7168, CudaMmaConfig(4, 2, 8, False, 2)),
]


@pytest.fixture
def cuda_kernels():
    """The GPU tests' device; skipped with the reason where the kernel cannot be built."""
    dev = torch.device("cuda")
    why = nc.cuda_kernels_available(dev)
    if why:
        pytest.skip(why)
    return dev


def _rel_err(y, ref):
    """max |y - ref| / max |ref|: one bf16 rounding of an fp32 sum stays under 8e-3."""
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,cfg", GPU_CASES)
def test_kernel_matches_twin_on_gpu(m, n, k, cfg, cuda_kernels):
    x, w, ws, ws2 = _case(m, n, k, seed=m * n, device=cuda_kernels)
    ref = nvfp4_gemm_ref(x, w, ws, ws2, torch.float32)
    for _ in range(2):  # the second call finds the split counters reset
        y = nvfp4_gemm(x, w, ws, ws2, config=cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert _rel_err(y, ref) < 8e-3
        assert not torch.isnan(y).any()


@pytest.mark.gpu
def test_graph_replay_reads_new_inputs(cuda_kernels):
    x, w, ws, ws2 = _case(6, 300, 1024, seed=3, device=cuda_kernels)
    cfg = CudaMmaConfig(4, 4, 4)
    y = nvfp4_gemm(x, w, ws, ws2, config=cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = nvfp4_gemm(x, w, ws, ws2, config=cfg)
    for seed in (5, 6):
        x.copy_(_case(6, 300, 1024, seed=seed, device=cuda_kernels)[0])
        graph.replay()
        assert _rel_err(y, nvfp4_gemm_ref(x, w, ws, ws2, torch.float32)) < 8e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(4, 7168, 512), (3, 520, 3072), (1, 7168, 512)])
def test_default_call_takes_the_kernel_where_chosen(m, n, k, cuda_kernels):
    x, w, ws, ws2 = _case(m, n, k, seed=9, device=cuda_kernels)
    assert nc.cuda_auto_config(x, w, ws, ws2, torch.bfloat16) is not None
    assert nc.cuda_auto_config(x.float(), w, ws, ws2, torch.float32) is None
    assert _rel_err(nvfp4_gemm(x, w, ws, ws2), nvfp4_gemm_ref(x, w, ws, ws2, torch.float32)) < 8e-3


@pytest.mark.gpu
def test_bad_input_is_refused_on_gpu(cuda_kernels):
    x, w, ws, ws2 = _case(17, 32, 256, seed=2, device=cuda_kernels)
    with pytest.raises(ValueError, match="1..16 tokens"):
        nvfp4_gemm(x, w, ws, ws2, config=CudaMmaConfig())
    x, w, ws, ws2 = _case(4, 32, 144, seed=2, device=cuda_kernels)
    with pytest.raises(ValueError, match="multiple of 128"):
        nvfp4_gemm(x, w, ws, ws2, config=CudaMmaConfig())
    x, w, ws, ws2 = _case(4, 32, 256, seed=2, device=cuda_kernels)
    with pytest.raises(ValueError, match="bf16"):
        nvfp4_gemm(x.float(), w, ws, ws2, config=CudaMmaConfig())
