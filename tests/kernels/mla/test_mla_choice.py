"""The kernel choice (``mla_spec.kernels.mla.choice``): the variants table, the measured
defaults and their alternatives per device, and the split cost model (``splits``)."""

from __future__ import annotations

import pytest
import torch

from mla_spec.kernels.mla import (
    PAGED_CONTEXT_DEFAULTS,
    PAGED_DEFAULTS,
    PAGED_VARIANTS,
    VARIANTS,
    PagedConfig,
    context_class,
    paged_choice,
    parse_choice,
    pick_num_splits_paged,
    shape_class,
    splits_for,
    variant_name,
)
from mla_spec.kernels.mla import choice as mt
from mla_spec.quant.fp8 import FP8_DTYPE


def test_every_variant_is_one_line_and_a_default_names_it():
    """The table names what each variant is in one line, and only variants some default picks
    are in it (the others were deleted: a variant nothing picks is dead code)."""
    named = {a.split("/")[0] for table in (PAGED_DEFAULTS, PAGED_CONTEXT_DEFAULTS)
             for v in table.values() for a in v.split("|")}
    assert named == set(VARIANTS)
    for name, (about, cfg) in VARIANTS.items():
        assert isinstance(cfg, PagedConfig) and PAGED_VARIANTS[name] is cfg
        assert about and "\n" not in about and len(about) <= 90, name
        assert variant_name(cfg) == name
    assert variant_name(PagedConfig(16, 8, 4, 1)) is None


def test_configs_refuse_what_no_kernel_takes():
    with pytest.raises(ValueError, match="wgmma"):
        PagedConfig(32, 32, 8, 2, cuda=True, wgmma=True)  # block_n 32
    with pytest.raises(ValueError, match="wgmma"):
        PagedConfig(32, 64, 8, 2, cuda=True, wgmma=True, rows_m=True)  # rows_m needs 64 rows
    with pytest.raises(ValueError, match="wgmma"):
        PagedConfig(64, 64, 8, 2, cuda=True, wgmma=True, e4m3_mma=True)
    with pytest.raises(ValueError, match="e4m3_pv is an option"):
        PagedConfig(32, 64, 8, 2, cuda=True, wgmma=True, e4m3_pv=True)
    with pytest.raises(ValueError, match="options of the wgmma kernels"):
        PagedConfig(32, 64, 4, 2, cuda=True, e4m3_mma=True)
    with pytest.raises(ValueError, match="own tile"):
        PagedConfig(32, 64, 4, 2, cuda=True, tma=True)


def test_split_cost_model():
    # batch 1: about two KV tiles per split at 4k, one at 1k, 8 at 32k (the H200 sweep's
    # winners, 2026-11-29, docs/bench_mla.md); big batches: no split
    assert pick_num_splits_paged(1, 2, 4096, 64, 32, 1152) == 32
    assert pick_num_splits_paged(1, 2, 1024, 64, 32, 1152) == 16
    assert pick_num_splits_paged(1, 2, 32768, 64, 32, 1152) == 64
    # G4 (4 siblings per row block) keeps two programs per SM: 64 splits are still one wave
    assert splits_for(PAGED_VARIANTS["G4"], 1, 1, 32768, 32, 576) == 64
    assert pick_num_splits_paged(1, 1, 32768, 64, 32, 576, vsplit=4) == 32
    assert pick_num_splits_paged(128, 1, 8192, 64, 32, 1152) == 1
    assert pick_num_splits_paged(32, 1, 4096, 64, 32, 1152) == 4
    assert pick_num_splits_paged(1, 1, 0, 64, 32, 1152) == 1


def test_defaults_table_and_choice_strings():
    assert all(parse_choice(a)[0] is PAGED_VARIANTS[a.split("/")[0]]
               for v in PAGED_DEFAULTS.values() for a in v.split("|"))
    # a class entry ends with a Triton variant (it must run everywhere)
    assert not any(parse_choice(v.split("|")[-1])[0].cuda for v in PAGED_DEFAULTS.values())
    assert parse_choice("G4/sp16") == (PAGED_VARIANTS["G4"], 16)
    with pytest.raises(ValueError, match="unknown paged variant"):
        parse_choice("nope")
    assert shape_class(32, torch.bfloat16, 1) == ("bf16", "r32", "b1")
    assert shape_class(512, FP8_DTYPE, 64) == ("fp8", "big", "big")
    cpu_cfg, sp = paged_choice(32, torch.bfloat16, torch.device("cpu"), 8, 1)
    assert sp is None and not cpu_cfg.sibling_kernel
    # V-split multiplies the programs: fewer splits for the same batch-1 shape
    assert pick_num_splits_paged(1, 1, 4096, 64, 32, 1152, vsplit=4) < 64


def test_context_axis_overrides_the_class():
    """TARGET_VERIFY at batch 1 (128 rows): the winner changes with the context; without
    ``max_kv`` (or outside the table) the class default holds."""
    cuda = torch.device("cuda")  # only the device type is read
    assert [context_class(n) for n in (0, 2048, 2049, 8192, 8193)] == \
        ["c2k", "c2k", "c8k", "c8k", "long"]
    assert all(parse_choice(a)[0] is PAGED_VARIANTS[a.split("/")[0]]
               for v in PAGED_CONTEXT_DEFAULTS.values() for a in v.split("|"))
    pick = lambda kv, ctx: paged_choice(128, kv, cuda, 64, 1, ctx)[0]  # noqa: E731
    assert pick(FP8_DTYPE, 1000) is PAGED_VARIANTS["G4"]
    assert pick(FP8_DTYPE, 4096) is PAGED_VARIANTS["G4"]
    assert pick(FP8_DTYPE, 32768) is pick(FP8_DTYPE, None) is \
        parse_choice(PAGED_DEFAULTS[("fp8", "r128", "b1")])[0]
    assert pick(torch.bfloat16, 32768) in (PAGED_VARIANTS["WR"], PAGED_VARIANTS["CF"])
    assert pick(torch.bfloat16, 4096) is PAGED_VARIANTS["S16"]
    # other classes ignore the context (W where the wgmma kernel runs)
    assert paged_choice(32, torch.bfloat16, cuda, 64, 32, 32768)[0] in \
        (PAGED_VARIANTS["W"], PAGED_VARIANTS["S16"])
    # the 32-row batch-1 class: 64 one-tile splits up to 8k, the model's count at 1k
    assert paged_choice(32, torch.bfloat16, cuda, 64, 1, 4096) == (PAGED_VARIANTS["S16"], 64)
    assert paged_choice(32, torch.bfloat16, cuda, 64, 1, 1024) == (PAGED_VARIANTS["S16"], None)


def test_cuda_kernel_entries_fall_back_where_it_cannot_run(monkeypatch):
    """A CUDA-kernel alternative (``K`` / ``W*``) applies only with fixed rows, a cache it
    takes (bf16; fp8 for ``W*``), the kernels available and (``W*``) sm_90; else the next
    alternative, and for a context entry none of whose alternatives runs, the class entry."""
    cuda = torch.device("cuda")  # only the device type is read (availability is patched)
    cap = {"v": (9, 0)}
    monkeypatch.setattr(mt, "cuda_capability", lambda dev: cap["v"])
    monkeypatch.setattr(mt, "cuda_kernels_available", lambda dev: None)
    V = mt.PAGED_VARIANTS
    # the 32-row large-batch class: W on sm_90, its Triton alternative elsewhere
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 128, 8192) == (V["W"], None)
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 128, 8192, fixed=False) == \
        (V["S32w4"], None)
    assert mt.paged_choice(32, torch.float16, cuda, 64, 128, 8192) == (V["S32w4"], None)
    # the 32-row batch-1 long-context entry: W, then K (sm_100 has no wgmma), then the class
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 1, 32768) == (V["W"], 128)
    cap["v"] = (10, 0)
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 1, 32768) == (V["K"], 128)
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 128, 8192) == (V["S32w4"], None)
    assert mt.paged_choice(128, torch.bfloat16, cuda, 64, 1, 32768) == (V["CF"], None)
    cap["v"] = (9, 0)
    assert mt.paged_choice(128, torch.bfloat16, cuda, 64, 1, 32768) == (V["WR"], 64)
    assert mt.paged_choice(128, torch.bfloat16, cuda, 64, 32, 4096) == (V["WR"], None)
    # more than 128 rows (H 128 q 4): WR for bf16 and e4m3
    assert mt.paged_choice(512, torch.bfloat16, cuda, 64, 32, 4096) == (V["WR"], None)
    assert mt.paged_choice(512, torch.bfloat16, cuda, 64, 1, 32768) == (V["WR"], 16)
    assert mt.paged_choice(512, torch.bfloat16, cuda, 64, 1, 4096) == (V["WR"], 16)
    assert mt.paged_choice(512, FP8_DTYPE, cuda, 64, 1, 4096) == (V["WR"], 16)
    assert mt.paged_choice(512, torch.bfloat16, cuda, 64, 1, 1024) == (V["WR"], None)
    assert mt.paged_choice(512, FP8_DTYPE, cuda, 64, 1, 32768) == (V["WR"], 16)
    assert mt.paged_choice(512, FP8_DTYPE, cuda, 64, 1, 2048) == (V["WR"], None)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 1024) == (V["WE8"], None)
    cap["v"] = (10, 0)  # no wgmma: the Triton fallbacks
    assert mt.paged_choice(512, torch.bfloat16, cuda, 64, 1, 1024) == (V["C"], None)
    assert mt.paged_choice(512, FP8_DTYPE, cuda, 64, 1, 32768) == (V["CF"], None)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 1024) == (V["G4"], None)
    cap["v"] = (9, 0)
    assert mt.paged_choice(512, FP8_DTYPE, cuda, 64, 32, 4096) == (V["WR"], None)
    assert mt.paged_choice(128, FP8_DTYPE, cuda, 64, 32, 4096) == (V["WR"], None)
    # an e4m3 cache: the wgmma kernels on sm_90 (not the mma.sync K*), Triton elsewhere
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 128, 8192) == (V["WE8"], None)
    # the softmax weights kept in fp16 on request: WE2; the queries too: the e4m3-MMA kernels
    # are passed over
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 128, 8192, e4m3_probs=False) == \
        (V["WE2"], None)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 128, 8192, e4m3_queries=False) == \
        (V["W"], None)
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 128, 8192, e4m3_queries=False) == \
        (V["W"], None)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 32768) == (V["WE8"], 128)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 32768, e4m3_probs=False) == \
        (V["WE2"], 128)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 32768, e4m3_queries=False) == \
        (V["W"], 128)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 4096) == (V["WE8"], 32)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 4096, e4m3_queries=False) == \
        (V["G4"], None)  # the class entry: no context alternative runs
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 1024, e4m3_queries=False) == \
        (V["G4"], None)
    assert mt.paged_choice(128, FP8_DTYPE, cuda, 64, 1, 4096) == (V["WR"], 64)
    assert not mt.cuda_cache_ok(V["K"], FP8_DTYPE) and mt.cuda_cache_ok(V["WR"], FP8_DTYPE)
    assert not mt.cuda_cache_ok(V["WE2"], torch.bfloat16)
    cap["v"] = (10, 0)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 128, 8192) == (V["CF"], None)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 32768) == (V["G4"], None)
    base = mt.parse_choice(mt.PAGED_DEFAULTS[("bf16", "r32", "b1")])
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 1, 32768, fixed=False) == base
    monkeypatch.setattr(mt, "cuda_kernels_available", lambda dev: "nvcc not found")
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 1, 32768) == base
