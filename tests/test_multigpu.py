"""Tensor parallelism on several GPUs over NCCL (``pytest -m multigpu``), and their CPU twins.

The ``multigpu`` tests (auto-skipped with fewer than 2 GPUs by ``tests/conftest.py``) run on
``WORLD = min(4, GPUs)`` ranks with NVLink multicast off:

- NCCL collectives: ``tp_all_reduce`` / ``tp_all_gather`` (bf16, fp32, irregular sizes) equal the
  host's sum / concatenation; vocab-parallel embedding + lm_head equal TP 1;
- a rank SIGKILLed mid-run ends ``launch`` with ``RankFailedError`` naming it within 15 s, and an
  ``Engine`` whose worker is killed during ``generate`` raises ``RankFailedError`` within 20 s
  (the watchdog aborts the NCCL communicators rank 0 is blocked on);
- the Engine on the embedded model with CUDA graphs, FP8 KV, spec v2: TP WORLD vs TP 1 give the
  same answers (>= 90% token-identical sequences); on the model card's 500 questions (2-shot) the
  accuracy lies in the card's 95% interval (``eval_cpu.json``), the average accept length is
  above SGLang CI's bar (2.04), and the answers equal spec off's.

Everything that starts an Engine runs in a subprocess (``_SCRIPT``) with a hard timeout that
kills its whole process group: a hang fails its test instead of hanging pytest (and the one GPU
call it runs in). No ``pytest.mark.timeout``: pytest-timeout may be missing on the GPU host.

The unmarked tests run on CPU: ``bench_allreduce.py --device cpu``, and the fail-fast pieces of
``mla_spec.runtime.workers`` that the GPU tests rely on (hard exit, orphaned workers leave, the
NCCL abort helper is a no-op without NCCL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mla_spec.distributed import tp_all_gather, tp_all_reduce
from mla_spec.eval.report import EvalReport
from mla_spec.eval.sweep import EMBEDDED_MODEL, EvalConfig
from mla_spec.runtime.launch import launch
from mla_spec.runtime.workers import RankFailedError

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = min(4, GPUS)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
HAS_MODEL = (EMBEDDED_MODEL / "model.safetensors").exists()

multigpu = pytest.mark.multigpu
needs_model = pytest.mark.skipif(not HAS_MODEL, reason=f"embedded model missing at "
                                 f"{EMBEDDED_MODEL} (run scripts/train_tiny.py)")


@pytest.fixture
def nccl_env(monkeypatch):
    for k, v in NCCL_ENV.items():
        monkeypatch.setenv(k, os.environ.get(k, v))


def _subprocess_env() -> dict:
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in NCCL_ENV.items()}}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MLA_SPEC_HARD_EXIT_S", "15")  # as the CLI does: a stuck rank 0 exits
    return env


def _run(args: list[str], timeout_s: float, what: str) -> tuple[int, str]:
    """Run ``python args...`` in its own session; kill the whole group on timeout (fail)."""
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env=_subprocess_env(), cwd=str(ROOT))
    try:
        log, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        log, _ = p.communicate()
        pytest.fail(f"{what}: no result after {timeout_s:.0f} s (hung?); output tail:\n"
                    f"{log[-4000:]}")
    return p.returncode, log


# ---------------------------------------------------------------------------------------------
# (a) NCCL collectives
# ---------------------------------------------------------------------------------------------
SHAPES = ((1, 1), (3, 7168), (5, 129), (17, 1000))


def _ints(rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def _reals(rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randn(shape, generator=g)


def _collectives(rank, world):
    dev = torch.device("cuda", rank)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for shape in SHAPES:
            x = _ints(rank, shape, dtype).to(dev)
            out.append((tp_all_reduce(x.clone()), tp_all_gather(x)))
    for shape in SHAPES:  # non-integer fp32: order of summation may differ from the host's
        out.append((tp_all_reduce(_reals(rank, shape).to(dev)), None))
    return out


@multigpu
def test_nccl_all_reduce_and_all_gather(nccl_env):
    outs = launch(_collectives, WORLD, backend="nccl", timeout_s=60, run_timeout_s=180)
    for rank_out in outs:
        i = 0
        for dtype in (torch.bfloat16, torch.float32):
            for shape in SHAPES:
                red, gat = rank_out[i]
                i += 1
                want = sum(_ints(r, shape, torch.float32) for r in range(WORLD)).to(dtype)
                assert red.dtype == dtype and torch.equal(red, want), (dtype, shape)
                cat = torch.cat([_ints(r, shape, dtype) for r in range(WORLD)], dim=-1)
                assert torch.equal(gat, cat), (dtype, shape)
        for shape in SHAPES:
            red, _ = rank_out[i]
            i += 1
            torch.testing.assert_close(red, sum(_reals(r, shape) for r in range(WORLD)),
                                       rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[0], outs[-1]):  # every rank receives the same bits
        assert torch.equal(a[0], b[0])


VOCAB, DIM = 96, 40  # 96 splits 2, 3 and 4 ways


def _vocab_weights(dtype):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(VOCAB, DIM, generator=g).to(dtype),
            (torch.randn(VOCAB, DIM, generator=g) / DIM**0.5).to(dtype),
            torch.randint(0, VOCAB, (2, 11), generator=g),
            torch.randn(7, DIM, generator=g).to(dtype))


def _vocab_parallel(rank, world, dtype):
    from mla_spec.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

    dev = torch.device("cuda", rank)
    emb_w, head_w, ids, hidden = _vocab_weights(dtype)
    emb = VocabParallelEmbedding(VOCAB, DIM, tp_rank=rank, tp_size=world, dtype=dtype,
                                 device=dev)
    head = ParallelLMHead(DIM, VOCAB, tp_rank=rank, tp_size=world, dtype=dtype, device=dev)
    n = VOCAB // world
    with torch.no_grad():
        if emb.sharded:
            emb.weight.copy_(emb_w[rank * n:(rank + 1) * n])
            head.weight.copy_(head_w[rank * n:(rank + 1) * n])
        else:
            emb.weight.copy_(emb_w)
            head.weight.copy_(head_w)
        return emb(ids.to(dev)), head.logits(hidden.to(dev))


@multigpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_vocab_parallel_matches_tp1_on_gpus(nccl_env, dtype):
    ref_e, ref_l = (t.cpu() for t in _vocab_parallel_tp1(dtype))
    outs = launch(_vocab_parallel, WORLD, backend="nccl", args=(dtype,), timeout_s=60,
                  run_timeout_s=180)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for e, logits in outs:
        assert torch.equal(e, ref_e)  # one non-zero contribution per row: exact
        assert logits.shape == (7, VOCAB) and logits.dtype == torch.float32
        torch.testing.assert_close(logits, ref_l, **tol)
        assert torch.equal(logits, outs[0][1])


def _vocab_parallel_tp1(dtype):
    """TP 1 on GPU 0 in this process (no process group: the collectives are no-ops)."""
    return _vocab_parallel(0, 1, dtype)


# ---------------------------------------------------------------------------------------------
# (d i) a dead rank under NCCL ends launch() fast
# ---------------------------------------------------------------------------------------------
def _all_reduce_then_die(rank, world, stamp):
    x = torch.ones(1024, device=torch.device("cuda", rank))
    tp_all_reduce(x)
    torch.cuda.synchronize()
    if rank == 1:
        Path(stamp).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(100_000):  # the survivors block in a GPU sync on a collective
        tp_all_reduce(x.fill_(1.0))
        x.sum().item()
    return None


@multigpu
def test_dead_rank_under_nccl_fails_fast(nccl_env, tmp_path):
    stamp = tmp_path / "killed_at"
    with pytest.raises(RankFailedError, match="rank 1"):
        launch(_all_reduce_then_die, WORLD, backend="nccl", args=(str(stamp),), timeout_s=60,
               run_timeout_s=90)
    after = time.time() - float(stamp.read_text())
    print(f"\nRankFailedError {after:.1f} s after rank 1 was killed")
    assert after < 15  # the NCCL collective timeout (60 s here) did not end it


# ---------------------------------------------------------------------------------------------
# The Engine on GPUs: one script, a mode per test, each in its own process group
# ---------------------------------------------------------------------------------------------
_SCRIPT = textwrap.dedent('''
    import json, logging, os, signal, sys, threading, time
    from pathlib import Path

    import torch

    from mla_spec.engine import Engine
    from mla_spec.eval import STOP, build_prompts, get_answer_value, heldout_problems
    from mla_spec.eval import truncate_at_stop
    from mla_spec.eval.sweep import EMBEDDED_MODEL, EvalConfig, run_config

    MAX_NEW = 56


    def engine(tp, spec="v2", sizes=(1, 2, 4, 8, 16)):
        cfg = EvalConfig("fp4", "fp8", tp, spec)
        return Engine(EMBEDDED_MODEL, tp_size=tp, spec=cfg.spec_config(),
                      cache=cfg.cache_config(), attention_backend="auto", device="cuda",
                      max_reqs=16, max_context_len=512, cuda_graph=True,
                      graph_batch_sizes=sizes, timeout_s=60)


    def graphs_off(eng):
        g = eng.runner.graphs
        return "no graph runner" if g is None else g.disabled_reason


    def compare(world, n=16):
        prompts = build_prompts(heldout_problems(n), 1)
        out = {}
        for tp in (world, 1):
            t0 = time.perf_counter()
            with engine(tp) as eng:
                res = eng.generate(prompts, MAX_NEW, list(STOP))
                out[str(tp)] = {
                    "ids": [r.output_ids for r in res],
                    "answers": [get_answer_value(truncate_at_stop(r.text)) for r in res],
                    "graphs_off": graphs_off(eng), "accept": eng.avg_accept_length,
                    "backend": eng.runner.backends["target"].name,
                    "seconds": time.perf_counter() - t0}
        return out


    def suite(world, n=500):
        qs = heldout_problems(n)
        kw = dict(k_shots=2, device="cuda", attention_backend="auto",
                  engine_kw={"cuda_graph": True, "timeout_s": 60})
        out = {}
        for spec in ("v2", "off"):
            t0 = time.perf_counter()
            r = run_config(EvalConfig("fp4", "fp8", world, spec), qs, **kw)
            out[spec] = {"accuracy": r.accuracy, "avg_accept_length": r.avg_accept_length,
                         "num_questions": r.num_questions, "completions": list(r.completions),
                         "predictions": list(r.predictions),
                         "latency_s": r.latency_s, "tokens_per_s": r.tokens_per_s,
                         "modes": r.extra.get("modes"), "seconds": time.perf_counter() - t0}
        return out


    def kill(world):
        prompts = build_prompts(heldout_problems(16), 1)
        eng = engine(world, sizes=(4, 16))
        eng.generate(prompts[:4], 8, list(STOP))  # every rank up, graphs captured
        workers = eng.workers
        victim = workers.processes[-1]
        killed = {}

        def killer():
            time.sleep(0.3)
            killed["t"] = time.monotonic()
            print("KILLED", time.time(), flush=True)  # the hard-exit outcome is timed from it
            os.kill(victim.pid, signal.SIGKILL)

        threading.Thread(target=killer, daemon=True).start()
        err, t_start = None, time.monotonic()
        try:
            while time.monotonic() - t_start < 60:
                eng.generate(prompts, MAX_NEW, list(STOP))
        except BaseException as e:  # noqa: BLE001 - reported
            err = e
        t_err = time.monotonic()
        eng.shutdown()
        return {"raised": type(err).__name__ if err is not None else None,
                "message": str(err)[:1000], "victim_rank": world - 1,
                "seconds_after_kill": t_err - killed.get("t", t_err),
                "aborted": workers.aborted, "failure": workers.failure,
                "alive_after": [p.is_alive() for p in workers.processes]}


    if __name__ == "__main__":
        logging.basicConfig(level=logging.WARNING)
        mode, out_path = sys.argv[1], sys.argv[2]
        world = min(4, torch.cuda.device_count())
        res = {"compare": compare, "suite": suite, "kill": kill}[mode](world)
        res["world"] = world
        Path(out_path).write_text(json.dumps(res))
        print("DONE", mode, flush=True)
        sys.stderr.flush()
        os._exit(0)  # never wait on process-group teardown at interpreter exit
''')


def _engine_run(tmp_path, mode: str, timeout_s: float) -> dict:
    script = tmp_path / "multigpu_engine.py"
    script.write_text(_SCRIPT)
    out = tmp_path / f"{mode}.json"
    t0 = time.monotonic()
    rc, log = _run([str(script), mode, str(out)], timeout_s, f"engine {mode}")
    assert rc == 0 and out.exists(), f"engine {mode}: exit code {rc}; output tail:\n{log[-4000:]}"
    res = json.loads(out.read_text())
    print(f"\n[{mode}] {time.monotonic() - t0:.1f} s wall, world {res['world']}")
    return res


@multigpu
@needs_model
def test_engine_tp_matches_tp1_on_gpus(tmp_path):
    res = _engine_run(tmp_path, "compare", timeout_s=300)
    tp, one = res[str(WORLD)], res["1"]
    for r in (tp, one):
        assert r["graphs_off"] is None, f"CUDA graphs were not used: {r['graphs_off']}"
    diff = [i for i, (a, b) in enumerate(zip(tp["answers"], one["answers"])) if a != b]
    same = sum(a == b for a, b in zip(tp["ids"], one["ids"]))
    n = len(one["ids"])
    print(f"TP {WORLD} vs TP 1: {same}/{n} sequences token-identical, answers differ at {diff}; "
          f"accept {tp['accept']:.3f} vs {one['accept']:.3f}; backend {tp['backend']}; "
          f"{tp['seconds']:.1f} s vs {one['seconds']:.1f} s")
    assert not diff, f"answers differ at {diff}: {[tp['answers'][i] for i in diff]} vs " \
                     f"{[one['answers'][i] for i in diff]}"
    assert same >= 0.9 * n, f"only {same}/{n} sequences token-identical"


@multigpu
@needs_model
def test_sglang_ci_bars_accuracy_accept_length_tp_gpus(tmp_path):
    """SGLang's per-commit 4-GPU suite on the embedded model: TP WORLD, CUDA graphs, FP8 KV,
    spec v2; the model card's 500 held-out questions, 2 shots, its accuracy interval."""
    res = _engine_run(tmp_path, "suite", timeout_s=420)
    v2, off = res["v2"], res["off"]
    print(f"TP {WORLD} spec v2: accuracy {v2['accuracy']:.3f}, accept "
          f"{v2['avg_accept_length']:.3f}, {v2['tokens_per_s']:.0f} tok/s, "
          f"{v2['latency_s']:.1f} s generate / {v2['seconds']:.1f} s with start-up; "
          f"spec off {off['accuracy']:.3f}, {off['tokens_per_s']:.0f} tok/s")
    card = json.loads((EMBEDDED_MODEL / "eval_cpu.json").read_text())["sweep"]["reports"]
    shipped = next(EvalReport.from_dict(r) for r in card
                   if r["name"] == EvalConfig("fp4", "fp8", 1, "v2").name)
    lo, hi = shipped.accuracy_interval()
    assert v2["num_questions"] == shipped.num_questions
    assert lo <= v2["accuracy"] <= hi, f"{v2['accuracy']:.3f} not in the card's {lo:.3f}-{hi:.3f}"
    assert v2["avg_accept_length"] is not None and v2["avg_accept_length"] > 2.04
    text = sum(a != b for a, b in zip(v2["completions"], off["completions"]))
    diff = [i for i, (a, b) in enumerate(zip(v2["predictions"], off["predictions"])) if a != b]
    print(f"spec v2 vs off: {len(diff)} answers and {text} completions differ")
    assert not diff, f"{len(diff)} answers differ from spec off, first {diff[:5]}"


@multigpu
@needs_model
def test_engine_dead_worker_under_nccl_raises(tmp_path):
    """A worker killed mid-generate ends the run with an error naming it, within seconds.

    Two outcomes count. The NCCL abort unblocks rank 0, which raises ``RankFailedError``; or,
    when rank 0's CUDA graphs hold the communicator (the abort then blocks: seen on 4 H200s),
    the watchdog's hard exit (``MLA_SPEC_HARD_EXIT_S``, 15 s here, on in the CLI) logs the dead
    rank, kills the workers and exits non-zero.
    """
    script = tmp_path / "multigpu_engine.py"
    script.write_text(_SCRIPT)
    out = tmp_path / "kill.json"
    rc, log = _run([str(script), "kill", str(out)], 240, "engine kill")
    ended = time.time()
    world = min(4, torch.cuda.device_count())
    if rc == 0 and out.exists():
        res = json.loads(out.read_text())
        print(f"killed rank {res['victim_rank']}: {res['raised']} after "
              f"{res['seconds_after_kill']:.1f} s (abort: {res['aborted']}): "
              f"{res['message'][:200]}")
        assert res["raised"] == "RankFailedError", res
        assert f"rank {res['victim_rank']}" in res["message"], res
        assert res["seconds_after_kill"] < 20, res
        assert not any(res["alive_after"]), res
        return
    killed = [float(line.split()[1]) for line in log.splitlines() if line.startswith("KILLED ")]
    assert killed, f"exit code {rc} before the kill; output tail:\n{log[-4000:]}"
    after = ended - killed[0]
    print(f"killed rank {world - 1}: hard exit (code {rc}) {after:.1f} s later")
    assert rc != 0 and f"rank {world - 1} died" in log and "hard_exit_after_s" in log, log[-4000:]
    assert after < 25, f"{after:.1f} s after the kill; output tail:\n{log[-4000:]}"


# ---------------------------------------------------------------------------------------------
# CPU (no marker): the benchmark's gloo smoke test and the fail-fast pieces
# ---------------------------------------------------------------------------------------------
def test_bench_allreduce_cpu_smoke(tmp_path):
    out = tmp_path / "ar.json"
    rc, log = _run(["benchmarks/bench_allreduce.py", "--device", "cpu", "--world", "2",
                    "--json", str(out)], 60, "bench_allreduce --device cpu")
    assert rc == 0, log[-3000:]
    assert "allreduce over 2 ranks" in log and "estimate" in log
    d = json.loads(out.read_text())
    assert d["meta"]["world"] == 2 and d["meta"]["backend"] == "gloo"
    assert [r["rows"] for r in d["allreduce"]] == [1, 4, 16]
    for r in d["allreduce"] + d["allgather"]:
        assert r["eager_us"] > 0 and r["graph_us"] is None and r["estimate_us"] > 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from projection import load_measured_link

    link = load_measured_link(out)
    assert link.tp_size == 2 and link.allreduce_us(14336, 2) > 0


_HARD_EXIT = textwrap.dedent('''
    import os, signal, sys, time
    import torch.distributed as dist
    from mla_spec.runtime.workers import spawn_workers

    def worker(rank, world):
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)

    if __name__ == "__main__":
        w = spawn_workers(2, worker, backend="gloo", timeout_s=30, interrupt_main=False,
                          hard_exit_after_s=float(sys.argv[1]) if len(sys.argv) > 1 else None)
        dist.barrier()
        print("PID", w.processes[0].pid, flush=True)
        if len(sys.argv) > 1:
            time.sleep(60)  # rank 0 "stuck": never shuts the workers down
        os._exit(0)  # leave at once, without shutting the worker down
''')


def test_hard_exit_when_rank0_stays_stuck(tmp_path):
    script = tmp_path / "hard_exit.py"
    script.write_text(_HARD_EXIT)
    t0 = time.monotonic()
    rc, log = _run([str(script), "1.0"], 60, "hard exit")
    assert rc == 1, log[-3000:]
    assert time.monotonic() - t0 < 40  # not the 60 s sleep
    assert "rank 1 died" in log and "hard_exit_after_s" in log, log[-3000:]


def test_orphaned_worker_leaves(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(_HARD_EXIT.replace("os.kill(os.getpid(), signal.SIGKILL)",
                                         "time.sleep(60)"))
    rc, log = _run([str(script)], 60, "orphan")
    assert rc == 0, log[-3000:]
    pid = int(log.split("PID", 1)[1].split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not _running(pid):
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)  # our own child's child: do not leave it behind
    pytest.fail(f"worker {pid} still running 10 s after rank 0 left")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited orphan may wait a while to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_abort_nccl_is_a_noop_without_nccl():
    from mla_spec.runtime.nccl_abort import abort_nccl, abort_nccl_bounded, release_aborted_group

    assert abort_nccl() is None and abort_nccl_bounded(1.0) is None  # no process group
    assert release_aborted_group(1.0)
