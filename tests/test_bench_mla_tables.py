"""The MLA benchmark scripts' CPU-side pieces: shape parsing and the printed table (what
``bench_mla.py --defaults`` and ``bench_mla_breakdown.py`` write to docs/bench_mla.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
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
            {"shape": "fp8 32x1 8192 bs128", "variant": "W64/sp1", "MB": 603.98, "full": 421.4,
             "split": 423.5}]
    text = bd.table(rows)
    lines = text.splitlines()
    assert lines[0].split("|")[1:-1] == [" shape ", " variant ", " MB ", " full ", " split ",
                                         " combine ", " empty2 ", " fi ", " FI/ours ", " TBps ",
                                         " TFs ", " eager ", " fi_eager "]
    assert "| 2.58 |" in lines[2] and "| 351.50 | 891.00 |" in lines[2]
    assert lines[3].count("| - ") >= 6  # columns a variant row does not have


def test_cta_phase_stamps_find_their_anchors_and_compile():
    """bench_cta_phases inserts timer reads at fixed places of W, WE2 and WR (and, for W, the
    steps of the merge inside the grid: GM_STAMP): every anchor must still be there (a kernel
    edit that moves one fails here, not on the GPU), each phase is stamped once, and with nvcc
    the stamped copy compiles."""
    import os
    import subprocess
    import tempfile

    bp = _load("bench_cta_phases")
    stamps = {  # 12 WE2 phases (5 + it and 7 + wg are two each), 10 WR ones (6 + wg two)
        "WE2": ["st_[0] = st0_", "st_[1] = ", "st_[2] = ", "st_[3] = ", "st_[4] = ",
                "st_[5 + it] = ", "st_[7 + wg] = ", "st_[9] = ", "st_[10] = ", "st_[11] = "],
        "WR": ["st_[0] = st0_", "st_[1] = ", "st_[2] = ", "st_[3] = ", "st_[4] = ",
               "st_[5] = ", "st_[6 + wg] = ", "st_[8] = ", "st_[9] = "],
        "W": ["st_[0] = st0_", "st_[1] = ", "st_[2] = ", "st_[3] = ", "st_[4] = ",
              "st_[5 + it] = ", "st_[9] = ", "st_[10] = ", "st_[11] = ", "st_[12] = ",
              "st_[13] = ", "#define GM_STAMP(i)", "GM_STAMP(4);", "GM_STAMP(5);",
              "GM_STAMP(6);", "GM_STAMP(7);"],
    }
    assert [len(bp.SPECS[k]["phases"]) for k in ("WE2", "WR", "W")] == [12, 10, 14]
    nvcc = os.environ.get("MLA_SPEC_NVCC")
    for kernel, marks in stamps.items():
        src = bp.stamped_source(kernel)
        assert all(src.count(s) == 1 for s in marks), kernel
        if nvcc:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "s.cu")
                with open(path, "w") as f:
                    f.write(src)
                res = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-std=c++17", "-o",
                                      os.path.join(tmp, "s.cubin"), path], capture_output=True,
                                     text=True)
                assert res.returncode == 0, res.stderr[-2000:]


def test_sweep_combine_launch_matches_the_twin_at_every_program_shape():
    """benchmarks/sweep_combine.py launches the combine kernel with a given program shape (on
    the CPU through the Triton interpreter): each must give the twin's result, empty split
    included, for fp32 and bf16 partials."""
    from mla_spec.kernels.mla_decode_combine import combine_splits_ref

    sc = _load("sweep_combine")
    g = torch.Generator().manual_seed(3)
    for dt in (torch.float32, torch.bfloat16):
        part = torch.randn(3, 4, 512, generator=g).to(dt)
        plse = torch.randn(3, 4, generator=g) * 4
        plse[1, 2] = float("-inf")
        want = torch.empty(1, 4, 512)
        combine_splits_ref(part, plse, want)
        for block_d, warps in ((128, 2), (512, 4)):
            out = torch.empty_like(want)
            sc.launch(part, plse, out, block_d, warps)
            assert torch.allclose(out, want, atol=1e-5), (dt, block_d, warps)


def test_ncu_stall_table_parses_the_source_page():
    """ncu_stalls reads ncu's source page (CSV: a kernel-name line, the header, one row per SASS
    instruction with a column per stall reason) into reason shares and the hottest lines."""
    ns = _load("ncu_stalls")
    hdr = ["Address", "Source", ns.SAMPLES, "Warp Stall Sampling (Not-issued Samples)",
           "stall_barrier", "stall_long_sb", "stall_wait", "stall_barrier (Not Issued)"]
    rows = [["0x10", "LDS R22, [R8+0x38020]", "60", "58", "55", "0", "5", "55"],
            ["0x20", "@!P0  BRA 0x7f00", "30", "30", "0", "29", "1", "0"],
            ["0x30", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24", "1,010", "0", "0", "0",
             "1,010", "0"]]
    lines = ['"Kernel Name","mla_wgmma_rows64",', ",".join(f'"{h}"' for h in hdr)]
    lines += [",".join(f'"{c}"' for c in r) for r in rows]
    shares, hot = ns.stall_table("\n".join(lines) + "\n", top=2)
    assert list(shares) == ["wait", "barrier", "long_sb"]
    assert abs(sum(shares.values()) - 1.0) < 1e-9
    assert [h["address"] for h in hot] == ["0x30", "0x10"]
    assert hot[1]["sass"] == "LDS R22, [R8+0x38020]" and hot[1]["reasons"][0] == ("barrier", 55)
    text = ns.report(shares, hot)
    assert "| wait | 92.4% |" in text and "`LDS R22, [R8+0x38020]`" in text


def test_variant_trees_apply_to_this_tree(tmp_path):
    """benchmarks/variant_trees.py patches copies of the kernel sources at fixed anchors: each
    variant must still find its anchors in this tree and change its files, and a moved anchor
    must fail loudly (a silent no-op would time the unchanged tree as the variant)."""
    vt = _load("variant_trees")
    for name, edits in vt.VARIANTS.items():
        d = vt.make_tree(tmp_path, name)
        for fname, _, new in edits:
            assert new in (d / fname).read_text(), (name, fname)
        changed = {f for f, _, _ in edits}
        for f in changed:
            assert (d / f).read_text() != (vt.CSRC / f).read_text(), (name, f)
    src = tmp_path / "moved"
    vt.shutil.copytree(vt.CSRC, src)
    (src / "mla_combine.cu").write_text("// no trigger here\n")
    with pytest.raises(ValueError, match="anchor moved"):
        vt.make_tree(tmp_path / "out", "ec", csrc=src)
