"""Few-shot prompts and scoring, the way SGLang's ``few_shot_gsm8k`` benchmark does them.

A prompt is ``k`` solved examples followed by the question::

    Question: <shot 1>\\nAnswer: <worked answer 1> #### 19\\n\\n
    ...
    Question: <shot k>\\nAnswer: <worked answer k> #### 7\\n\\n
    Question: <the question>\\nAnswer:

Greedy generation stops at ``"Question"`` (the next example). The score is the completion's *last
integer* (commas removed); none: invalid (wrong). The shots come from the training split with a
fixed seed, so every prompt of a run shares one prefix.
"""

import re
from collections.abc import Sequence

from mla_spec.eval.gsm_synth import Problem, format_qa, train_problems

__all__ = ["STOP", "INVALID", "few_shot_examples", "few_shot_prefix", "build_prompt",
           "build_prompts", "get_answer_value", "truncate_at_stop"]

STOP: tuple[str, ...] = ("Question", "Assistant:", "<|separator|>")
INVALID: int | None = None

_INT = re.compile(r"\d+")


def few_shot_examples(k: int, seed: int = 7) -> list[Problem]:
    """``k`` solved training problems used as shots (the same ones for every prompt)."""
    if k < 0:
        raise ValueError(f"k_shots {k}: must be >= 0")
    return train_problems(k, seed=seed)


def few_shot_prefix(shots: Sequence[Problem]) -> str:
    """The shots as ``"Question: ...\\nAnswer: ...\\n\\n"`` blocks."""
    return "".join(format_qa(p) + "\n\n" for p in shots)


def build_prompt(question: str, shots: Sequence[Problem]) -> str:
    """Shots, then ``"Question: <question>\\nAnswer:"`` (the model writes the answer)."""
    return few_shot_prefix(shots) + f"Question: {question}\nAnswer:"


def build_prompts(questions: Sequence[Problem | str], k_shots: int, seed: int = 7) -> list[str]:
    """One prompt per question, all with the same ``k_shots`` shots."""
    shots = few_shot_examples(k_shots, seed)
    texts = [q.question if isinstance(q, Problem) else str(q) for q in questions]
    return [build_prompt(t, shots) for t in texts]


def truncate_at_stop(text: str, stop: Sequence[str] = STOP) -> str:
    """Cut ``text`` at the first stop string (engines usually do this already)."""
    hits = [i for i in map(text.find, stop) if i >= 0]
    return text[:min(hits, default=len(text))]


def get_answer_value(text: str) -> int | None:
    """The last integer of ``text`` after removing commas, or ``None`` (invalid) when none."""
    nums = _INT.findall(text.replace(",", ""))
    return int(nums[-1]) if nums else INVALID
