"""Arrival counters for kernels whose last CTA to finish a piece of work completes it ("the last
block merges": the NVFP4 split-K GEMM ``nvfp4_gemm_cuda``, the sibling MLA kernel's fused
split-KV combine ``mla_decode_vsplit``), and the split barriers of the wgmma MLA kernels'
merge inside the grid (``csrc/sm90_grid_merge.cuh``: each CTA counts its arrival and the last
one resets the counter, which is what the others wait for).

A kernel counts its CTAs' arrivals with ``atomicAdd`` on one int32 per piece and the last one
resets it to zero, so the buffer is zero between calls: no memset per call, and a CUDA graph
replays the kernel as it is. One cached buffer per device (calls on a device are stream-ordered
in this package; a counter is only touched after the kernel's PDL wait, so two consecutive
kernels never share one at the same time).

CUDA-graph capture: a buffer allocated during a capture comes from the graph's private pool and
must not outlive the graph, so a capture that needs more counters than the cache holds gets a
fresh zeroed buffer that is not cached (its memset is captured and runs at every replay).
"""

from __future__ import annotations

import torch

__all__ = ["arrival_counters"]

#: the smallest buffer cached (256 KB: 64 Ki pieces, e.g. 2048 requests x 32 row blocks)
MIN_COUNTERS = 1 << 16

_CACHE: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # a graph captured earlier may still point at one


def arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters on ``device`` (see the module text)."""
    device = torch.device(device)
    buf = _CACHE.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(max(n, 1), dtype=torch.int32, device=device)
    if buf is not None:
        _OUTGROWN.append(buf)
    buf = _CACHE[device] = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
    return buf
