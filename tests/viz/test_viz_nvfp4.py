"""The NVFP4 notebook's recorded floor table and its figure."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from mla_spec.viz.nvfp4 import RECORDED_H200_FLOORS, RECORDED_H200_MOE, floors_figure  # noqa: E402


def test_floor_rows_are_consistent():
    for r in RECORDED_H200_FLOORS:
        assert r["target_us"] == pytest.approx(r["bf16_us"] / 3, abs=0.01)
        assert r["read_us"] < r["ours_us"] < r["bf16_us"]  # nothing beats a bare read
    below = [r["shape"] for r in RECORDED_H200_FLOORS if r["target_us"] < r["read_us"]]
    assert below == ["expert_w2_tp4"]


def test_floors_figure_has_three_bars_per_shape():
    f = floors_figure(RECORDED_H200_FLOORS)
    assert [t.name for t in f.data] == ["read floor", "NVFP4 (ours)", "3x goal (cuBLAS bf16 / 3)"]
    assert all(len(t.x) == len(RECORDED_H200_FLOORS) for t in f.data)


def test_moe_rows_beat_the_per_slot_launch():
    gemv = [r for r in RECORDED_H200_MOE if r["path"] == "gemv"]
    assert [r["m"] for r in gemv] == [1, 2, 4]
    assert all(r["ours_us"] < r["default_us"] and r["speedup_vs_bf16"] > 3 for r in gemv)
