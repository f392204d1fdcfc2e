"""Synthetic grade-school arithmetic word problems in GSM8K's format.

The embedded tiny model is far too small for real GSM8K, so it is trained and scored on templated
problems of the same *shape*: a short story, 2-4 operations on numbers up to 999 (``+`` / ``-``
with carries, one-digit times two-digit ``*``, exact ``/``), often a distractor sentence with its
own number, several wordings, and a worked answer ending with GSM8K's final-answer marker::

    Question: Mia has 245 stickers. She buys 3 packs of stickers. Each pack has 48 stickers.
    It is 21 degrees outside. How many stickers does Mia have now?
    Answer: The packs have 3 * 48 = 144 stickers. Mia has 245 + 144 = 389 stickers now. #### 389

The worked answer is a function of the question, at most :data:`MAX_ANSWER_TOKENS` tokens of
``mla_spec.eval.tokenizer``. Sets are reproducible from a seed. A question is held out when the
SHA-1 of its text falls in one bucket of ``HELDOUT_MODULUS``; training drops those, whatever the
seeds.
"""

import hashlib
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

__all__ = ["Problem", "TEMPLATES", "HELDOUT_MODULUS", "MAX_ANSWER_TOKENS", "answer_tokens",
           "is_heldout", "make_problem", "train_problems", "heldout_problems", "format_qa",
           "vocabulary_words"]

HELDOUT_MODULUS = 16
#: longest worked answer in tokens (" ... #### N"); + "\n\nQuestion" stays within 56 new tokens
MAX_ANSWER_TOKENS = 52

# (name, subject pronoun, object pronoun): she and he by turns
_PEOPLE = [(n, *(("She", "her"), ("He", "him"))[i % 2]) for i, n in enumerate(
    "Mia Tom Ava Leo Zoe Sam Ivy Ben Lily Max Emma Jack Nora Owen Ruby Eli Rosa Finn Alma Omar"
    .split())]
_OBJECTS = ("apples pencils stickers marbles cookies books shells cards stamps coins balloons "
            "crayons eggs flowers candies toys beads buttons rocks seeds").split()
_ITEMS = "books hats toys games balls kites lamps cakes mugs pens".split()
_CONTAINERS = "packs boxes bags jars".split()  # singular: strip the plural ending
_FOODS = "muffins cookies rolls pies tarts".split()
_DAYS = "Monday Tuesday Wednesday Thursday Friday".split()


@dataclass(frozen=True)
class Problem:
    """One word problem: question text, worked answer ending ``#### label``, its label."""

    question: str
    answer: str
    label: int
    template: str

    def to_dict(self) -> dict:
        return asdict(self)


def _one(word: str) -> str:
    return word[:-2] if word.endswith(("xes", "ches")) else word[:-1]


def _two(rng: random.Random) -> list[tuple[str, str, str]]:
    return rng.sample(_PEOPLE, 2)


def _distract(rng: random.Random, story: list[str], n: str, p: str, o: str) -> None:
    """Insert, half of the time, one sentence whose number the answer must not use."""
    if rng.random() < 0.5:
        return
    other = rng.choice([x for x in _OBJECTS if x != o])
    m = rng.choice([x for x in _PEOPLE if x[0] != n])[0]
    k = rng.randint(2, 999)
    s = rng.choice([
        f"{p} is {rng.randint(6, 60)} years old.",
        f"The shop is {k} meters away.",
        f"It is {rng.randint(2, 39)} degrees outside.",
        f"{m} has {k} {other}.",
        f"{p} also has {k} {other}.",
        f"There are {k} {other} on the table.",
    ])
    story.insert(rng.randint(1, len(story)), s)


def _finish(story: list[str], question: str) -> str:
    return " ".join([*story, question])


def _t_add_sub(rng):
    (n, p, _), (m, _, _) = _two(rng)
    o = rng.choice(_OBJECTS)
    a, b = rng.randint(100, 999), rng.randint(10, 999)
    s = a + b
    c = rng.randint(10, min(999, s - 1))
    r = s - c
    story = [f"{n} has {a} {o}.", f"{p} {rng.choice(['buys', 'finds', 'gets'])} {b} more {o}.",
             f"Then {p.lower()} gives {c} {o} to {m}."]
    _distract(rng, story, n, p, o)
    q = _finish(story, rng.choice([f"How many {o} does {n} have left?",
                                   f"How many {o} does {n} have now?"]))
    return q, f"{n} has {a} + {b} = {s} {o}. Then {n} has {s} - {c} = {r} {o}.", r


def _t_pack_total(rng):
    (n, p, _), _m = _two(rng)
    o, box = rng.choice(_OBJECTS), rng.choice(_CONTAINERS)
    a, k, s = rng.randint(10, 999), rng.randint(2, 9), rng.randint(10, 99)
    m, t = k * s, a + k * s
    story = [f"{n} has {a} {o}.", f"{p} buys {k} {box} of {o}.",
             rng.choice([f"Each {_one(box)} has {s} {o}.",
                         f"There are {s} {o} in each {_one(box)}."])]
    _distract(rng, story, n, p, o)
    q = _finish(story, f"How many {o} does {n} have now?")
    return q, f"The {box} have {k} * {s} = {m} {o}. {n} has {a} + {m} = {t} {o} now.", t


def _t_three_ops(rng):
    (n, p, _), (m, _, _) = _two(rng)
    o, box = rng.choice(_OBJECTS), rng.choice(_CONTAINERS)
    a, k, s = rng.randint(10, 500), rng.randint(2, 9), rng.randint(10, 99)
    x, t = k * s, a + k * s
    d = rng.randint(10, min(999, t - 1))
    r = t - d
    story = [f"{n} has {a} {o}.", f"{p} buys {k} {box} with {s} {o} in each {_one(box)}.",
             rng.choice([f"Then {p.lower()} gives {d} {o} to {m}.",
                         f"Then {p.lower()} loses {d} {o}."])]
    _distract(rng, story, n, p, o)
    q = _finish(story, f"How many {o} does {n} have left?")
    return q, f"{k} * {s} = {x} {o}. {n} has {a} + {x} = {t}. Then {t} - {d} = {r} {o}.", r


def _t_shop(rng):
    (n, p, _), _m = _two(rng)
    i1, i2 = rng.sample(_ITEMS, 2)
    k, c1, c2 = rng.randint(2, 9), rng.randint(10, 99), rng.randint(10, 99)
    x, y = k * c1, k * c1 + c2
    a = rng.randint(y + 1, 999)
    r = a - y
    story = [f"{n} has {a} dollars.",
             f"{p} buys {k} {i1} for {c1} dollars each and one of the {i2} for {c2} dollars."]
    _distract(rng, story, n, p, i1)
    q = _finish(story, rng.choice([f"How much money does {n} have left?",
                                   f"How many dollars does {n} have left?"]))
    ans = (f"The {i1} cost {k} * {c1} = {x}. {n} spends {x} + {c2} = {y}. "
           f"{n} has {a} - {y} = {r} dollars left.")
    return q, ans, r


def _t_share(rng):
    (n, p, _), (m, _, _) = _two(rng)
    o = rng.choice(_OBJECTS)
    k, each = rng.randint(2, 9), rng.randint(10, 99)
    t = k * each
    a = rng.randint(5, t - 5)
    b = t - a
    story = [f"{n} has {a} {o}.", f"{m} gives {n} {b} more {o}.",
             rng.choice([f"{n} shares them equally among {k} friends.",
                         f"{p} puts them into {k} equal groups."])]
    _distract(rng, story, n, p, o)
    q = _finish(story, rng.choice([f"How many {o} are in each share?",
                                   f"How many {o} does each share get?"]))
    return q, f"{n} has {a} + {b} = {t} {o}. Each share gets {t} / {k} = {each} {o}.", each


def _t_chain_compare(rng):
    (n, p, _), (m, _, _) = _two(rng)
    ell = rng.choice([x for x in _PEOPLE if x[0] not in (n, m)])[0]
    o = rng.choice(_OBJECTS)
    a, b = rng.randint(10, 400), rng.randint(10, 300)
    y = a + b
    c = rng.randint(10, y - 1)
    z = y - c
    t = y + z
    story = [f"{n} has {a} {o}.", f"{m} has {b} more {o} than {n}.",
             f"{ell} has {c} fewer {o} than {m}."]
    _distract(rng, story, n, p, o)
    q = _finish(story, f"How many {o} do {m} and {ell} have together?")
    ans = f"{m} has {a} + {b} = {y}. {ell} has {y} - {c} = {z}. Together {y} + {z} = {t} {o}."
    return q, ans, t


def _t_wages(rng):
    (n, p, _), _m = _two(rng)
    d1, d2 = rng.sample(_DAYS, 2)
    h, g, w = rng.randint(1, 5), rng.randint(1, 5), rng.randint(11, 99)
    t, e = h + g, (h + g) * w
    story = [rng.choice([f"{n} earns {w} dollars an hour.", f"{n} is paid {w} dollars an hour."]),
             f"{p} works {h} hours on {d1} and {g} hours on {d2}."]
    _distract(rng, story, n, p, "coins")
    q = _finish(story, f"How much does {n} earn on the two days?")
    return q, f"{n} works {h} + {g} = {t} hours. {n} earns {t} * {w} = {e} dollars.", e


def _t_bakery(rng):
    (n, p, _), (m, _, _) = _two(rng)
    f = rng.choice(_FOODS)
    k, s = rng.randint(2, 9), rng.randint(10, 99)
    t = k * s
    c = rng.randint(10, t - 10)
    d = rng.randint(2, t - c - 1)
    u, r = c + d, t - c - d
    story = [f"{n} bakes {k} trays of {f} with {s} {f} on each tray.",
             f"{p} sells {c} {f} and gives {d} {f} to {m}."]
    _distract(rng, story, n, p, f)
    q = _finish(story, rng.choice([f"How many {f} are left?", f"How many {f} does {n} have left?"]))
    ans = f"{n} bakes {k} * {s} = {t}. {n} uses {c} + {d} = {u}. {t} - {u} = {r} {f} are left."
    return q, ans, r


def _t_transfer(rng):
    (n, p, _), (m, _, _) = _two(rng)
    o = rng.choice(_OBJECTS)
    a = rng.randint(100, 999)
    c = rng.randint(10, a - 10)
    x = a - c
    b = rng.randint(max(10, x - c + 1), 999)
    y = b + c
    d = y - x
    story = [f"{n} has {a} {o} and {m} has {b} {o}.", f"{n} gives {c} {o} to {m}."]
    _distract(rng, story, n, p, o)
    q = _finish(story, f"How many more {o} does {m} have than {n} now?")
    ans = f"{n} has {a} - {c} = {x}. {m} has {b} + {c} = {y}. {y} - {x} = {d} more {o}."
    return q, ans, d


def _t_two_buys(rng):
    (n, p, _), _m = _two(rng)
    i1, i2 = rng.sample(_ITEMS, 2)
    k1, k2 = rng.randint(2, 9), rng.randint(2, 9)
    c1, c2 = rng.randint(10, 99), rng.randint(10, 99)
    x, y, t = k1 * c1, k2 * c2, k1 * c1 + k2 * c2
    story = [f"{n} buys {k1} {i1} for {c1} dollars each.",
             f"{p} also buys {k2} {i2} for {c2} dollars each."]
    _distract(rng, story, n, p, i1)
    q = _finish(story, rng.choice([f"How much does {n} spend?",
                                   f"How many dollars does {n} spend?"]))
    return q, f"{k1} * {c1} = {x}. {k2} * {c2} = {y}. {n} spends {x} + {y} = {t} dollars.", t


def _t_pages(rng):
    (n, p, _), _m = _two(rng)
    a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
    x, y = a + b, a + b + c
    total = rng.randint(y + 1, 999)
    r = total - y
    story = [f"{n} has a book with {total} pages.",
             f"{p} reads {a} pages on Monday, {b} pages on Tuesday and {c} pages on Wednesday."]
    _distract(rng, story, n, p, "books")
    q = _finish(story, f"How many pages does {n} have left to read?")
    ans = f"{n} reads {a} + {b} = {x}. Then {x} + {c} = {y} pages. {total} - {y} = {r} pages."
    return q, ans, r


def _t_four_ops(rng):
    (n, p, _), (m, _, _) = _two(rng)
    o, box = rng.choice(_OBJECTS), rng.choice(_CONTAINERS)
    a, k, s, b = rng.randint(10, 99), rng.randint(2, 9), rng.randint(10, 99), rng.randint(10, 99)
    x = k * s
    y, z = a + x, a + x + b
    d = rng.randint(10, min(999, z - 1))
    r = z - d
    story = [f"{n} has {a} {o}.", f"{p} buys {k} {box} of {s} {o} and finds {b} more.",
             f"Then {p.lower()} gives {d} {o} to {m}."]
    _distract(rng, story, n, p, o)
    q = _finish(story, f"How many {o} does {n} have left?")
    return q, f"{k} * {s} = {x}. {a} + {x} = {y}. {y} + {b} = {z}. {z} - {d} = {r}.", r


def _t_times_more(rng):
    (n, p, _), (m, _, _) = _two(rng)
    o = rng.choice(_OBJECTS)
    a, k = rng.randint(10, 99), rng.randint(2, 9)
    b, d = a * k, a * k - a
    story = [f"{n} has {a} {o}.",
             rng.choice([f"{m} has {k} times as many {o} as {n}.",
                         f"{m} has {k} times more {o} than {n}."])]
    _distract(rng, story, n, p, o)
    q = _finish(story, f"How many more {o} does {m} have than {n}?")
    return q, f"{m} has {a} * {k} = {b} {o}. {m} has {b} - {a} = {d} more {o}.", d


#: template name (the function's, less ``_t_``) -> ``rng -> (question, worked steps, label)``
_Template = Callable[[random.Random], tuple[str, str, int]]
TEMPLATES: dict[str, _Template] = {f.__name__[3:]: f for f in (
    _t_add_sub, _t_pack_total, _t_three_ops, _t_shop, _t_share, _t_chain_compare, _t_wages,
    _t_bakery, _t_transfer, _t_two_buys, _t_pages, _t_four_ops, _t_times_more)}

_TOKEN_RE = re.compile(r"\n+|\d|[.,?!:;]|[^\s\d.,?!:;]+")


def answer_tokens(text: str) -> int:
    """Tokens of ``text`` under the task's word-level tokenizer (words, digits, punctuation)."""
    return len(_TOKEN_RE.findall(text))


def vocabulary_words() -> list[str]:
    """Every name, object and other slot word the templates draw from (for the tokenizer)."""
    words = [w for person in _PEOPLE for w in person] + [p.lower() for _, p, _ in _PEOPLE]
    words += _OBJECTS + _ITEMS + _CONTAINERS + [_one(c) for c in _CONTAINERS] + _FOODS + _DAYS
    return sorted(set(words))


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
    answer = f"{steps} #### {label}"
    if answer_tokens(" " + answer) > MAX_ANSWER_TOKENS:
        raise AssertionError(f"template {name}: answer longer than {MAX_ANSWER_TOKENS} tokens")
    return Problem(question=q, answer=answer, label=label, template=name)


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
