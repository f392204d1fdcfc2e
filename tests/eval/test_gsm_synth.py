"""The synthetic word problems: format, arithmetic, seeding, disjoint splits, lengths, tokenizer."""

from __future__ import annotations

import random
import re

import pytest

from mla_spec.eval import (
    build_prompts,
    build_tokenizer,
    format_qa,
    heldout_problems,
    is_heldout,
    make_problem,
    train_problems,
)
from mla_spec.eval.gsm_synth import (
    MAX_ANSWER_TOKENS,
    TEMPLATES,
    answer_tokens,
    vocabulary_words,
)

TEMPLATES_NAMES = sorted(TEMPLATES)
_STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def _steps(answer: str) -> list[tuple[int, str, int, int]]:
    return [(int(a), op, int(b), int(c)) for a, op, b, c in _STEP.findall(answer)]


def _task_tokenizer():
    texts = (format_qa(p) + "\n\n" for p in train_problems(3000, seed=0))
    return build_tokenizer(texts, words=vocabulary_words())


@pytest.mark.parametrize("name", TEMPLATES_NAMES)
def test_every_template_is_gsm8k_format_and_correct(name):
    rng = random.Random(3)
    for _ in range(200):
        p = make_problem(rng, name)
        assert p.answer.endswith(f" #### {p.label}")
        assert p.label >= 1
        steps = _steps(p.answer)
        assert 2 <= len(steps) <= 4, p.answer
        for a, op, b, c in steps:
            if op == "/":
                assert b * c == a, p.answer  # exact division only
            else:
                assert {"+": a + b, "-": a - b, "*": a * b}[op] == c, p.answer
            assert c >= 1
        assert steps[-1][3] == p.label  # the last step computes the answer
        assert max(int(n) for n in re.findall(r"\d+", p.question)) <= 999
        assert max(max(a, b, c) for a, _, b, c in steps) < 2000
        assert answer_tokens(" " + p.answer) <= MAX_ANSWER_TOKENS
        text = format_qa(p)
        assert text.startswith("Question: ") and "\nAnswer: " in text
        assert p.question.endswith("?") and p.question.count("?") == 1


def test_task_has_carries_distractors_and_every_operation():
    probs = train_problems(3000, seed=5)
    steps = [s for p in probs for s in _steps(p.answer)]
    assert {op for _, op, _, _ in steps} == {"+", "-", "*", "/"}
    carries = sum(op == "+" and (a % 10 + b % 10) >= 10 for a, op, b, _ in steps)
    borrows = sum(op == "-" and a % 10 < b % 10 for a, op, b, _ in steps)
    assert carries > 0.3 * sum(op == "+" for _, op, _, _ in steps)
    assert borrows > 0.3 * sum(op == "-" for _, op, _, _ in steps)
    assert sum(len(str(c)) >= 3 for *_, c in steps) > 0.5 * len(steps)
    # a distractor: a number in the question that no step of the answer uses
    def distracted(p):
        used = {n for s in _steps(p.answer) for n in (s[0], s[2])}
        return any(int(n) not in used for n in re.findall(r"\d+", p.question))
    share = sum(distracted(p) for p in probs) / len(probs)
    assert 0.3 < share < 0.7
    by_ops = {n: sum(len(_steps(p.answer)) == n for p in probs) for n in (2, 3, 4)}
    assert all(v > 0.05 * len(probs) for v in by_ops.values()), by_ops


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
    tok = _task_tokenizer()
    assert tok.token_to_id("<bos>") == 0 and tok.token_to_id("<eos>") == 1
    for p in heldout_problems(300):
        text = format_qa(p) + "\n\nQuestion:"
        enc = tok.encode(text)
        assert enc.ids[0] == 0
        assert tok.decode(enc.ids) == text
        assert "<unk>" not in enc.tokens, text
        digits = [t for t in enc.tokens if t.lstrip("▁").isdigit()]
        assert digits and all(len(t.lstrip("▁")) == 1 for t in digits)
    # every slot word is in the vocabulary, whatever problems the vocabulary was trained on
    small = build_tokenizer([format_qa(train_problems(1)[0])], words=vocabulary_words())
    assert all(small.token_to_id("▁" + w) is not None for w in vocabulary_words())
    assert tok.get_vocab_size() <= 192  # config.json's vocab_size of the embedded model


def test_answer_token_count_matches_the_tokenizer():
    tok = _task_tokenizer()
    for p in heldout_problems(100, seed=9):
        n = len(tok.encode(" " + p.answer, add_special_tokens=False).ids)
        assert answer_tokens(" " + p.answer) == n


def test_prompts_and_answers_fit_the_serving_limits():
    """2-shot prompt + answer + "\\n\\nQuestion" within the sweep's 512-token context, and the
    answer + stop within the eval's new tokens (``DEFAULT_MAX_NEW_TOKENS``, 64) with room."""
    tok = _task_tokenizer()
    held = heldout_problems(400)
    longest_prompt = max(len(tok.encode(x).ids) for x in build_prompts(held, k_shots=2))
    longest_answer = max(answer_tokens(" " + p.answer + "\n\nQuestion") for p in held)
    assert longest_answer <= 56
    assert longest_prompt + 64 <= 512
