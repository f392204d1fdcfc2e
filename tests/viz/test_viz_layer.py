"""The recorded bench_layer results load and chart as notebook 07 shows them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("plotly")  # the notebook extras (absent on the GPU image)

from mla_spec.viz.layer import (  # noqa: E402
    layer_rows,
    layer_vs_batch_figure,
    load_layer_results,
    piece_times,
    pieces_figure,
    projection_figure,
)


@pytest.fixture(scope="module")
def res():
    return load_layer_results()


def test_recorded_grid_is_complete(res):
    # 3 ctx x 4 bs x (2 target + 2 mtp modes) whole layers, all captured in graphs
    assert len(layer_rows(res, part="layer")) == 24 and len(layer_rows(res, part="mtp")) == 24
    assert {r["bs"] for r in res["rows"]} == {1, 8, 32, 128}
    assert {r["ctx"] for r in res["rows"]} == {None, 1024, 8192, 32768}
    assert all(r["ours_us"] > 0 and r["base_us"] > 0 for r in res["rows"])


def test_piece_times_match_the_recorded_table(res):
    t = piece_times(res, mode="DECODE", bs=1, ctx=1024)
    assert t["layer"] == {"ours": 117.0, "base": 252.1}  # H200, 2026-11-30
    assert t["moe"] == {"ours": 49.9, "base": 170.5}  # router kernels, shared column, w2 loop
    assert t["attn"] == {"ours": 72.0, "base": 86.6}  # fused RoPE, BF16 GEMV, PDL
    assert t["dense"] == {"ours": 42.8, "base": 77.3}
    assert t["attn_kernel"] == {"ours": 15.2, "base": 20.4}
    assert t["norms"]["ours"] == 8.2  # fused RMSNorm (33.7 µs unfused, first run)
    v = piece_times(res, mode="TARGET_VERIFY", bs=1, ctx=1024)
    assert v["layer"] == {"ours": 210.3, "base": 428.5}  # 229.9 before the MoE w2 loop
    assert v["moe"]["ours"] == 125.9
    with pytest.raises(ValueError, match="expected one row"):
        piece_times(res, bs=3)


def test_projection_numbers(res):
    ours, base = res["projection"]["ours"]["lines"], res["projection"]["base"]["lines"]
    assert [v["tok_s"] for v in ours.values()] == [107.7, 122.3, 149.9, 179.9]
    assert [v["tok_s"] for v in base.values()] == [57.9, 69.3, 85.0, 101.9]
    assert res["projection_model"]["sglang_ci_bars_tok_s"] == {"no_mtp": 75.0, "mtp": 150.0}


def test_figures_have_the_expected_traces(res):
    f = pieces_figure(res)
    assert [t.name for t in f.data] == ["ours", "base"] and len(f.data[0].x) == 7
    f = layer_vs_batch_figure(res, ctx=8192)
    assert len(f.data) == 4 and list(f.data[0].x) == [1, 8, 32, 128]
    f = projection_figure(res)
    assert len(f.data) == 3 and list(f.data[2].y) == [75.0, 150.0, 150.0, 150.0]


def test_bad_file_is_refused(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a bench_layer result"):
        load_layer_results(p)


def test_recorded_collectives_load_and_chart(tmp_path):
    from mla_spec.viz.layer import collectives_figure, load_collectives

    d = load_collectives()
    assert d["meta"]["world"] == 4 and d["meta"]["backend"] == "nccl"
    rows = d["allreduce"]
    assert [r["rows"] for r in rows] == sorted(r["rows"] for r in rows)
    assert all(r["graph_us"] > 0 and r["eager_us"] > 0 for r in rows)
    f = collectives_figure(d)
    assert [t.name for t in f.data][0] == "in a CUDA graph" and len(f.data) == 3
    bad = tmp_path / "x.json"
    bad.write_text('{"allreduce": []}')
    with pytest.raises(ValueError, match="not a bench_allreduce result"):
        load_collectives(bad)
