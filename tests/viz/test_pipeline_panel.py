"""Notebook 06's panel and views on the mock model: only the next phase's button is on, pressing
it runs that phase and redraws, the views show the round's drafts and accept lengths."""

from __future__ import annotations

import re
from types import SimpleNamespace

from mock_runner import build_mock_runner

from mla_spec.config import SpecConfig
from mla_spec.pipeline import PipelineStepper
from mla_spec.viz.pipeline_panel import PipelinePanel, phase_html


def _stepper(version="v1"):
    return PipelineStepper([[5, 6, 7], [1, 2, 3, 4]], max_new_tokens=9,
                           runner=build_mock_runner(), spec=SpecConfig(version=version))


def test_buttons_follow_the_phases():
    st = _stepper()
    panel = PipelinePanel(st)
    assert panel.spec.value == "v1" and panel.tp.value in panel.tp.options
    on = lambda: [p for p, b in panel.buttons.items() if not b.disabled]  # noqa: E731
    for phase in ["prefill", "draft", "verify", "accept", "draft_extend", "draft"]:
        assert on() == [phase], (phase, panel.status.value)
        panel.buttons[phase].click()
    assert re.search(r"round 1 · phases run 6 · next: <b>verify</b>", panel.status.value)
    st.step()  # code that steps the same stepper redraws the panel
    assert "next: <b>accept</b>" in panel.status.value
    panel.end_button.click()
    assert on() == [] and "next: <b>finished</b>" in panel.status.value
    panel.close_button.click()
    assert st.closed and panel.close_button.disabled


def test_views_show_drafts_accepts_pages_and_shapes():
    st = _stepper("v2")
    st.engine.runner.target.config = SimpleNamespace(num_attention_heads=4, kv_lora_rank=512,
                                                     qk_rope_head_dim=64)
    assert "no phase run yet" in phase_html(st)
    st.step()
    html = phase_html(st)
    assert "target EXTEND" in html and "draft EXTEND" in html and "KV pages" in html
    st.step()
    html = phase_html(st)
    assert "draft DECODE x2" in html and "1 + 1 rows" in html
    assert "planned for a later phase: target TARGET_VERIFY (8 rows), draft DRAFT_EXTEND_V2" in html
    st.step()  # verify: rank 0 holds all 4 heads at TP 1
    assert "<td>0</td><td>0..3 of 4</td><td>q [8, 4, 576] -> out [8, 4, 512]" in phase_html(st)
    st.step()
    html = phase_html(st)
    assert html.count("class='d'") == 0 and ("class='ok'" in html or "class='no'" in html)
    assert html.count("class='bonus'") == 2  # one bonus token a request
