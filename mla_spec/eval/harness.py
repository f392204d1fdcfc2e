"""``run_eval``: serve few-shot prompts through an engine (or any generate function) and score them.

It backs ``mla-spec demo``, ``tests/test_accuracy.py`` and notebook 07:
``print(run_eval(engine, heldout_problems(200), k_shots=2).pretty())``.
``engine_or_generate_fn``: an object with ``generate(prompts, max_new_tokens, stop)`` (``Engine``)
or such a callable, given all questions in one call (batched). A result is a string or has
``text`` (optionally ``output_ids``, ``accept_lengths`` per verify, bonus token included); without
accept lengths the engine's ``avg_accept_length`` (or its ``metrics``') is used.
"""

import time
from collections.abc import Callable, Sequence
from typing import Any

from mla_spec.eval.few_shot import STOP, build_prompts, get_answer_value, truncate_at_stop
from mla_spec.eval.gsm_synth import Problem
from mla_spec.eval.report import EvalReport

__all__ = ["run_eval", "score_completions", "DEFAULT_MAX_NEW_TOKENS"]

# the longest worked answer is ~50 tokens; leave room for "\n\nQuestion" and a margin
DEFAULT_MAX_NEW_TOKENS = 64


def _field(r: Any, *names: str) -> Any:
    for n in names:
        if isinstance(r, dict) and n in r:
            return r[n]
        v = getattr(r, n, None)
        if v is not None:
            return v
    return None


def _engine_avg_accept(engine: Any) -> float | None:
    for src in (engine, getattr(engine, "metrics", None)):
        v = None if src is None else _field(src, "avg_accept_length", "avg_spec_accept_length")
        if callable(v):
            v = v()
        if v is not None:
            return float(v)
    return None


def score_completions(completions: Sequence[str], labels: Sequence[int]
                      ) -> tuple[float, float, list[int | None]]:
    """``(accuracy, invalid share, predictions)`` of completions against integer labels."""
    if len(completions) != len(labels):
        raise ValueError(f"{len(completions)} completions for {len(labels)} labels")
    preds = [get_answer_value(c) for c in completions]
    n = max(len(labels), 1)
    correct = sum(p is not None and p == y for p, y in zip(preds, labels))
    invalid = sum(p is None for p in preds)
    return correct / n, invalid / n, preds


def run_eval(engine_or_generate_fn: Any | Callable[..., Sequence[Any]],
             questions: Sequence[Problem], k_shots: int = 1, *,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop: Sequence[str] = STOP,
             name: str = "eval", shot_seed: int = 7, extra: dict[str, Any] | None = None
             ) -> EvalReport:
    """Few-shot evaluation of ``questions`` (greedy): each after ``k_shots`` solved training
    problems drawn with ``shot_seed`` (a shared prefix), stop strings as SGLang's few_shot_gsm8k.
    ``name`` labels the report, ``extra`` is carried into ``EvalReport.extra``."""
    if not questions:
        raise ValueError("run_eval needs at least one question")
    prompts = build_prompts(questions, k_shots, seed=shot_seed)
    gen = getattr(engine_or_generate_fn, "generate", engine_or_generate_fn)
    if not callable(gen):
        raise ValueError("engine_or_generate_fn must have .generate(...) or be callable")
    t0 = time.perf_counter()
    results = list(gen(prompts, max_new_tokens=max_new_tokens, stop=list(stop)))
    latency = time.perf_counter() - t0
    if len(results) != len(prompts):
        raise ValueError(f"generate returned {len(results)} results for {len(prompts)} prompts")

    texts, n_tokens, accepts, steps = [], 0, [], []
    for r in results:
        text = r if isinstance(r, str) else _field(r, "text", "output_text")
        texts.append(truncate_at_stop(str(text or ""), stop))
        ids = None if isinstance(r, str) else _field(r, "output_ids", "token_ids")
        n_tokens += len(ids) if ids is not None else 0
        al = None if isinstance(r, str) else _field(r, "accept_lengths")
        if al is not None:
            accepts.extend(int(a) for a in al)
            steps.append(len(al))
    accuracy, invalid, preds = score_completions(texts, [q.label for q in questions])
    avg_accept = (sum(accepts) / len(accepts) if accepts
                  else _engine_avg_accept(engine_or_generate_fn))
    return EvalReport(
        name=name, num_questions=len(questions), num_shots=k_shots, accuracy=accuracy,
        invalid=invalid, avg_accept_length=avg_accept, output_tokens=n_tokens, latency_s=latency,
        predictions=tuple(preds), completions=tuple(texts), accept_lengths=tuple(accepts),
        accept_steps=tuple(steps) if len(steps) == len(questions) else (), extra=dict(extra or {}))
