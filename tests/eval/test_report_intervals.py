"""95% intervals of an EvalReport (Wilson, bootstrap over questions) and configuration keys."""

from __future__ import annotations

import pytest

from mla_spec.eval.report import EvalReport, wilson_interval
from mla_spec.eval.sweep import EvalConfig


def test_wilson_interval_known_values_and_edges():
    lo, hi = wilson_interval(185, 200)  # textbook value: 0.8800 .. 0.9540
    assert (round(lo, 4), round(hi, 4)) == (0.8800, 0.9540)
    assert wilson_interval(0, 7)[0] == 0.0 and 0 < wilson_interval(0, 7)[1] < 0.5
    assert wilson_interval(7, 7)[1] == 1.0 and 0.5 < wilson_interval(7, 7)[0] < 1
    assert wilson_interval(1, 1) != wilson_interval(1000, 1000)  # narrows with n
    with pytest.raises(ValueError, match="at least one"):
        wilson_interval(0, 0)


def _report(accepts, steps):
    return EvalReport("r", len(steps), 2, 0.5, 0.0, sum(accepts) / len(accepts), 10, 1.0,
                      accept_lengths=tuple(accepts), accept_steps=tuple(steps))


def test_accept_interval_bootstraps_questions():
    # 3 questions: 5 steps of 4, 1 step of 1, 3 steps of 2 (the mean is per verify step)
    rep = _report([4] * 5 + [1] + [2] * 3, [5, 1, 3])
    lo, hi = rep.accept_interval()
    assert lo <= rep.avg_accept_length <= hi and 1 <= lo < hi <= 4
    assert rep.accept_interval() == (lo, hi)  # seeded: reproducible
    same = _report([3] * 7, [2, 4, 1])
    assert same.accept_interval() == (3.0, 3.0)
    assert EvalReport("n", 1, 0, 1.0, 0.0, None, 1, 1.0).accept_interval() is None
    # without per-question counts every step is its own question: a narrower interval
    flat = EvalReport(**{**rep.__dict__, "accept_steps": ()})
    assert flat.accept_interval()[1] - flat.accept_interval()[0] < hi - lo
    assert "[" in rep.pretty() and rep.to_dict(details=True)["accept_steps"] == [5, 1, 3]


def test_config_keys_round_trip_and_errors():
    for key in ("fp4/fp8/tp4/v2", "bf16/bf16/tp1/off", "fp4/fp8/tp1/v1/pad-start"):
        assert EvalConfig.from_key(key).key == key
    assert EvalConfig.from_key("fp4/fp8/tp1/v1/pad-end").cache_config().page_size == 32
    for bad in ("fp4/fp8/v2", "fp4/fp8/1/v2", "fp4/fp8/tp1/v1/start"):
        with pytest.raises(ValueError, match="expected WEIGHTS/KV"):
            EvalConfig.from_key(bad)
    with pytest.raises(ValueError, match="for spec v1 at tp 1"):
        EvalConfig.from_key("fp4/fp8/tp4/v1/pad-start")
    with pytest.raises(ValueError, match="for spec v1 at tp 1"):
        EvalConfig.from_key("fp4/fp8/tp1/v2/pad-end")
