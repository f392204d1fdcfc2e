"""Read-floor probes: what any kernel needs just to launch, and to read a weight once.

Why: the NVFP4 GEMV's goal is 3x cuBLAS bf16 on every TP-4 shape, including one expert's
w2 (7168 x 512: 2.1 MB of NVFP4 bytes against cuBLAS's 4.8 µs per call in a chain). Whether a
shape can get there at all depends on the chip's fixed cost per kernel (launch, the PDL wait,
the first DRAM round trip, the drain), not on the GEMV's math. These probes measure that floor
with the same launch path as the GEMV (a Triton kernel in a CUDA graph, PDL on or off):

- :func:`empty_launch`: one program per SM that only waits for the previous grid;
- :func:`read_checksum`: reads a weight's bytes and block scales exactly once, the weights
  before the PDL wait as the GEMV does (``pdl`` rule 3), and writes one word per row and split:
  the XOR of the row's int32 words. A GEMV of the same bytes cannot be faster than the fastest
  layout of this kernel (``benchmarks/bench_floors.py`` sweeps a few; ``bench_mla_breakdown.py``
  times two empty launches beside an attention call).

Both have torch twins (:func:`read_checksum_ref`) so the probe itself is tested on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs

__all__ = ["empty_launch", "read_checksum", "read_checksum_ref"]


@triton.jit
def _empty_kernel(Out, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    if tl.program_id(0) == 0:
        tl.store(Out, 1)


def empty_launch(out: torch.Tensor, programs: int = 132) -> None:
    """Launch ``programs`` programs that wait for the previous grid and write ``out[0] = 1``."""
    _empty_kernel[(programs,)](out, **pdl_kwargs(out))


@triton.jit
def _read_kernel(W, S, Out, N, WW, SW, stride_w, stride_s,
                 BN: tl.constexpr, WB: tl.constexpr, SB: tl.constexpr, SPLIT: tl.constexpr,
                 USE_GDC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rok = rows < N
    per_w = tl.cdiv(WW, SPLIT)
    cw = pid_k * per_w + tl.arange(0, WB)
    wok = rok[:, None] & (cw[None, :] < tl.minimum(WW, (pid_k + 1) * per_w))
    w = tl.load(W + rows[:, None] * stride_w + cw[None, :], mask=wok, other=0)
    per_s = tl.cdiv(SW, SPLIT)
    cs = pid_k * per_s + tl.arange(0, SB)
    sok = rok[:, None] & (cs[None, :] < tl.minimum(SW, (pid_k + 1) * per_s))
    s = tl.load(S + rows[:, None] * stride_s + cs[None, :], mask=sok, other=0)
    gdc_enter(USE_GDC)
    acc = tl.xor_sum(w, 1) ^ tl.xor_sum(s, 1)
    tl.store(Out + pid_k * N + rows, acc, mask=rok)


def _words(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2 or not t.is_contiguous() or t.shape[1] * t.element_size() % 4:
        raise ValueError(f"{name} must be a contiguous 2-D tensor whose rows are whole int32 "
                         f"words, got {tuple(t.shape)} {t.dtype}")
    return t.view(torch.int32)


def read_checksum(weight: torch.Tensor, scale: torch.Tensor, block_n: int = 8, split: int = 1,
                  num_warps: int = 1) -> torch.Tensor:
    """XOR of each row's int32 words of ``weight`` ``[N, K/2]`` uint8 and ``scale`` ``[N, K/16]``
    (e4m3), per K split: ``[split, N]`` int32. Each program owns ``block_n`` rows and one split
    and loads its whole slice at once (no K loop: the fewest dependent round trips)."""
    w, s = _words(weight, "weight"), _words(scale, "scale")
    if w.shape[0] != s.shape[0]:
        raise ValueError(f"weight has {w.shape[0]} rows, scale {s.shape[0]}")
    n, ww = w.shape
    sw = s.shape[1]
    out = torch.empty((split, n), dtype=torch.int32, device=w.device)
    wb = triton.next_power_of_2(-(-ww // split))
    sb = triton.next_power_of_2(-(-sw // split))
    _read_kernel[(triton.cdiv(n, block_n), split)](
        w, s, out, n, ww, sw, w.stride(0), s.stride(0), BN=block_n, WB=wb, SB=sb, SPLIT=split,
        num_warps=num_warps, **pdl_kwargs(w))
    return out


def _xor_rows(t: torch.Tensor) -> torch.Tensor:
    """XOR over the last dim of an int32 ``[R, C]`` (pairwise halving)."""
    while t.shape[1] > 1:
        if t.shape[1] % 2:
            t = torch.cat([t, torch.zeros_like(t[:, :1])], 1)
        t = torch.bitwise_xor(t[:, 0::2], t[:, 1::2])
    return t[:, 0] if t.shape[1] else torch.zeros(t.shape[0], dtype=t.dtype, device=t.device)


def read_checksum_ref(weight: torch.Tensor, scale: torch.Tensor, split: int = 1) -> torch.Tensor:
    """Torch twin of :func:`read_checksum`."""
    w, s = _words(weight, "weight"), _words(scale, "scale")
    out = []
    for k in range(split):
        pw, ps = -(-w.shape[1] // split), -(-s.shape[1] // split)
        out.append(torch.bitwise_xor(_xor_rows(w[:, k * pw:(k + 1) * pw]),
                                     _xor_rows(s[:, k * ps:(k + 1) * ps])))
    return torch.stack(out)
