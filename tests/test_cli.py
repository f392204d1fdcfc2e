"""The ``mla-spec`` command: flag errors say what would work; demo and generate run end to end."""

from __future__ import annotations

import json

import pytest
import torch

from mla_spec import cli


def _err(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory):
    return cli.random_demo_checkpoint(tmp_path_factory.mktemp("demo_ckpt"))


def test_bad_flags_say_what_would_work(capsys, demo_ckpt):
    m = str(demo_ckpt)
    assert "invalid choice" in _err(capsys, ["demo", "--spec", "v3"])
    assert "num_steps + 1" in _err(capsys, ["generate", "--model", m, "--prompt", "x",
                                            "--num-steps", "3", "--num-draft-tokens", "5"])
    msg = _err(capsys, ["generate", "--model", m, "--prompt", "x", "--tp", "3"])
    assert "use one of [1, 2, 4]" in msg
    assert "no config.json" in _err(capsys, ["generate", "--model", "/nonexistent",
                                             "--prompt", "x"])
    assert "--num-questions 0" in _err(capsys, ["demo", "--num-questions", "0"])
    if not torch.cuda.is_available():
        assert "use --device cpu" in _err(capsys, ["generate", "--model", m, "--prompt", "x",
                                                   "--device", "cuda"])
        msg = _err(capsys, ["generate", "--model", m, "--prompt", "x",
                            "--attention-backend", "flashinfer"])
        assert "backends that can" in msg and "torch" in msg
    msg = _err(capsys, ["generate", "--model", m, "--prompt", "x", "--attention-backend",
                        "trtllm", "--page-size", "16"])
    assert "--page-size 32 or 64" in msg


def test_generate_text(capsys, demo_ckpt):
    assert cli.main(["generate", "--model", str(demo_ckpt), "--prompt", "Question: Tom has",
                     "--max-new-tokens", "5", "--page-size", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["results"][0]["output_ids"]) <= 5 and out["results"][0]["error"] is None
    assert out["metrics"]["generated_tokens"] >= 1


def test_demo_json_report(capsys, demo_ckpt):
    assert cli.main(["demo", "--model", str(demo_ckpt), "--tp", "1", "--num-questions", "2",
                     "--max-new-tokens", "6", "--page-size", "16", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["num_questions"] == 2 and 0.0 <= rep["accuracy"] <= 1.0 and rep["errors"] == []
    assert 1.0 <= rep["avg_accept_length"] <= 4.0
    modes = {(r["model"], r["mode"]) for r in rep["modes"]}
    assert ("target", "TARGET_VERIFY") in modes and ("draft", "DRAFT_EXTEND_V2") in modes
    text = cli.format_demo_report(rep)
    assert "avg accept length" in text and "TARGET_VERIFY" in text


def test_memory_plan(capsys):
    assert cli.main(["memory-plan", "--tp", "4", "--gpu", "H200", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["tp"] == 4 and plan["max_tokens"] > 0
    assert "must divide" in _err(capsys, ["memory-plan", "--tp", "3"])


def test_counts_and_stop_strings_are_checked_before_starting(capsys, demo_ckpt):
    """--max-new-tokens 0 used to run 64 tokens (``0 or 64``), --k-shots -1 ended in a
    traceback after the engine started, and --stop '' stopped every prompt at its first token."""
    m = str(demo_ckpt)
    gen = ["generate", "--model", m, "--prompt", "x"]
    assert "--max-new-tokens 0: must be >= 1" in _err(capsys, [*gen, "--max-new-tokens", "0"])
    assert "--max-new-tokens -3: must be >= 1" in _err(capsys, ["demo", "--model", m,
                                                                "--max-new-tokens", "-3"])
    assert "--k-shots -1: must be >= 0" in _err(capsys, ["demo", "--model", m, "--k-shots", "-1"])
    assert "empty stop string" in _err(capsys, [*gen, "--stop", "Q", "--stop", ""])
