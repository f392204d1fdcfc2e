"""The arrival-counter cache (``mla_spec.kernels.launch.cuda_driver``) of the last-CTA kernels."""

from __future__ import annotations

import torch

from mla_spec.kernels.launch import cuda_driver as arrival


def test_counters_are_zero_cached_and_grow(monkeypatch):
    monkeypatch.setattr(arrival, "_CACHE", {})
    monkeypatch.setattr(arrival, "_OUTGROWN", [])
    a = arrival.arrival_counters(5, torch.device("cpu"))
    assert a.dtype == torch.int32 and a.numel() == arrival.MIN_COUNTERS and not a.any()
    assert arrival.arrival_counters(17, "cpu") is a  # cached, big enough
    b = arrival.arrival_counters(arrival.MIN_COUNTERS + 1, "cpu")
    assert b is not a and b.numel() == arrival.MIN_COUNTERS + 1 and not b.any()
    assert arrival._OUTGROWN == [a]  # a graph captured before may still use the old one
    assert arrival.arrival_counters(3, "cpu") is b
