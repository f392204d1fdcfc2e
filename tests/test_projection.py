"""The tokens/s projection (hand-computed cases) and the ``--cpu-smoke`` path of bench_layer."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from projection import (  # noqa: E402  (benchmarks/projection.py)
    NVLINK4_H200,
    SGLANG_CI_BARS,
    ForwardTimes,
    LinkSpec,
    MeasuredLink,
    ModelShape,
    allgather_us,
    allreduce_us,
    b200_scaled,
    load_measured_link,
    mtp_forward_us,
    project_mtp,
    project_no_mtp,
    projection_report,
    target_forward_us,
)

# A link with no bandwidth cost: only the latency counts (easy hand arithmetic).
LAT10 = LinkSpec("test", bandwidth_gb_s=math.inf, latency_us=10.0)


def test_allreduce_ring_formula():
    # bs 1, hidden 7168, bf16 = 14336 B; 2 * 3/4 * 14336 B / 450e3 B/us = 0.047787 us, + 8 us
    assert allreduce_us(14336, 4, NVLINK4_H200) == pytest.approx(8.0 + 1.5 * 14336 / 450e3)
    # bandwidth term alone: 450 KB over 450 GB/s with factor 1.5 = 1.5 us
    no_lat = LinkSpec("bw", 450.0, 0.0)
    assert allreduce_us(450_000, 4, no_lat) == pytest.approx(1.5)
    assert allreduce_us(450_000, 2, no_lat) == pytest.approx(1.0)  # 2 * 1/2
    assert allreduce_us(10**9, 1, no_lat) == 0.0  # nothing to reduce at TP 1
    assert allgather_us(450_000, 4, no_lat) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        allreduce_us(1, 0)
    with pytest.raises(ValueError):
        LinkSpec("bad", 0.0, 1.0)


def test_target_forward_hand_computed():
    t = ForwardTimes(moe_layer_us=100.0, dense_layer_us=80.0, lm_head_us=50.0)
    f = target_forward_us(t, rows=1, logit_rows=1, link=LAT10)
    assert f["layers"] == pytest.approx(3 * 80 + 58 * 100)  # 6040
    assert f["collectives"] == pytest.approx(122 * 10 + 10)  # 2 all-reduces x 61 + 1 all-gather
    assert f["total"] == pytest.approx(6040 + 50 + 1230)


def test_no_mtp_tokens_per_s():
    t = ForwardTimes(moe_layer_us=100.0, dense_layer_us=100.0, lm_head_us=100.0)
    p = project_no_mtp(t, bs=1, link=LAT10)
    # 61 * 100 + 100 + 1230 = 7430 us per token
    assert p.step_us == pytest.approx(7430.0)
    assert p.tokens_per_s == pytest.approx(1e6 / 7430.0)
    assert p.comm_fraction == pytest.approx(1230 / 7430)
    p2 = project_no_mtp(t, link=LAT10, overhead_us=70.0)
    assert p2.step_us == pytest.approx(7500.0)


def test_mtp_tokens_per_s():
    decode = ForwardTimes(moe_layer_us=100.0, dense_layer_us=100.0, lm_head_us=100.0,
                          mtp_layer_us=150.0)
    verify = ForwardTimes(moe_layer_us=200.0, dense_layer_us=200.0, lm_head_us=150.0,
                          mtp_layer_us=250.0)
    p = project_mtp(decode, verify, accept_length=3.0, num_steps=3, bs=1, link=LAT10)
    verify_us = 61 * 200 + 150 + 1230  # 13580
    draft_extend_us = 250 + 100 + 2 * 10 + 10  # 380 (MTP over 4 rows, logits of 1 row)
    draft_decode_us = 2 * (150 + 100 + 2 * 10 + 10)  # 560 (drafts 2 and 3)
    total = verify_us + draft_extend_us + draft_decode_us  # 14520
    assert p.breakdown["verify"] == pytest.approx(verify_us)
    assert p.breakdown["draft_extend"] == pytest.approx(draft_extend_us)
    assert p.breakdown["draft_decode"] == pytest.approx(draft_decode_us)
    assert p.step_us == pytest.approx(total)
    assert p.tokens_per_s == pytest.approx(3.0 * 1e6 / total)  # 206.6
    # MTP speeds up when the cycle costs less than accept_length decode steps
    assert p.tokens_per_s > project_no_mtp(decode, link=LAT10).tokens_per_s
    with pytest.raises(ValueError):
        project_mtp(decode, verify, accept_length=4.5, num_steps=3)
    with pytest.raises(ValueError):
        project_mtp(decode, verify, accept_length=0.5)


def test_mtp_forward_and_shape_overrides():
    f = mtp_forward_us(40.0, 10.0, rows=4, logit_rows=1, link=LAT10)
    assert f["total"] == pytest.approx(40 + 10 + 30)
    tp1 = ModelShape(tp_size=1)
    t = ForwardTimes(1.0, 1.0, 1.0)
    assert target_forward_us(t, 1, 1, tp1, LAT10)["collectives"] == 0.0


def test_b200_scaled_and_report():
    t = ForwardTimes(100.0, 80.0, 50.0, 120.0)
    s = b200_scaled(t)
    assert s.moe_layer_us == pytest.approx(60.0) and s.mtp_layer_us == pytest.approx(72.0)
    lines = projection_report(t, t, accept_lengths=(2.04, 3.0))
    text = "\n".join(lines)
    assert "PROJECTION" in text and "not a measurement" in text
    assert text.count("tok/s/user") == 3
    assert f"SGLang bar {SGLANG_CI_BARS['mtp']:g}" in text
    assert f"SGLang bar {SGLANG_CI_BARS['no_mtp']:g}" in text


# ---- measured collectives (benchmarks/bench_allreduce.py's JSON) -----------------------------
def _measured_json(tmp_path, world=4):
    """A bench_allreduce-shaped result: all-reduce 10 us up to 14 KB then +1 us per 14 KB."""
    d = {"meta": {"world": world, "device": "H200", "backend": "nccl"},
         "allreduce": [{"rows": r, "bytes": r * 14336, "eager_us": 30.0 + r,
                        "graph_us": 10.0 + max(0, r - 1)} for r in (1, 2, 8)],
         "allgather": [{"rows": 1, "bytes": 258560, "eager_us": 40.0, "graph_us": None},
                       {"rows": 4, "bytes": 4 * 258560, "eager_us": 50.0, "graph_us": 20.0}]}
    path = tmp_path / "bench_allreduce.json"
    path.write_text(json.dumps(d))
    return path


def test_measured_link_interpolates_in_bytes(tmp_path):
    link = load_measured_link(_measured_json(tmp_path))
    assert link.measured and link.tp_size == 4 and "H200" in link.name
    assert allreduce_us(14336, 4, link) == pytest.approx(10.0)  # a measured point (graph)
    assert allreduce_us(1.5 * 14336, 4, link) == pytest.approx(10.5)  # halfway 1 -> 2 rows
    assert allreduce_us(100, 4, link) == pytest.approx(10.0)  # below the table: its floor
    # above the table: the slope of the last two points (1 us per 14336 B)
    assert allreduce_us(10 * 14336, 4, link) == pytest.approx(19.0)
    assert allreduce_us(10**9, 1, link) == 0.0  # nothing to reduce at TP 1
    # the graph time is missing for 1 row: the eager one stands in
    assert allgather_us(258560, 4, link) == pytest.approx(40.0)
    assert allgather_us(4 * 258560, 4, link) == pytest.approx(20.0)
    eager = load_measured_link(tmp_path / "bench_allreduce.json", mode="eager")
    assert allreduce_us(14336, 4, eager) == pytest.approx(31.0)
    with pytest.raises(ValueError, match="measured at TP 4"):
        allreduce_us(14336, 2, link)
    with pytest.raises(ValueError):
        load_measured_link(tmp_path / "bench_allreduce.json", mode="nope")
    with pytest.raises(ValueError):
        MeasuredLink("empty", 4, (), ((1, 1.0),))


def test_projection_with_measured_link():
    """A measured table equal to the LAT10 estimate gives the same projection."""
    flat = MeasuredLink("flat", 4, ((0, 10.0), (10**9, 10.0)), ((0, 10.0), (10**9, 10.0)))
    t = ForwardTimes(moe_layer_us=100.0, dense_layer_us=80.0, lm_head_us=50.0,
                     mtp_layer_us=60.0)
    assert target_forward_us(t, 1, 1, link=flat) == target_forward_us(t, 1, 1, link=LAT10)
    assert (project_mtp(t, t, 2.5, link=flat).step_us
            == pytest.approx(project_mtp(t, t, 2.5, link=LAT10).step_us))
    text = "\n".join(projection_report(t, t, accept_lengths=(2.04,), link=flat))
    assert "measured on flat" in text and "range" not in text.split("\n")[0]
    assert "estimated on" in projection_report(t, None)[0]
    # LinkSpec's methods are the module functions' formula
    assert NVLINK4_H200.allreduce_us(14336, 4) == allreduce_us(14336, 4)


# ---- the --cpu-smoke path of benchmarks/bench_layer.py ----------------------------------------
def _load_bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_layer.py"
    spec = importlib.util.spec_from_file_location("bench_layer", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_layer"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("extra", [[], ["--torch-router"]])
def test_bench_layer_cpu_smoke(extra, tmp_path, monkeypatch, capsys):
    bench = _load_bench()
    monkeypatch.setenv("OUT", str(tmp_path))
    result = bench.main(["--cpu-smoke", *extra])
    out = capsys.readouterr().out
    assert "PROJECTION" in out and "ratio" in out
    assert ("--torch-router" in out) == bool(extra)
    rows = result["rows"]
    assert {r["mode"] for r in rows} >= {"DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2"}
    for r in rows:
        for key in ("ours_us", "base_us"):
            assert r[key] > 0 and math.isfinite(r[key]), r
    saved = json.loads((tmp_path / "bench_layer.json").read_text())
    assert len(saved["rows"]) == len(rows)
    assert (tmp_path / "bench_layer.md").exists()
    assert "collectives: estimated" in out and result["projection"]["collectives"] == "estimated"
    # the raw JSON has the shipped data file's format (mla_spec/data/bench_layer_h200.json)
    from mla_spec.viz.layer import load_layer_results

    res = load_layer_results(tmp_path / "bench_layer.json")
    lines = res["projection"]["ours"]["lines"]
    assert set(lines) >= {"no_mtp", "mtp_accept_2.04"} and lines["no_mtp"]["tok_s"] > 0
    assert res["projection_model"]["sglang_ci_bars_tok_s"] == {"no_mtp": 75.0, "mtp": 150.0}


def test_bench_layer_cpu_smoke_measured(tmp_path, monkeypatch, capsys):
    bench = _load_bench()
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    result = bench.main(["--cpu-smoke", "--allreduce-json", str(_measured_json(tmp_path))])
    out = capsys.readouterr().out
    assert "collectives: measured" in out and "measured on H200" in out
    assert result["projection"]["collectives"] == "measured"


def test_bench_layer_legend_only_when_a_row_is_starred():
    bench = _load_bench()
    row = dict(layer="target", mode="DECODE", part="layer", bs=1, ctx=1024, ours_us=110.7,
               base_us=253.2, ratio=2.29, ours_graph=True, base_graph=True)
    assert "timed eagerly" not in bench.tables([row], cuda=True)
    eager = bench.tables([row, {**row, "part": "attn", "base_graph": False}], cuda=True)
    assert "timed eagerly" in eager and "253.2*" in eager
    assert "*" not in bench.tables([{**row, "ours_graph": False}], cuda=False)
