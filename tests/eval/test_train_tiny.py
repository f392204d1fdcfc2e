"""``scripts/train_tiny.py``'s band logic and its two phases, with a scripted serving evaluation.

The real trainer runs on a GPU; here a small model trains for a few CPU steps while the
evaluation's scores come from a script, so every branch of the control flow runs: phase 1 stops
when the accuracy reaches the middle band, phase 2 re-initializes a too-good draft, steps back
when an evaluation jumps past the band, and the export takes the evaluated bits in the bands;
a failure still writes the best checkpoint so far.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


tt = _load("train_tiny")
te = sys.modules["train_tiny_eval"]
TC = tt.TrainConfig()


def test_bands_and_choice():
    assert te.in_band(0.92, 3.0, TC, mid=True) and te.in_band(0.88, 2.5, TC)
    assert not te.in_band(0.89, 3.0, TC, mid=True) and not te.in_band(0.92, None, TC)
    assert not te.in_band(0.98, 3.0, TC) and not te.in_band(0.92, 3.5, TC)
    assert te.band_distance(0.93, 2.9, TC) == 0.0
    assert te.band_distance(0.99, 2.9, TC) > te.band_distance(0.96, 2.9, TC) > 0
    assert te.band_distance(0.93, None, TC) == 1.0
    rows = [dict(index=0, accuracy=0.99, accept=2.9, dir="a"),
            dict(index=1, accuracy=0.89, accept=3.35, dir="b"),   # in band, not mid
            dict(index=2, accuracy=0.93, accept=3.0, dir=None),   # pruned: not exportable
            dict(index=3, accuracy=0.96, accept=2.6, dir="d")]    # in band, nearer the middle
    assert te.best_row(rows, TC)["index"] == 3
    assert te.best_row(rows[:2], TC)["index"] == 1  # in band beats nearer but outside
    assert te.best_row([], TC) is None


TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, kv_lora_rank=64,
            q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
RUN = dict(steps=12, batch=2, seq_len=48, warmup=2, eval_every=4, num_train_problems=300,
           calib_windows=1, mtp_steps=12, mtp_eval_every=3, time_budget_min=0.0,
           eval_questions=4)


@pytest.fixture
def scripted(monkeypatch):
    """Scripted (accuracy, accept) per serving call; the model is tiny."""
    monkeypatch.setattr(tt, "MODEL_CONFIG", {**tt.MODEL_CONFIG, **TINY})
    calls = []

    def install(scores):
        def serve(self, path, k_shots, n=None):
            i = len(calls)
            calls.append((Path(path), k_shots))
            if isinstance(scores[i], Exception):
                raise scores[i]
            acc, accept = scores[i]
            return SimpleNamespace(accuracy=acc, avg_accept_length=accept, invalid=0.0,
                                   num_questions=4)
        monkeypatch.setattr(te.Evaluator, "serve", serve)
        return calls
    return install


def test_two_phases_land_in_the_middle_bands(scripted, tmp_path):
    calls = scripted([(0.10, 1.5), (0.50, 3.6), (0.93, 3.8),      # phase 1: stops at 0.93
                      (0.93, 2.0), (0.93, 3.5), (0.93, 2.9),      # phase 2: past, back, in
                      (0.92, 2.8), (0.93, 2.9)])                  # final 1- and 2-shot checks
    out = tmp_path / "out"
    summary = tt.train(tt.TrainConfig(**RUN), out, torch.device("cpu"))
    rows = summary["evaluations"]
    assert [(r["phase"], r["step"]) for r in rows] == [
        (1, 4), (1, 8), (1, 12), (2, 3), (2, 6), (2, 8)]
    assert summary["mtp_reinit"] is True
    assert summary["exported"]["index"] == 5 and summary["exported"]["accept"] == 2.9
    assert rows[5]["lr"] == pytest.approx(TC.mtp_lr / 4)  # slower after stepping back
    assert [k for _, k in calls[-2:]] == [1, 2] and calls[-1][0] == out
    saved = json.loads((out / "training_config.json").read_text())
    assert saved["final_checks"]["2-shot, 4 questions"]["accept"] == 2.9
    assert "dir" not in saved["exported"]
    card = (out / "README.md").read_text()
    assert "| 2 | 8 (exported) | 0.930 | 2.900 |" in card and "self_attn.k_scale" in card
    for f in ("config.json", "hf_quant_config.json", "tokenizer.json", "model.safetensors"):
        assert (out / f).exists()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        n = tt.MODEL_CONFIG["num_hidden_layers"]
        ks = [f.get_tensor(f"model.layers.{i}.self_attn.k_scale").item() for i in range(n + 1)]
    assert ks == pytest.approx([float(v) for v in summary["exported"]["kv_scales"].values()])
    assert all(0 < k < 0.5 for k in ks)


def test_a_failure_still_writes_the_best_checkpoint(scripted, tmp_path):
    scripted([(0.10, 1.5), (0.91, 3.0), RuntimeError("device lost")])
    out = tmp_path / "out"
    cfg = tt.TrainConfig(**{**RUN, "acc_mid_min": 0.99})  # phase 1 goes on to a third eval
    with pytest.raises(RuntimeError, match="device lost"):
        tt.train(cfg, out, torch.device("cpu"))
    saved = json.loads((out / "training_config.json").read_text())
    assert saved["error"] == "RuntimeError: device lost"
    assert saved["exported"]["index"] == 1 and (out / "model.safetensors").exists()
