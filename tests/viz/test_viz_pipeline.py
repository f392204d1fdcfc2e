"""The recorded end-to-end table's ratios (``viz.pipeline.recorded_e2e_ratios``) on a made-up
record, and the shipped record's shape (every batch size has spec off, v1 and v2)."""

import pytest

pytest.importorskip("plotly")

from mla_spec.viz.pipeline import read_recorded_e2e, recorded_e2e_ratios  # noqa: E402


def _rows(off, v2, dec_off, dec_v2, bs=1, acc=2.5):
    return [{"bs": bs, "spec": "off", "tokens_per_s": off, "decode_tokens_per_s": dec_off,
             "avg_accept": None},
            {"bs": bs, "spec": "v2", "tokens_per_s": v2, "decode_tokens_per_s": dec_v2,
             "avg_accept": acc}]


def test_ratios_of_a_made_up_record():
    rec = {"rows": _rows(100.0, 150.0, 200.0, 240.0) + _rows(1000.0, 900.0, 10.0, 13.0, bs=32),
           "gpu_graph_us": {"command": "x", "1": {"decode_step": 100.0, "v2_round": 200.0}},
           "other_runs": [{"rows": _rows(10.0, 8.0, 1.0, 1.0)}, {"rows": _rows(10.0, 12.0, 1, 1)}]}
    r = recorded_e2e_ratios(rec)
    assert r["e2e"] == {1: 1.5, 32: 0.9} and r["decode"] == {1: 1.2, 32: 1.3}
    assert r["gpu"] == {1: 1.25}  # 2.5 tokens a round, a round = 2 plain steps
    assert r["other_e2e"] == {1: [0.8, 1.2]}


def test_the_shipped_record_has_every_setting():
    rec = read_recorded_e2e()
    for rows in [rec["rows"]] + [o["rows"] for o in rec["other_runs"]]:
        assert {(r["bs"], r["spec"]) for r in rows} == {(b, s) for b in (1, 32)
                                                        for s in ("off", "v1", "v2")}
    r = recorded_e2e_ratios(rec)
    assert set(r["gpu"]) == {1, 32} and all(1.0 < v < 1.48 for v in r["gpu"].values())
