"""The few-shot arithmetic task the embedded model is scored on: data, prompts, scoring, report.

``gsm_synth`` generates GSM8K-format word problems (train / held-out splits), ``few_shot`` builds
SGLang-style k-shot prompts and scores by the last integer, ``tokenizer`` makes the word-level
``tokenizer.json``, ``report`` holds ``EvalReport``, ``harness.run_eval`` ties them together
and ``sweep`` runs the embedded model through the engine in every serving configuration.
"""

from mla_spec.eval.few_shot import (
    STOP,
    build_prompt,
    build_prompts,
    few_shot_examples,
    get_answer_value,
    truncate_at_stop,
)
from mla_spec.eval.gsm_synth import (
    Problem,
    format_qa,
    heldout_problems,
    is_heldout,
    make_problem,
    train_problems,
)
from mla_spec.eval.harness import DEFAULT_MAX_NEW_TOKENS, run_eval, score_completions
from mla_spec.eval.report import EvalReport, format_table
from mla_spec.eval.sweep import (
    EMBEDDED_MODEL,
    EvalConfig,
    config_grid,
    dequantize_checkpoint,
    run_config,
    run_sweep,
)
from mla_spec.eval.tokenizer import build_tokenizer, load_tokenizer

__all__ = ["EMBEDDED_MODEL", "EvalConfig", "config_grid", "dequantize_checkpoint", "run_config",
           "run_sweep", "DEFAULT_MAX_NEW_TOKENS", "EvalReport", "Problem", "STOP", "build_prompt",
           "build_prompts", "build_tokenizer", "few_shot_examples", "format_qa", "format_table",
           "get_answer_value", "heldout_problems", "is_heldout", "load_tokenizer", "make_problem",
           "run_eval", "score_completions", "train_problems", "truncate_at_stop"]
