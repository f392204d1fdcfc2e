"""PipelineStepper: a round phase by phase gives exactly what Engine.step gives in one go (tokens,
accept lengths, forwards, metrics), at TP 1 on the mock model and at TP 2 on gloo; the ranks wait
on their queues between phases and stop on close() or when the stepper is collected."""

from __future__ import annotations

import gc
import time

import pytest
from mock_runner import build_mock_runner, mock_greedy_reference

from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.engine import Engine
from mla_spec.forward_mode import ForwardMode as M
from mla_spec.pipeline import PipelineStepper

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [3]]
ROUND = ["draft", "verify", "accept", "draft_extend"]


def _spec(version: str) -> SpecConfig:
    return SpecConfig.off() if version == "off" else SpecConfig(version=version)


@pytest.mark.parametrize("version", ["off", "v1", "v2"])
def test_phases_equal_engine_steps(version):
    st = PipelineStepper(PROMPTS, max_new_tokens=11, runner=build_mock_runner(),
                         spec=_spec(version))
    recs = st.run_to_end()
    assert [r.output_ids for r in st.requests] == [mock_greedy_reference(p, 11) for p in PROMPTS]
    eng = Engine(runner=build_mock_runner(), spec=_spec(version))
    eng.generate(PROMPTS, max_new_tokens=11)
    mine, ref = st.engine.metrics.steps, eng.metrics.steps
    assert [(s.kind, s.batch_size, s.new_tokens, s.accept_lengths) for s in mine] == \
        [(s.kind, s.batch_size, s.new_tokens, s.accept_lengths) for s in ref]
    assert [[(f.model, f.mode, f.rows) for f in s.forwards] for s in mine] == \
        [[(f.model, f.mode, f.rows) for f in s.forwards] for s in ref]
    phases = [r.phase for r in recs]
    body = ["decode"] if version == "off" else ROUND
    assert phases == ["prefill"] + body * st.rounds and st.rounds == len(ref) - 1
    assert st.next_phase is None and st.step() is None
    # every forward comes with its batch; rows per request as the algorithm says
    for r in recs:
        assert [(w, b.forward_mode) for w, b in r.batches] == [(f.model, f.mode)
                                                               for f in r.forwards]
        for _, b in r.batches:
            if b.forward_mode in (M.TARGET_VERIFY, M.DRAFT_EXTEND_V2):
                assert b.seq_lens_q_cpu == [4] * len(r.rows)
            if b.forward_mode == M.DRAFT_EXTEND:
                assert b.seq_lens_q_cpu == [st.engine.metrics.steps[r.round + 1]
                                            .accept_lengths[i] for i in range(len(r.rows))]
    if version == "v2":  # the verify and draft-extend batches are planned in the draft phase
        draft = next(r for r in recs if r.phase == "draft")
        assert [b.forward_mode for _, b in draft.planned] == [M.TARGET_VERIFY, M.DRAFT_EXTEND_V2]


def test_state_between_phases():
    st = PipelineStepper(PROMPTS[:2], max_new_tokens=9, runner=build_mock_runner(),
                         spec=SpecConfig(version="v2"))
    assert st.next_phase == "prefill" and all(r.pages for r in st.requests)  # scheduled
    st.step()
    assert st.next_phase == "draft"
    drafts = st.step()
    assert drafts.round == 0 and sorted(st.drafts) == [r.rid for r in st.requests]
    assert all(len(d) == 3 for d in st.drafts.values()) and not st.accept
    st.step()
    assert all(len(p) == 4 for p in st.predict.values())
    before = [len(r.output_ids) for r in st.requests]
    st.step()  # accept: nothing committed yet
    assert [len(r.output_ids) for r in st.requests] == before
    for rid, a in st.accept.items():
        d, p = st.drafts[rid], st.predict[rid]
        assert 1 <= a <= 4 and d[: a - 1] == p[: a - 1] and (a == 4 or d[a - 1] != p[a - 1])
    st.step()  # draft extend: committed
    assert [len(r.output_ids) for r in st.requests] == [b + st.accept[r.rid] for b, r in
                                                        zip(before, st.requests)]
    assert st.rounds == 1 and st.next_phase == "draft"
    assert [r.phase for r in st.run_round()] == ROUND and st.rounds == 2


def test_tp2_gloo_pauses_between_phases_and_closes():
    from mla_spec.data import EMBEDDED_MODEL

    kw = dict(spec=SpecConfig(version="v1"), cache=CacheConfig(page_size=16, kv_dtype="fp8_e4m3"),
              max_reqs=4, max_context_len=128)
    prompts = ["Question: Tom has 12 apples and buys 7 more. How many apples does he have?\n"
               "Answer:", "Question: Ava has 9 coins. She finds 4 more. How many coins?\nAnswer:"]
    tp1 = Engine(EMBEDDED_MODEL, **kw)
    ref = tp1.generate(prompts, max_new_tokens=6)
    st = PipelineStepper(prompts, max_new_tokens=6, tp_size=2, **kw)
    procs = st.engine.workers.processes
    for phase in ["prefill", *ROUND]:
        assert st.step().phase == phase
        time.sleep(0.2)  # a reader's pause: the other rank waits on its queue
    st.run_to_end()
    assert [r.output_ids for r in st.requests] == [r.output_ids for r in ref]
    assert st.engine.metrics.accept_lengths == tp1.metrics.accept_lengths
    st.close()
    st.close()
    assert st.closed and st.next_phase is None and not any(p.is_alive() for p in procs)
    # a stepper nobody holds stops its ranks too
    st = PipelineStepper(prompts[:1], max_new_tokens=2, tp_size=2, **kw)
    procs = st.engine.workers.processes
    st.step()
    del st
    gc.collect()
    assert not any(p.is_alive() for p in procs)
