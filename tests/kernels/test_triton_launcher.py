"""The cached Triton relauncher keys a binary by all Triton specializes on: a call that would
compile another binary (a dtype, a pointer's 16-byte alignment, an int scalar equal to 1 or a
multiple of 16, a constexpr, the launch options) never reuses a cached one."""

from __future__ import annotations

import torch

from mla_spec.kernels.launch.triton_launcher import TritonLauncher


def _keys(calls, monkeypatch) -> list:
    """The key ``launch`` derives for each call (the launch itself recorded, not run)."""
    seen = []
    monkeypatch.setattr(TritonLauncher, "__call__",
                        lambda self, grid, key, *a, **k: seen.append(key))
    launcher = TritonLauncher(fn=None)
    for tensors, scalars, constexprs, warps, options in calls:
        launcher.launch((1,), tensors, scalars, constexprs, warps, options)
    return seen


def test_the_key_changes_with_every_specialization(monkeypatch):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=g)
    odd = torch.randn(65, generator=g)[1:]  # 4 bytes past a 16-byte boundary
    args = [
        ((base,), (32, 0.5), (64, True), 4, {"num_stages": 2}),
        ((base,), (48, 0.25), (64, True), 4, {"num_stages": 2}),  # same specialization
        ((odd,), (32, 0.5), (64, True), 4, {"num_stages": 2}),  # misaligned pointer
        ((base.half(),), (32, 0.5), (64, True), 4, {"num_stages": 2}),  # dtype
        ((base,), (1, 0.5), (64, True), 4, {"num_stages": 2}),  # int == 1
        ((base,), (33, 0.5), (64, True), 4, {"num_stages": 2}),  # int not % 16
        ((base,), (32, 0.5), (32, True), 4, {"num_stages": 2}),  # constexpr
        ((base,), (32, 0.5), (64, False), 4, {"num_stages": 2}),  # constexpr bool
        ((base,), (32, 0.5), (64, True), 8, {"num_stages": 2}),  # warps
        ((base,), (32, 0.5), (64, True), 4, {"num_stages": 3}),  # options
    ]
    keys = _keys(args, monkeypatch)
    assert keys[0] == keys[1]
    assert len(set(keys)) == len(keys) - 1


def test_the_relauncher_runs_the_cached_binary_with_new_pointers(monkeypatch):
    """``relauncher``: the binary ``launch`` cached, relaunched with other pointers and scalars
    and no key work; the normal launch again once a launch hook is set."""
    import mla_spec.kernels.launch.triton_launcher as tlm

    runs = []
    launcher = TritonLauncher(fn=None)
    a, b = torch.randn(64), torch.randn(64)
    args = ((2, 3), (a,), (32, 0.5), (64, True), 4, None)
    assert launcher.relauncher(*args) is None  # nothing cached yet
    launcher.binaries[TritonLauncher._key(*args[1:])] = (
        lambda *r: runs.append(r), "function", "metadata")
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 7, raising=False)
    monkeypatch.setattr(tlm, "hooks_unset", lambda: True)
    go = launcher.relauncher(*args)
    assert go((b.data_ptr(),), (48, 0.25))
    assert runs == [(2, 3, 1, 7, "function", "metadata", None, None, None, b.data_ptr(), 48, 0.25,
                     64, True)]
    monkeypatch.setattr(tlm, "hooks_unset", lambda: False)  # e.g. a profiler's hook
    assert not go((b.data_ptr(),), (48, 0.25)) and len(runs) == 1
