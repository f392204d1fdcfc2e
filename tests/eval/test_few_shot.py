"""Few-shot prompts, last-integer scoring, run_eval with a fake generator, the report."""

from __future__ import annotations

import json

import pytest

from mla_spec.eval import (
    EvalReport,
    build_prompts,
    format_table,
    get_answer_value,
    heldout_problems,
    run_eval,
    truncate_at_stop,
)


def test_prompt_shape():
    qs = heldout_problems(3)
    prompts = build_prompts(qs, k_shots=2)
    assert len(prompts) == 3
    for p, q in zip(prompts, qs):
        assert p.count("Question: ") == 3 and p.count("#### ") == 2
        assert p.endswith(f"Question: {q.question}\nAnswer:")
        assert "\n\nQuestion: " in p
    assert build_prompts(qs[:1], 0)[0] == f"Question: {qs[0].question}\nAnswer:"


@pytest.mark.parametrize(
    "text,value",
    [
        (" Mia has 12 + 7 = 19 apples now. #### 19\n\n", 19),
        ("1,234 and then 5,678", 5678),
        ("no number", None),
        ("#### 0", 0),
    ],
)
def test_last_integer(text, value):
    assert get_answer_value(text) == value


def test_truncate_at_stop():
    assert truncate_at_stop(" a #### 3\n\nQuestion: x") == " a #### 3\n\n"
    assert truncate_at_stop("no stop") == "no stop"


def test_run_eval_with_oracle_and_broken_generators():
    qs = heldout_problems(20)
    answers = {q.question: q.answer for q in qs}

    def oracle(prompts, max_new_tokens, stop):
        out = []
        for p in prompts:
            q = p.rsplit("Question: ", 1)[1].split("\nAnswer:")[0]
            out.append({"text": f" {answers[q]}\n\nQuestion: next", "output_ids": [1] * 9,
                        "accept_lengths": [2, 3]})
        return out

    rep = run_eval(oracle, qs, k_shots=1, name="oracle")
    assert rep.accuracy == 1.0 and rep.invalid == 0.0
    assert rep.avg_accept_length == pytest.approx(2.5)
    assert rep.output_tokens == 9 * 20
    assert all("Question" not in c for c in rep.completions)

    rep2 = run_eval(lambda p, max_new_tokens, stop: ["nothing"] * len(p), qs, k_shots=0)
    assert rep2.accuracy == 0.0 and rep2.invalid == 1.0 and rep2.avg_accept_length is None
    with pytest.raises(ValueError, match="results"):
        run_eval(lambda p, max_new_tokens, stop: [], qs)


def test_report_round_trip_and_table():
    rep = EvalReport("a", 10, 2, 0.9, 0.0, 2.5, 100, 2.0, predictions=(1, None),
                     accept_lengths=(2, 3))
    d = rep.to_dict(details=True)
    assert EvalReport.from_dict(json.loads(json.dumps(d))) == rep
    assert rep.tokens_per_s == 50.0 and rep.num_correct == 9
    assert "accuracy" in rep.pretty() and "0.9000" in rep.pretty()
    table = format_table([rep, rep])
    assert table.count("\n") == 3 and "| a |" in table
