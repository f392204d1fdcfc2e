"""The speculative loop against the mock target / draft: greedy accept, lossless, v1 == v2."""

from __future__ import annotations

import pytest
import torch
from mock_runner import build_mock_runner, mock_greedy_reference

from mla_spec.config import SpecConfig
from mla_spec.engine import Engine
from mla_spec.forward_mode import ForwardMode
from mla_spec.kernels.ops.step_glue import greedy_accept

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [3], [10, 20, 30, 40, 50, 60]]


def test_greedy_accept_counts_leading_matches_plus_bonus():
    predict = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [9, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [1, 2, 9], [1, 2, 3]])
    assert greedy_accept(predict, drafts).tolist() == [4, 2, 3, 1]
    # a match after the first mismatch does not count
    assert greedy_accept(torch.tensor([[5, 6]]), torch.tensor([[4]])).tolist() == [1]


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("num_steps", [1, 3])
def test_spec_is_lossless_on_mock(version, num_steps):
    spec = SpecConfig(num_steps=num_steps, num_draft_tokens=num_steps + 1, version=version)
    eng = Engine(runner=build_mock_runner(), spec=spec)
    res = eng.generate(PROMPTS, max_new_tokens=17)
    for p, r in zip(PROMPTS, res):
        assert r.output_ids == mock_greedy_reference(p, 17)
        assert r.finished_reason == "length"
        assert all(1 <= a <= num_steps + 1 for a in r.accept_lengths)
    # the mock draft is right most of the time but not always
    acc = eng.metrics.accept_lengths
    if num_steps == 3:
        assert 1.2 < eng.avg_accept_length < 4.0 and min(acc) < max(acc)
    assert eng.avg_accept_length == pytest.approx(sum(acc) / len(acc))


def _mode_sequence(eng):
    return [(f.model, f.mode, f.rows) for s in eng.metrics.steps for f in s.forwards]


def test_forward_modes_of_a_round():
    eng = Engine(runner=build_mock_runner(), spec=SpecConfig(version="v2"))
    eng.add_request([1, 2, 3, 4], max_new_tokens=30)
    eng.step()  # prefill
    eng.step()  # one round
    seq = _mode_sequence(eng)
    assert seq == [
        ("target", ForwardMode.EXTEND, 4), ("draft", ForwardMode.EXTEND, 4),
        ("draft", ForwardMode.DECODE, 1), ("draft", ForwardMode.DECODE, 1),
        ("target", ForwardMode.TARGET_VERIFY, 4), ("draft", ForwardMode.DRAFT_EXTEND_V2, 4),
    ]
    eng1 = Engine(runner=build_mock_runner(), spec=SpecConfig(version="v1"))
    eng1.add_request([1, 2, 3, 4], max_new_tokens=30)
    eng1.step()
    rec = eng1.step()
    de = [f for f in rec.forwards if f.mode.is_draft_extend()]
    assert len(de) == 1 and de[0].rows == rec.accept_lengths[0]


def test_v1_and_v2_give_the_same_drafts():
    """Draft tokens of every round (and so accept lengths) agree between v1 and v2."""
    hist = {}
    for version in ("v1", "v2"):
        eng = Engine(runner=build_mock_runner(), spec=SpecConfig(version=version))
        for p in PROMPTS:
            eng.add_request(p, max_new_tokens=25)
        drafts = []
        while eng.scheduler.has_work:
            rec = eng.step()
            if rec.kind == "spec":
                drafts.append(eng.worker.last_drafts.tolist())
        hist[version] = (drafts, [s.accept_lengths for s in eng.metrics.steps])
    assert hist["v1"] == hist["v2"]
    assert len(hist["v1"][0]) > 3


def test_spec_needs_a_draft_model():
    runner = build_mock_runner()
    runner.draft = None
    with pytest.raises(ValueError, match="MTP draft model"):
        Engine(runner=runner, spec=SpecConfig())


# ---- GPU: the v2 region never synchronizes; CUDA-graph replay equals eager ----------------------
@pytest.mark.gpu
def test_v2_verify_to_next_draft_makes_no_host_sync():
    eng = Engine(runner=build_mock_runner(device="cuda"), spec=SpecConfig(version="v2"),
                 cuda_graph=False)
    eng.worker.check_no_sync = True  # set_sync_debug_mode("error") around verify..draft extend
    res = eng.generate(PROMPTS, max_new_tokens=17)
    for p, r in zip(PROMPTS, res):
        assert r.output_ids == mock_greedy_reference(p, 17)
    # the same check catches v1's accept-length copy
    eng1 = Engine(runner=build_mock_runner(device="cuda"), spec=SpecConfig(version="v1"),
                  cuda_graph=False)
    req = eng1.add_request(PROMPTS[0], max_new_tokens=8)
    eng1.step()
    from mla_spec.spec.eagle import no_host_sync

    with no_host_sync():  # the engine fails the step (TP 1 keeps serving) and says why
        rec = eng1.step()
    assert rec.kind == "error"
    assert req.finished_reason == "error" and "synchroniz" in req.error


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["off", "v1", "v2"])
def test_cuda_graph_replay_equals_eager(version):
    spec = SpecConfig.off() if version == "off" else SpecConfig(version=version)
    outs = {}
    for graph in (False, True):
        eng = Engine(runner=build_mock_runner(device="cuda"), spec=spec, cuda_graph=graph,
                     graph_batch_sizes=(1, 2, 4, 8))
        outs[graph] = [r.output_ids for r in eng.generate(PROMPTS, max_new_tokens=17)]
        if graph:
            g = eng.runner.graphs
            assert g.disabled_reason is None, g.disabled_reason
            used = {(f.model, f.mode) for s in eng.metrics.steps for f in s.forwards if f.graph}
            want = {("target", ForwardMode.TARGET_VERIFY), ("draft", ForwardMode.DECODE)}
            if version == "off":
                want = {("target", ForwardMode.DECODE)}
            if version != "off":  # the whole round is one graph (runtime/step_graph.py)
                want = {("round", ForwardMode.TARGET_VERIFY)}
            assert want <= used
    assert outs[True] == outs[False]
    assert outs[True] == [mock_greedy_reference(p, 17) for p in PROMPTS]


def test_cuda_graphs_need_a_gpu():
    from mla_spec.runtime.cuda_graph import CudaGraphRunner

    eng = Engine(runner=build_mock_runner(), spec=SpecConfig(), cuda_graph=False)
    g = CudaGraphRunner.capture(eng.runner, eng.worker)
    assert not g.graphs and "GPU" in g.disabled_reason
    with pytest.raises(ValueError, match="CUDA device"):
        Engine(runner=build_mock_runner(), spec=SpecConfig(), cuda_graph=True)
