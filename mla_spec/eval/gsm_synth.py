"""Synthetic grade-school arithmetic word problems in GSM8K's format.

The embedded tiny model cannot be scored on the real GSM8K (it is far too small to read English),
so it is trained and scored on templated problems of the same *shape*: a short story with names,
objects and 1-3 operations on small numbers (2-digit ``+``/``-``, times tables), and a worked answer
that writes each operation out and ends with GSM8K's final-answer marker::

    Question: Mia has 12 apples. She buys 7 more apples. How many apples does Mia have now?
    Answer: Mia has 12 + 7 = 19 apples now. #### 19

Everything is generated from a seed (``random.Random``), so the sets are reproducible. The split
is a property of the question *text*: a question belongs to the held-out split when the SHA-1 of
its text falls in a fixed bucket (1 in ``HELDOUT_MODULUS``). The training generator drops those,
so the held-out questions never appear in training, whatever the seeds.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

__all__ = [
    "Problem",
    "TEMPLATES",
    "HELDOUT_MODULUS",
    "is_heldout",
    "make_problem",
    "train_problems",
    "heldout_problems",
    "format_qa",
]

HELDOUT_MODULUS = 16

# (name, subject pronoun, object pronoun)
_PEOPLE = [
    ("Mia", "She", "her"), ("Tom", "He", "him"), ("Ava", "She", "her"), ("Leo", "He", "him"),
    ("Zoe", "She", "her"), ("Sam", "He", "him"), ("Ivy", "She", "her"), ("Ben", "He", "him"),
    ("Lily", "She", "her"), ("Max", "He", "him"), ("Emma", "She", "her"), ("Jack", "He", "him"),
    ("Nora", "She", "her"), ("Owen", "He", "him"), ("Ruby", "She", "her"), ("Eli", "He", "him"),
]
_OBJECTS = [
    "apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards",
    "stamps", "coins", "balloons", "crayons", "eggs", "flowers", "candies", "toys",
]
_ITEMS = ["book", "hat", "toy", "game", "ball", "kite", "lamp", "cake"]


@dataclass(frozen=True)
class Problem:
    """One word problem: question text, worked answer ending ``#### label``, its label."""

    question: str
    answer: str
    label: int
    template: str

    def to_dict(self) -> dict:
        return asdict(self)


def _people(rng: random.Random) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    a, b = rng.sample(_PEOPLE, 2)
    return a, b


def _t_add_buy(rng: random.Random) -> tuple[str, str, int]:
    (n, p, _), _m = _people(rng)
    o = rng.choice(_OBJECTS)
    a, b = rng.randint(10, 99), rng.randint(2, 99)
    c = a + b
    q = f"{n} has {a} {o}. {p} buys {b} more {o}. How many {o} does {n} have now?"
    return q, f"{n} has {a} + {b} = {c} {o} now.", c


def _t_sub_give(rng: random.Random) -> tuple[str, str, int]:
    (n, p, _), (m, _, _) = _people(rng)
    o = rng.choice(_OBJECTS)
    a = rng.randint(20, 99)
    b = rng.randint(2, a - 1)
    c = a - b
    q = f"{n} has {a} {o}. {p} gives {b} {o} to {m}. How many {o} does {n} have left?"
    return q, f"{n} has {a} - {b} = {c} {o} left.", c


def _t_mul_boxes(rng: random.Random) -> tuple[str, str, int]:
    (n, _, _), _m = _people(rng)
    o = rng.choice(_OBJECTS)
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    c = a * b
    q = f"{n} has {a} boxes of {o}. Each box has {b} {o}. How many {o} does {n} have?"
    return q, f"{n} has {a} * {b} = {c} {o}.", c


def _t_together(rng: random.Random) -> tuple[str, str, int]:
    (n, _, _), (m, _, _) = _people(rng)
    o = rng.choice(_OBJECTS)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    c = a + b
    q = f"{n} has {a} {o} and {m} has {b} {o}. How many {o} do they have together?"
    return q, f"Together they have {a} + {b} = {c} {o}.", c


def _t_compare(rng: random.Random) -> tuple[str, str, int]:
    (n, _, _), (m, _, _) = _people(rng)
    o = rng.choice(_OBJECTS)
    b = rng.randint(2, 90)
    a = rng.randint(b + 1, 99)
    c = a - b
    q = f"{n} has {a} {o}. {m} has {b} {o}. How many more {o} does {n} have than {m}?"
    return q, f"{n} has {a} - {b} = {c} more {o}.", c


def _t_add_sub(rng: random.Random) -> tuple[str, str, int]:
    (n, p, _), (m, _, _) = _people(rng)
    o = rng.choice(_OBJECTS)
    a, b = rng.randint(10, 60), rng.randint(2, 40)
    c = a + b
    d = rng.randint(2, c - 1)
    e = c - d
    q = (
        f"{n} has {a} {o}. {p} buys {b} more {o} and then gives {d} {o} to {m}. "
        f"How many {o} does {n} have left?"
    )
    return q, f"{n} has {a} + {b} = {c} {o}. Then {n} has {c} - {d} = {e} {o} left.", e


def _t_mul_add(rng: random.Random) -> tuple[str, str, int]:
    (n, _, _), (m, _, _) = _people(rng)
    o = rng.choice(_OBJECTS)
    a, b, d = rng.randint(2, 9), rng.randint(2, 12), rng.randint(2, 50)
    c = a * b
    e = c + d
    q = (
        f"{n} buys {a} bags of {o}. Each bag has {b} {o}. {m} gives {n} {d} more {o}. "
        f"How many {o} does {n} have now?"
    )
    return q, f"The bags have {a} * {b} = {c} {o}. {n} has {c} + {d} = {e} {o} now.", e


def _t_three_ops(rng: random.Random) -> tuple[str, str, int]:
    (n, p, _), (m, _, _) = _people(rng)
    o = rng.choice(_OBJECTS)
    a, k, s = rng.randint(2, 40), rng.randint(2, 9), rng.randint(2, 12)
    packs = k * s
    total = a + packs
    d = rng.randint(2, total - 1)
    r = total - d
    q = (
        f"{n} has {a} {o}. {p} buys {k} packs with {s} {o} in each pack. "
        f"Then {p.lower()} gives {d} {o} to {m}. How many {o} does {n} have left?"
    )
    ans = (
        f"The packs have {k} * {s} = {packs} {o}. {n} has {a} + {packs} = {total} {o}. "
        f"Then {n} has {total} - {d} = {r} {o} left."
    )
    return q, ans, r


def _t_money(rng: random.Random) -> tuple[str, str, int]:
    (n, p, _), _m = _people(rng)
    i1, i2 = rng.sample(_ITEMS, 2)
    b, d = rng.randint(2, 40), rng.randint(2, 40)
    c = b + d
    a = rng.randint(c + 1, 99)
    e = a - c
    q = (
        f"{n} has {a} dollars. {p} spends {b} dollars on a {i1} and {d} dollars on a {i2}. "
        f"How much money does {n} have left?"
    )
    return q, f"{n} spends {b} + {d} = {c} dollars. {n} has {a} - {c} = {e} dollars left.", e


def _t_days(rng: random.Random) -> tuple[str, str, int]:
    (n, _, _), _m = _people(rng)
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    c = a * b
    q = f"{n} reads {a} pages every day. How many pages does {n} read in {b} days?"
    return q, f"{n} reads {a} * {b} = {c} pages.", c


TEMPLATES: dict[str, Callable[[random.Random], tuple[str, str, int]]] = {
    "add_buy": _t_add_buy,
    "sub_give": _t_sub_give,
    "mul_boxes": _t_mul_boxes,
    "together": _t_together,
    "compare": _t_compare,
    "add_sub": _t_add_sub,
    "mul_add": _t_mul_add,
    "three_ops": _t_three_ops,
    "money": _t_money,
    "days": _t_days,
}


def is_heldout(question: str) -> bool:
    """Whether ``question`` belongs to the held-out split (a fixed hash bucket of its text)."""
    h = int.from_bytes(hashlib.sha1(question.encode()).digest()[:8], "little")
    return h % HELDOUT_MODULUS == 0


def make_problem(rng: random.Random, template: str | None = None) -> Problem:
    """Draw one problem (any split) from ``template`` or a uniformly chosen one."""
    name = template if template is not None else rng.choice(sorted(TEMPLATES))
    if name not in TEMPLATES:
        raise ValueError(f"template {name!r}: supported {', '.join(sorted(TEMPLATES))}")
    q, steps, label = TEMPLATES[name](rng)
    return Problem(question=q, answer=f"{steps} #### {label}", label=label, template=name)


def _stream(seed: int, heldout: bool) -> Iterator[Problem]:
    rng = random.Random(seed)
    seen: set[str] = set()
    while True:
        p = make_problem(rng)
        if is_heldout(p.question) != heldout or p.question in seen:
            continue
        if heldout:
            seen.add(p.question)
        yield p


def train_problems(n: int, seed: int = 0) -> list[Problem]:
    """``n`` training problems (never a held-out question; duplicates possible, as in real data)."""
    it = _stream(seed, heldout=False)
    return [next(it) for _ in range(n)]


def heldout_problems(n: int, seed: int = 1234) -> list[Problem]:
    """``n`` distinct held-out problems (no question text shared with any training problem)."""
    it = _stream(seed, heldout=True)
    return [next(it) for _ in range(n)]


def format_qa(p: Problem) -> str:
    """``"Question: ...\\nAnswer: ..."`` (one shot, without the separating blank line)."""
    return f"Question: {p.question}\nAnswer: {p.answer}"
