"""The MLA benchmark scripts' CPU-side pieces: shape parsing and the printed table (what
``bench_mla.py --defaults`` and ``bench_mla_breakdown.py`` write to docs/bench_mla.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from mla_spec.quant.fp8 import FP8_DTYPE


def _load(name):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_breakdown_shapes_and_table():
    bd = _load("bench_mla_breakdown")
    assert bd.parse_shapes("fp8:128x4:8192:128,bf16:32x1:4096") == [
        (FP8_DTYPE, 128, 4, 8192, 128), (torch.bfloat16, 32, 1, 4096, 1)]
    rows = [{"shape": "fp8 32x1 8192 bs128", "variant": "W/sp1", "MB": 603.98, "full": 338.0,
             "split": 336.0, "fi": 873.3, "FI/ours": 873.3 / 338.0, "TBps": 1.79, "TFs": 105.4,
             "eager": 351.5, "fi_eager": 891.0},
            {"shape": "fp8 32x1 8192 bs128", "variant": "WR/sp1", "MB": 603.98, "full": 421.4,
             "split": 423.5}]
    text = bd.table(rows)
    lines = text.splitlines()
    assert lines[0].split("|")[1:-1] == [" shape ", " variant ", " MB ", " full ", " split ",
                                         " combine ", " empty2 ", " fi ", " FI/ours ", " TBps ",
                                         " TFs ", " eager ", " fi_eager "]
    assert "| 2.58 |" in lines[2] and "| 351.50 | 891.00 |" in lines[2]
    assert lines[3].count("| - ") >= 6  # columns a variant row does not have
