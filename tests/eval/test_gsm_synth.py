"""The synthetic word problems: format, arithmetic, seeding, disjoint splits, tokenizer."""

from __future__ import annotations

import random
import re

import pytest

from mla_spec.eval import (
    build_tokenizer,
    format_qa,
    heldout_problems,
    is_heldout,
    make_problem,
    train_problems,
)
from mla_spec.eval.gsm_synth import TEMPLATES

TEMPLATES_NAMES = sorted(TEMPLATES)


def _check_steps(answer: str) -> None:
    for a, op, b, c in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", answer):
        a, b, c = int(a), int(b), int(c)
        assert {"+": a + b, "-": a - b, "*": a * b}[op] == c, answer


@pytest.mark.parametrize("name", TEMPLATES_NAMES)
def test_every_template_is_gsm8k_format_and_correct(name):
    rng = random.Random(3)
    for _ in range(50):
        p = make_problem(rng, name)
        assert p.answer.endswith(f"#### {p.label}")
        assert p.label >= 0
        _check_steps(p.answer)
        n_ops = len(re.findall(r" = ", p.answer))
        assert 1 <= n_ops <= 3
        text = format_qa(p)
        assert text.startswith("Question: ") and "\nAnswer: " in text


def test_unknown_template_is_rejected():
    with pytest.raises(ValueError, match="supported"):
        make_problem(random.Random(0), "division")


def test_seeded_and_disjoint():
    assert train_problems(50, seed=1) == train_problems(50, seed=1)
    assert train_problems(50, seed=1) != train_problems(50, seed=2)
    held = heldout_problems(300)
    assert len({p.question for p in held}) == 300
    assert all(is_heldout(p.question) for p in held)
    train_q = {p.question for p in train_problems(5000, seed=0)}
    assert not train_q & {p.question for p in held}
    assert {p.template for p in held} == set(TEMPLATES_NAMES)


def test_tokenizer_spells_digits_and_round_trips():
    probs = train_problems(400, seed=0)
    tok = build_tokenizer(format_qa(p) + "\n\n" for p in probs)
    assert tok.token_to_id("<bos>") == 0 and tok.token_to_id("<eos>") == 1
    text = format_qa(heldout_problems(1)[0]) + "\n\nQuestion:"
    enc = tok.encode(text)
    assert enc.ids[0] == 0
    assert tok.decode(enc.ids) == text
    assert "<unk>" not in enc.tokens
    digits = [t for t in enc.tokens if t.lstrip("▁").isdigit()]
    assert digits and all(len(t.lstrip("▁")) == 1 for t in digits)
    assert tok.get_vocab_size() < 256
