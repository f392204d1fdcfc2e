"""Faults: bad requests are refused clearly, a failed step fails only what it can blame, a hung
rank is named within the timeout, the CLI exits non-zero with the error. The module prints its
figures at the end: per probe, faults tried, refused clearly, good requests served, and good
requests lost or changed (must be 0)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from mock_runner import WordTokenizer, build_mock_runner, mock_greedy_reference

from mla_spec import cli
from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.engine import Engine, RequestRejectedError
from mla_spec.forward_mode import ForwardMode
from mla_spec.runtime.workers import RankFailedError
from mla_spec.scheduler import Scheduler

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [3], [10, 20, 30, 40, 50, 60]]
FIGURES: dict[str, list] = {}  # probe -> [tried, refused clearly, served, lost]
NOTES: list[str] = []


def _record(probe: str, tried: int, refused: int, served: int, lost: int) -> None:
    FIGURES[probe] = [tried, refused, served, lost]
    assert lost == 0 and refused == tried, (probe, FIGURES[probe])


@pytest.fixture(scope="module", autouse=True)
def _print_figures(pytestconfig):
    yield
    rows = [f"{'probe':38} {'tried':>5} {'refused':>7} {'served':>6} {'lost':>4}"]
    rows += [f"{p:38} {t:5d} {r:7d} {s:6d} {lost:4d}" for p, (t, r, s, lost) in FIGURES.items()]
    tot = [sum(v[i] for v in FIGURES.values()) for i in range(4)]
    rows.append(f"{'all':38} {tot[0]:5d} {tot[1]:7d} {tot[2]:6d} {tot[3]:4d}")
    tr = pytestconfig.pluginmanager.getplugin("terminalreporter")
    cap = pytestconfig.pluginmanager.getplugin("capturemanager")
    if tr is not None and cap is not None and FIGURES:
        with cap.global_and_fixture_disabled():
            tr.write_line("\nfault probes (tests/test_faults.py)\n" + "\n".join(rows + NOTES))


def _mock_engine(spec=None, **kw) -> Engine:
    return Engine(runner=build_mock_runner(num_pages=kw.pop("num_pages", 24), page_size=4),
                  spec=spec or SpecConfig(version="v2"), **kw)


def _lost(results, prompts, n) -> int:
    return sum(r.output_ids != mock_greedy_reference(p, n) or r.error is not None
               for r, p in zip(results, prompts))


def _clean(eng: Engine) -> bool:
    s = eng.scheduler
    return not s.has_work and s.allocator.num_free == s.num_pages - 1


_WordTok = WordTokenizer


# ---- requests refused when added ----------------------------------------------------------------
def test_bad_token_id_is_refused_and_poisons_nothing():
    """Token 500 (vocabulary 97) used to raise IndexError mid-step and leave its batch in the
    scheduler holding pages: every later call failed in spec/eagle.py."""
    eng = _mock_engine()
    bad = [[5, 6, 500], [4, -1], [2, 97]]
    res = eng.generate([PROMPTS[0], *bad, PROMPTS[1]], max_new_tokens=10)
    refused = sum(r.finished_reason == "abort" and "outside the vocabulary (ids 0..96)" in r.error
                  for r in res[1:4])
    lost = _lost([res[0], res[4]], PROMPTS[:2], 10)
    assert _clean(eng)
    again = eng.generate(PROMPTS, max_new_tokens=10)  # as a fresh engine would
    lost += _lost(again, PROMPTS, 10)
    _record("bad token id", len(bad), refused, 2 + len(PROMPTS), lost)


def test_argument_types_are_checked_before_anything_is_queued():
    eng = _mock_engine(tokenizer=_WordTok())
    tried = refused = 0
    for kw, err, match in [
        (dict(max_new_tokens=2.7), TypeError, r"max_new_tokens 2.7 \(float\): must be an int"),
        (dict(max_new_tokens=True), TypeError, "must be an int"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens 0: must be >= 1"),
        (dict(stop=[1]), TypeError, "must be None, a str or a list of str"),
        (dict(stop=5), TypeError, "must be None, a str or a list of str"),
        (dict(stop=["w3", ""]), ValueError, "empty stop string"),
    ]:
        tried += 1
        with pytest.raises(err, match=match):
            eng.generate([PROMPTS[0]], **{"max_new_tokens": 4, **kw})
        refused += 1
    for prompt, match in [(None, "must be a str or a sequence"), ([1, 2.5], "token ids are ints"),
                          ([1, True], "token ids are ints")]:
        tried += 1
        with pytest.raises(RequestRejectedError, match=match):
            eng.add_request(prompt, max_new_tokens=4)
        refused += 1
    assert _clean(eng)
    # a str stop is one stop string (it used to be split into its characters)
    ref = mock_greedy_reference([5, 6, 7], 12)
    word = f"w{ref[4]}"
    (a,) = eng.generate(["w5 w6 w7"], max_new_tokens=12, stop=word)
    (b,) = eng.generate(["w5 w6 w7"], max_new_tokens=12, stop=[word])
    assert a.finished_reason == b.finished_reason == "stop" and a.text == b.text
    _record("argument types", tried, refused, 2, int(a.output_ids != b.output_ids))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from mla_spec.checkpoint_writer import random_state_dict, save_checkpoint, tiny_config

    cfg = tiny_config()  # max_position_embeddings 512, vocab 256
    return save_checkpoint(random_state_dict(cfg, seed=0), cfg, tmp_path_factory.mktemp("tiny"),
                           quantize=False, dtype=torch.float32)


def _tiny_engine(path, **kw) -> Engine:
    kw = {"num_pages": 24, "max_reqs": 8, "max_context_len": 128, **kw}
    return Engine(path, spec=SpecConfig(version="v2"), attention_backend="torch",
                  cache=CacheConfig(page_size=16), device="cpu", **kw)


def test_prompt_longer_than_the_model_positions_is_refused(tiny_ckpt):
    eng = _tiny_engine(tiny_ckpt, max_context_len=1024, num_pages=70)
    with pytest.raises(RequestRejectedError, match="512 positions .max_position_embeddings.; "
                                                   "shorten it to at most 512 tokens"):
        eng.add_request([1] * 513, max_new_tokens=4)
    with pytest.warns(RuntimeWarning, match="past max_position_embeddings"):
        eng.add_request([1] * 500, max_new_tokens=20)
    _record("prompt past max_position_embeddings", 1, 1, 0, 0)


def test_scheduler_advice_is_never_negative():
    """'lower max_new_tokens to at most -12' used to be the advice for a prompt alone too long."""
    s = Scheduler(num_pages=64, page_size=4, max_reqs=4, max_context_len=64, step_rows=4)
    with pytest.raises(RequestRejectedError, match="shorten the prompt to at most 59 tokens, "
                                                   "or raise max_context_len to >= 82"):
        s.check_fits(70, 8)
    with pytest.raises(RequestRejectedError, match="lower max_new_tokens to at most 20"):
        s.check_fits(40, 30)
    s = Scheduler(num_pages=64, page_size=4, max_reqs=4, max_context_len=5, step_rows=4)
    with pytest.raises(RequestRejectedError, match=r"step rows\) > max_context_len 5: raise "
                                                   "max_context_len to >= 9"):
        s.check_fits(3, 2)


# ---- a step that raises -------------------------------------------------------------------------
def _raise_when(runner, pred, what: str):
    """Make the runner's forwards raise while ``pred(batch, input_ids)`` holds."""
    orig = runner.forward_eager

    def forward(which, batch, input_ids, target_hidden=None):
        if pred(batch, input_ids):
            raise RuntimeError(what)
        return orig(which, batch, input_ids, target_hidden)

    runner.forward_eager = forward


@pytest.mark.parametrize("spec", [SpecConfig.off(), SpecConfig(version="v1"),
                                  SpecConfig(version="v2")], ids=["off", "v1", "v2"])
def test_failed_step_fails_only_what_it_can_blame(spec):
    """A transient failure in a batch of four: every request is recomputed, none lost. A request
    whose input fails every prefill (a token no good request holds stands for an input the
    checks let through): it alone ends with "error"; the others' tokens equal a clean run's."""
    eng = _mock_engine(spec)
    fired = []

    def once(batch, ids):  # the third decode-side forward of all four requests
        if batch.forward_mode != ForwardMode.EXTEND and batch.batch_size == 4:
            fired.append(1)
            return len(fired) == 3
        return False

    _raise_when(eng.runner, once, "transient")
    res = eng.generate(PROMPTS, max_new_tokens=12)
    lost = _lost(res, PROMPTS, 12)
    assert _clean(eng) and len(fired) > 3

    eng = _mock_engine(spec)
    used = {t for p in PROMPTS for t in p + mock_greedy_reference(p, 12)}
    tok = min(set(range(97)) - used)
    _raise_when(eng.runner, lambda b, ids: b.forward_mode == ForwardMode.EXTEND
                and bool((ids == tok).any()), "planted input fault")
    bad = eng.scheduler.add([4, tok, 2], 8, stop_token_ids=eng.stop_token_ids)
    res = eng.generate(PROMPTS, max_new_tokens=12)
    assert bad.finished_reason == "error" and "RuntimeError: planted input fault" in bad.error
    lost += _lost(res, PROMPTS, 12)
    assert _clean(eng)
    lost += _lost(eng.generate(PROMPTS, max_new_tokens=12), PROMPTS, 12)  # as a fresh engine
    _record(f"step raises ({spec.version if spec.enabled else 'spec off'})", 2, 2,
            3 * len(PROMPTS), lost)


def test_interrupted_generate_leaves_nothing_queued():
    """Ctrl-C mid-call: its requests end with "error" and free their pages; they are not decoded
    quietly during the next call (which equals a fresh engine's)."""
    eng = _mock_engine()
    calls = []

    def interrupt(batch, ids):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return False

    _raise_when(eng.runner, interrupt, "unused")
    apart = eng.add_request(PROMPTS[1], max_new_tokens=12)  # not the call's: stays, consistent
    with pytest.raises(KeyboardInterrupt):
        eng.generate(PROMPTS, max_new_tokens=12)
    s = eng.scheduler
    assert [r.rid for r in [*s.waiting, *s.running]] == [apart.rid]
    lost = _lost(eng.generate(PROMPTS, max_new_tokens=12), PROMPTS, 12)
    lost += _lost([apart], PROMPTS[1:2], 12)
    assert _clean(eng)
    _record("interrupted generate", 1, 1, len(PROMPTS) + 1, lost)


def test_backend_exception_and_bad_input_mid_step_real_model(tiny_ckpt, monkeypatch):
    """The real model: the attention backend raises once in a decode round, and a request whose
    token id is past the vocabulary (added behind the checks' back) fails the embedding."""
    prompts = [[0, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 3]]
    ref = [r.output_ids for r in _tiny_engine(tiny_ckpt).generate(prompts, max_new_tokens=6)]
    eng = _tiny_engine(tiny_ckpt)
    backend = eng.runner.backends["target"]
    orig, fired = backend.forward, []

    def forward(q_nope, q_pe, layer_id, batch, **kw):
        if batch.forward_mode.is_target_verify() and batch.batch_size == 3 and not fired:
            fired.append(layer_id)
            raise RuntimeError("backend fault on purpose")
        return orig(q_nope, q_pe, layer_id, batch, **kw)

    monkeypatch.setattr(backend, "forward", forward)
    bad = eng.scheduler.add([0, 4, 999], 4, stop_token_ids=())
    res = eng.generate(prompts, max_new_tokens=6)
    assert fired
    assert bad.finished_reason == "error" and "IndexError" in bad.error, bad.error
    lost = sum(r.output_ids != o or r.error is not None for r, o in zip(res, ref))
    assert _clean(eng)
    lost += sum(r.output_ids != o for r, o in zip(eng.generate(prompts, max_new_tokens=6), ref))
    _record("backend raises / bad id (real model)", 2, 2, 2 * len(prompts), lost)


# ---- checkpoints, quantizers, configs -----------------------------------------------------------
@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory):
    return cli.random_demo_checkpoint(tmp_path_factory.mktemp("demo"))


def _nan_copy(src, dst):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    sd["model.norm.weight"][3] = float("nan")
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_nan_checkpoint_refused_at_load_engine_and_cli(demo_ckpt, tmp_path, capsys):
    from mla_spec.loader import CheckpointError

    bad = _nan_copy(demo_ckpt, tmp_path / "nan")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*NaN"):
        Engine(bad, spec=SpecConfig.off(), attention_backend="torch", device="cpu")
    Engine(bad, spec=SpecConfig.off(), attention_backend="torch", device="cpu",
           check_finite=False)  # the scan is what refused it
    gen = ["generate", "--model", str(bad), "--prompt", "Question:", "--max-new-tokens", "2",
           "--page-size", "16", "--spec", "off"]
    assert cli.main(gen) == 1
    err = capsys.readouterr().err
    assert err.startswith("mla-spec: error: ") and "model.norm.weight" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert cli.main([*gen, "--no-check-finite"]) == 0
    _record("NaN weight checkpoint", 2, 2, 1, 0)


def test_non_finite_quantizer_input_is_refused():
    from mla_spec.quant.fp8 import fp8_scale_for
    from mla_spec.quant.nvfp4 import quantize_nvfp4

    w = torch.randn(4, 32)
    w[1, 5] = float("inf")
    with pytest.raises(ValueError, match="inf"):
        quantize_nvfp4(w)
    w[1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN|nan"):
        fp8_scale_for(w)
    _record("non-finite quantizer input", 2, 2, 0, 0)


def test_missing_config_key_is_a_clean_cli_error(demo_ckpt, tmp_path, capsys):
    """ModelConfig.from_hf raising in the CLI's checks used to end in a traceback."""
    d = shutil.copytree(demo_ckpt, tmp_path / "nokey")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["kv_lora_rank"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(d), "--prompt", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "missing or null key(s) 'kv_lora_rank'" in err, err
    _record("missing config key", 1, 1, 0, 0)


# ---- the command line -----------------------------------------------------------------------
def test_cli_exits_nonzero_with_the_errors(demo_ckpt, capsys):
    """--k-shots 200 printed accuracy 0.000 and 'spec off' (spec was v2) and exited 0; --json
    dropped the error text."""
    demo = ["demo", "--model", str(demo_ckpt), "--tp", "1", "--num-questions", "2",
            "--k-shots", "200", "--page-size", "16", "--device", "cpu"]
    assert cli.main([*demo, "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["spec"] == "v2" and len(rep["errors"]) == 2
    assert all("max_position_embeddings" in e["error"] for e in rep["errors"])
    assert cli.main(demo) == 1
    out = capsys.readouterr().out
    assert "spec off" not in out and "2 of 2 requests ended in error" in out
    assert "--k-shots" in out  # the demo's advice names the flag that shortens its prompts
    ok = ["generate", "--model", str(demo_ckpt), "--prompt", "Question:", "--max-new-tokens", "3",
          "--page-size", "16", "--json"]
    assert cli.main(ok) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["error"] is None
    # advice in flags that exist, never a negative count
    ok[4] = "Question: Tom has 12 apples and buys 7 more."
    assert cli.main([*ok[:-1], "--max-context-len", "8", "--json"]) == 1
    err = json.loads(capsys.readouterr().out)["results"][0]["error"]
    assert "shorten the prompt to at most 3 tokens, or raise --max-context-len to >=" in err, err
    assert not re.search(r"(?<![-\w])-\d", err)
    args = cli.build_parser().parse_args(["demo", "--timeout-s", "7", "--max-context-len", "99"])
    assert (args.timeout_s, args.max_context_len) == (7.0, 99)
    _record("CLI exit codes", 3, 3, 1, 0)


def _spawned_children(pid: int) -> list[int]:
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            cmd = open(f"/proc/{d}/cmdline").read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and "spawn_main" in cmd and "resource_tracker" not in cmd:
            out.append(int(d))
    return sorted(out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_ctrl_c_ends_with_one_line(demo_ckpt):
    """SIGINT to the process group mid-run: one line, exit 130, no tracebacks from the ranks."""
    cmd = [sys.executable, "-m", "mla_spec.cli", "demo", "--model", str(demo_ckpt), "--tp", "2",
           "--device", "cpu", "--num-questions", "40", "--max-new-tokens", "60",
           "--page-size", "16"]
    env = {k: v for k, v in os.environ.items()  # as a user runs it: torch twins on CPU
           if k not in ("TRITON_INTERPRET", "MLA_SPEC_TRITON_ON_CPU")}
    # SIGINT at its default in the child even where this runs as a background job (which
    # inherits SIGINT ignored, and Python then keeps it ignored)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**env, "OMP_NUM_THREADS": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err, started = [], threading.Event()

    def read():
        for line in iter(p.stderr.readline, ""):
            err.append(line)
            started.set() if "requests:" in line else None

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        assert started.wait(120), "".join(err)
        ranks = _spawned_children(p.pid)
        time.sleep(0.5)
        os.killpg(p.pid, signal.SIGINT)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        t.join(5)
    lines = [ln for ln in "".join(err).split("\n") if ln.strip() and "requests:" not in ln]
    assert p.returncode == 130 and lines == ["mla-spec: interrupted"], "".join(err)[-3000:]
    assert len(ranks) == 1 and not any(os.path.exists(f"/proc/{r}") for r in ranks)
    _record("Ctrl-C (CLI, TP 2)", 1, 1, 0, 0)


# ---- a hung rank ------------------------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_hung_rank_is_named_within_the_timeout(tiny_ckpt):
    """SIGSTOP rank 1 of a warm TP 2 engine: RankFailedError naming it within timeout_s plus a
    few seconds (a gloo timeout of 300 s and a misnamed rank before), and no process left."""
    timeout = 4.0
    eng = Engine(tiny_ckpt, tp_size=2, spec=SpecConfig(version="v2"), attention_backend="torch",
                 cache=CacheConfig(page_size=16), num_pages=16, max_reqs=4, max_context_len=64,
                 timeout_s=timeout)
    try:
        warm = eng.generate([[0, 1, 2]], max_new_tokens=6)  # every step kind has run once
        pid = eng.workers.processes[0].pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 is stopped \(process state T") as e:
            eng.generate([[0, 4, 5]], max_new_tokens=4)
        waited = time.monotonic() - t0
    finally:
        eng.shutdown()
    NOTES.append(f"hung rank named after {waited:.2f} s (timeout_s {timeout:g}): {e.value}")
    assert timeout <= waited < timeout + 5
    assert eng.workers is None and not os.path.exists(f"/proc/{pid}")
    _record("hung rank (SIGSTOP, TP 2)", 1, 1, len(warm), 0)
