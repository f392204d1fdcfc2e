"""Collective costs for ``benchmarks/projection.py``: the estimated link and the measured table.

A *link* is anything with ``allreduce_us(nbytes, tp)``, ``allgather_us(nbytes_total, tp)``,
``measured`` and ``describe()``. :class:`LinkSpec` estimates a ring: an all-reduce moves ``2
(tp-1)/tp * bytes`` per GPU, an all-gather ``(tp-1)/tp * bytes``, plus a fixed latency each.
:class:`MeasuredLink` interpolates the ``(bytes, us)`` points ``benchmarks/bench_allreduce.py``
measured (:func:`load_measured_link`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LinkSpec", "MeasuredLink", "Link", "NVLINK4_H200", "load_measured_link",
           "allreduce_us", "allgather_us"]


@dataclass(frozen=True)
class LinkSpec:
    """A GPU-to-GPU link for the estimate: ``bandwidth_gb_s`` per direction per GPU (GB = 1e9
    B), ``latency_us`` per collective."""

    name: str
    bandwidth_gb_s: float
    latency_us: float

    def __post_init__(self) -> None:
        if not self.bandwidth_gb_s > 0 or self.latency_us < 0:
            raise ValueError(f"{self}: bandwidth must be > 0 and latency >= 0")

    @property
    def measured(self) -> bool:
        return False

    def allreduce_us(self, nbytes: float, tp_size: int) -> float:
        """Ring all-reduce: ``lat + 2 (tp-1)/tp * bytes / bw`` (``tp_size >= 2``)."""
        return self.latency_us + 2 * (tp_size - 1) / tp_size * nbytes / _bytes_per_us(self)

    def allgather_us(self, nbytes_total: float, tp_size: int) -> float:
        """All-gather whose result is ``nbytes_total``: ``lat + (tp-1)/tp * bytes / bw``."""
        return self.latency_us + (tp_size - 1) / tp_size * nbytes_total / _bytes_per_us(self)

    def describe(self) -> str:
        return (f"estimated on {self.name}: {self.bandwidth_gb_s:g} GB/s/direction, "
                f"{self.latency_us:g} us each")


def _interp(table: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear through ``(bytes, us)`` points sorted by bytes: the first time below them
    (latency floor), the last two points' slope above them (bandwidth-bound)."""
    if len(table) == 1 or x <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = table[-2], table[-1]
    return max(y1, y1 + (y1 - y0) * (x - x1) / (x1 - x0))


def _table(points: Sequence[tuple[float, float]], what: str) -> tuple[tuple[float, float], ...]:
    merged: dict[float, float] = {}
    for b, us in points:
        if not (b >= 0 and us >= 0):
            raise ValueError(f"{what}: ({b}, {us}) must be bytes >= 0 and us >= 0")
        merged[float(b)] = float(us)
    if not merged:
        raise ValueError(f"{what}: no measurements")
    return tuple(sorted(merged.items()))


@dataclass(frozen=True)
class MeasuredLink:
    """Measured collective times on ``tp_size`` GPUs: ``(bytes, us)`` points per collective
    (bytes of the reduced tensor / of the gathered result), interpolated; another TP size raises.
    """

    name: str
    tp_size: int
    allreduce: tuple[tuple[float, float], ...]
    allgather: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if self.tp_size < 2:
            raise ValueError(f"tp_size {self.tp_size}: collectives are measured on >= 2 GPUs")
        object.__setattr__(self, "allreduce", _table(self.allreduce, "allreduce"))
        object.__setattr__(self, "allgather", _table(self.allgather, "allgather"))

    @property
    def measured(self) -> bool:
        return True

    def _check(self, tp_size: int) -> None:
        if tp_size != self.tp_size:
            raise ValueError(f"{self.name} was measured at TP {self.tp_size}, not TP {tp_size}; "
                             "measure at that TP size or use the estimate (LinkSpec)")

    def allreduce_us(self, nbytes: float, tp_size: int) -> float:
        self._check(tp_size)
        return _interp(self.allreduce, nbytes)

    def allgather_us(self, nbytes_total: float, tp_size: int) -> float:
        self._check(tp_size)
        return _interp(self.allgather, nbytes_total)

    def describe(self) -> str:
        return (f"measured on {self.name} (TP {self.tp_size}; {len(self.allreduce)} all-reduce "
                f"and {len(self.allgather)} all-gather sizes)")


#: What every ``link`` parameter accepts (duck-typed: ``allreduce_us`` / ``allgather_us``).
Link = LinkSpec | MeasuredLink


def load_measured_link(path: str | Path, mode: str = "graph") -> MeasuredLink:
    """A :class:`MeasuredLink` from ``benchmarks/bench_allreduce.py``'s JSON; ``mode`` "graph"
    (inside a replayed CUDA graph, as served; eager where no graph time) or "eager"."""
    if mode not in ("graph", "eager"):
        raise ValueError(f"mode {mode!r}: supported 'graph', 'eager'")
    d = json.loads(Path(path).read_text())

    def points(rows):
        out = []
        for r in rows:
            us = r.get(f"{mode}_us")
            if us is None:
                us = r.get("eager_us")
            if us is not None:
                out.append((r["bytes"], us))
        return out

    meta = d.get("meta", {})
    used = mode if meta.get("graphs", True) else "eager"
    name = f"{meta.get('device', 'GPUs')} x{meta['world']} ({meta.get('backend', 'nccl')}, {used})"
    return MeasuredLink(name, int(meta["world"]), tuple(points(d["allreduce"])),
                        tuple(points(d["allgather"])))


#: NVLink 4 on the H200 (18 links x 25 GB/s per direction). An estimate, not a measurement.
NVLINK4_H200 = LinkSpec("NVLink 4 (H200, estimate)", bandwidth_gb_s=450.0, latency_us=8.0)


def _bytes_per_us(link: LinkSpec) -> float:
    return link.bandwidth_gb_s * 1e3  # GB/s -> bytes/us


def allreduce_us(nbytes: float, tp_size: int, link: Link = NVLINK4_H200) -> float:
    """All-reduce of ``nbytes`` over ``tp_size`` GPUs (0 at TP 1)."""
    if tp_size < 1 or nbytes < 0:
        raise ValueError(f"tp_size {tp_size} must be >= 1 and nbytes {nbytes} >= 0")
    if tp_size == 1:
        return 0.0
    return link.allreduce_us(nbytes, tp_size)


def allgather_us(nbytes_total: float, tp_size: int, link: Link = NVLINK4_H200) -> float:
    """All-gather whose result is ``nbytes_total`` over ``tp_size`` GPUs (0 at TP 1)."""
    if tp_size < 1 or nbytes_total < 0:
        raise ValueError(f"tp_size {tp_size} must be >= 1 and nbytes {nbytes_total} >= 0")
    if tp_size == 1:
        return 0.0
    return link.allgather_us(nbytes_total, tp_size)
