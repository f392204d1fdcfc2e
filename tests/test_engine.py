"""Engine and scheduler: batching, KV exhaustion, preemption, stops, metrics (mock model)."""

from __future__ import annotations

import pytest
from mock_runner import WordTokenizer, build_mock_runner, mock_greedy_reference

from mla_spec.config import SpecConfig
from mla_spec.engine import Engine, RequestRejectedError
from mla_spec.kv_cache import KVCacheFullError
from mla_spec.runtime.workers import RankFailedError
from mla_spec.scheduler import Scheduler

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [3], [10, 20, 30, 40, 50, 60], [8, 8]]


_WordTok = WordTokenizer


@pytest.mark.parametrize("spec", [SpecConfig.off(), SpecConfig(version="v2")],
                         ids=["off", "v2"])
def test_small_pool_preempts_without_corrupting(spec):
    """Five requests in a pool that holds about two: all finish, all equal the reference."""
    eng = Engine(runner=build_mock_runner(num_pages=20, page_size=4), spec=spec)
    res = eng.generate(PROMPTS, max_new_tokens=30)
    for p, r in zip(PROMPTS, res):
        assert r.output_ids == mock_greedy_reference(p, 30), r
    assert eng.scheduler.num_preemptions > 0
    assert eng.scheduler.allocator.num_free == 19  # everything freed but the scratch page


def test_request_that_can_never_fit_is_rejected_with_a_clear_message():
    eng = Engine(runner=build_mock_runner(num_pages=8, page_size=4), spec=SpecConfig())
    with pytest.raises(RequestRejectedError, match=r"needs \d+ pages.*raise num_pages"):
        eng.add_request(list(range(1, 20)), max_new_tokens=40)
    with pytest.raises(RequestRejectedError, match="max_context_len"):
        eng.add_request([1, 2], max_new_tokens=500)
    # generate() serves the others and reports the rejected one
    res = eng.generate([[1, 2, 3], list(range(1, 30))], max_new_tokens=5)
    assert res[0].output_ids == mock_greedy_reference([1, 2, 3], 5)
    assert res[1].finished_reason == "abort" and "pages" in res[1].error


def test_scheduler_reserves_scratch_and_raises_when_alone_too_big():
    s = Scheduler(num_pages=4, page_size=4, max_reqs=4, max_context_len=64, step_rows=4)
    assert s.allocator.num_free == 3
    with pytest.raises(RequestRejectedError):
        s.add([1] * 10, max_new_tokens=10)  # 24 tokens = 6 pages > 3
    s.add([1] * 3, max_new_tokens=4)  # 11 tokens = 3 pages: fits alone
    plan = s.schedule()
    assert plan.kind == "prefill" and plan.req_pool_indices != [0]
    assert all(0 not in pages for _, _, pages in plan.slot_updates)


def test_stop_strings_eos_and_text():
    ref = mock_greedy_reference([5, 6, 7], 12)
    stop_word = f"w{ref[4]}"
    eng = Engine(runner=build_mock_runner(), spec=SpecConfig(version="v2"), tokenizer=_WordTok())
    (r,) = eng.generate(["w5 w6 w7"], max_new_tokens=12, stop=[stop_word])
    assert r.finished_reason == "stop"
    assert r.text == " ".join(f"w{t}" for t in ref[: ref.index(ref[4])]) + (
        " " if ref.index(ref[4]) else "")
    eos = ref[3]
    eng = Engine(runner=build_mock_runner(), spec=SpecConfig.off(), stop_token_ids=[eos])
    (r,) = eng.generate([[5, 6, 7]], max_new_tokens=12)
    assert r.finished_reason == "eos" and r.output_ids == ref[: ref.index(eos) + 1]


def test_text_prompts_are_encoded_in_one_batch_call():
    class BatchTok(WordTokenizer):
        calls = []

        def encode_batch(self, texts):
            self.calls.append(list(texts))
            return [self.encode(t) for t in texts]

    tok = BatchTok()
    eng = Engine(runner=build_mock_runner(), spec=SpecConfig.off(), tokenizer=tok)
    res = eng.generate(["w5 w6 w7", [7, 8], "w9 w3"], max_new_tokens=3)
    assert [r.prompt_ids for r in res] == [[5, 6, 7], [7, 8], [9, 3]]
    assert tok.calls == [["w5 w6 w7", "w9 w3"]]
    assert res[0].output_ids == mock_greedy_reference([5, 6, 7], 3)


def test_metrics_per_mode_and_per_request():
    eng = Engine(runner=build_mock_runner(), spec=SpecConfig(version="v2"))
    res = eng.generate(PROMPTS, max_new_tokens=10)
    table = {(r["model"], r["mode"]): r for r in eng.metrics.mode_table()}
    assert {("target", "EXTEND"), ("draft", "EXTEND"), ("draft", "DECODE"),
            ("target", "TARGET_VERIFY"), ("draft", "DRAFT_EXTEND_V2")} == set(table)
    assert sum(r["share"] for r in table.values()) == pytest.approx(1.0)
    summary = eng.metrics.summary()
    assert summary["generated_tokens"] == sum(len(r.output_ids) for r in res) == 50
    assert summary["tokens_per_s"] > 0
    for r in res:
        m = r.metrics
        assert m.completion_tokens == 10 and m.ttft is not None and m.ttft >= 0
        assert m.acc_length == pytest.approx(10 / len(r.accept_lengths))
    hist = eng.metrics.accept_histogram(4)
    assert sum(hist) == len(eng.metrics.accept_lengths)


def test_continuous_batching_admits_while_decoding():
    eng = Engine(runner=build_mock_runner(), spec=SpecConfig.off())
    a = eng.add_request([1, 2, 3], max_new_tokens=8)
    eng.step()
    eng.step()
    b = eng.add_request([4, 5], max_new_tokens=3)
    kinds = []
    while eng.scheduler.has_work:
        kinds.append(eng.step().kind)
    assert kinds[0] == "prefill" and "decode" in kinds
    assert a.output_ids == mock_greedy_reference([1, 2, 3], 8)
    assert b.output_ids == mock_greedy_reference([4, 5], 3)


def test_idle_engine_that_cannot_admit_raises():
    s = Scheduler(num_pages=3, page_size=4, max_reqs=2, max_context_len=64)
    s.add([1] * 4, max_new_tokens=2)
    s.allocator.alloc(2)  # someone else holds the pages
    with pytest.raises(KVCacheFullError, match="cannot be admitted"):
        s.schedule()


# ---- the real model (a random tiny DeepSeek-V3 checkpoint) --------------------------------------
REAL_PROMPTS = [[0, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 3]]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    import torch

    from mla_spec.checkpoint_writer import random_state_dict, save_checkpoint, tiny_config

    cfg = tiny_config()
    path = tmp_path_factory.mktemp("tiny_dsv3")
    save_checkpoint(random_state_dict(cfg, seed=0), cfg, path, quantize=True,
                    dtype=torch.float32)
    return path


def _real_engine(path, spec, tp_size=1, kv_dtype="auto"):
    from mla_spec.config import CacheConfig

    return Engine(path, tp_size=tp_size, spec=spec, attention_backend="torch",
                  cache=CacheConfig(page_size=16, kv_dtype=kv_dtype), num_pages=24, max_reqs=8,
                  max_context_len=128)


def test_real_model_spec_equals_plain_greedy(tiny_ckpt):
    outs = {}
    for name, spec in [("off", SpecConfig.off()), ("v1", SpecConfig(version="v1")),
                       ("v2", SpecConfig(version="v2"))]:
        eng = _real_engine(tiny_ckpt, spec)
        outs[name] = [r.output_ids for r in eng.generate(REAL_PROMPTS, max_new_tokens=12)]
    assert outs["off"] == outs["v1"] == outs["v2"]
    assert all(len(o) == 12 for o in outs["off"])


def test_real_model_tp2_equals_tp1(tiny_ckpt):
    spec = SpecConfig(version="v2")
    ref = [r.output_ids for r in _real_engine(tiny_ckpt, spec, kv_dtype="fp8_e4m3")
           .generate(REAL_PROMPTS, max_new_tokens=8)]
    with _real_engine(tiny_ckpt, spec, tp_size=2, kv_dtype="fp8_e4m3") as eng:
        got = [r.output_ids for r in eng.generate(REAL_PROMPTS, max_new_tokens=8)]
    assert got == ref


def test_dead_rank_is_an_error_within_seconds(tiny_ckpt):
    import time

    from mla_spec.runtime.workers import RankFailedError

    eng = _real_engine(tiny_ckpt, SpecConfig.off(), tp_size=2)
    try:
        eng.generate([[0, 1, 2]], max_new_tokens=2)
        eng.workers.processes[0].kill()
        t0 = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1"):
            eng.generate([[0, 4, 5]], max_new_tokens=4)
        assert time.monotonic() - t0 < 10
    finally:
        eng.shutdown()


def test_tp_shutdown_is_clean(tiny_ckpt):
    """Workers joined, queues closed: no 'leaked semaphore' warning at exit; a shut-down engine
    refuses further steps; shutdown twice is harmless."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        from mla_spec.config import CacheConfig, SpecConfig
        from mla_spec.engine import Engine
        from mla_spec.runtime.workers import RankFailedError

        if __name__ == "__main__":
            eng = Engine({str(tiny_ckpt)!r}, tp_size=2, spec=SpecConfig.off(),
                         attention_backend="torch", cache=CacheConfig(page_size=16),
                         num_pages=8, max_reqs=4, max_context_len=64)
            with eng:
                (r,) = eng.generate([[0, 1, 2]], max_new_tokens=2)
            eng.shutdown()
            try:
                eng.generate([[0, 1]], max_new_tokens=1)
            except RankFailedError as e:
                print("refused:", e)
            print("tokens", len(r.output_ids))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tokens 2" in r.stdout and "refused: this tensor-parallel engine is shut down" in \
        r.stdout, r.stdout
    assert "leaked" not in r.stderr, r.stderr[-2000:]


@pytest.mark.gpu
def test_real_model_on_gpu_graphs_or_a_reason(tiny_ckpt):
    """Triton backend, bf16: tokens equal with and without CUDA graphs; if the model cannot be
    captured (a host sync in its forward), the graph runner says so and the engine runs eagerly."""
    from mla_spec.config import CacheConfig

    outs = {}
    for graph in (False, True):
        eng = Engine(tiny_ckpt, spec=SpecConfig(version="v2"), attention_backend="triton",
                     cache=CacheConfig(page_size=16, kv_dtype="fp8_e4m3"), device="cuda",
                     num_pages=24, max_reqs=8, max_context_len=128, cuda_graph=graph,
                     graph_batch_sizes=(1, 2, 4))
        outs[graph] = [r.output_ids for r in eng.generate(REAL_PROMPTS, max_new_tokens=12)]
        if graph:
            g = eng.runner.graphs
            assert g.graphs or "synchronizes" in (g.disabled_reason or ""), g.disabled_reason
            print("graphs:", g.disabled_reason or f"{len(g.graphs)} captured")
    assert outs[True] == outs[False]


# ---- the embedded model: spec reports the tokens plain decoding reports -------------------------
def test_spec_counts_stop_where_plain_decoding_stops():
    """A verify step accepts tokens past the stop string; they are dropped, so output ids, token
    counts and text equal spec off (the embedded model really writes the stop string)."""
    from mla_spec.cli import DEMO_MODEL
    from mla_spec.config import CacheConfig
    from mla_spec.eval import STOP, build_prompts, heldout_problems

    if not (DEMO_MODEL / "config.json").exists():
        pytest.skip("the embedded model is not installed")
    prompts = build_prompts(heldout_problems(4), 2)
    runs = {}
    for name, spec in [("off", SpecConfig.off()), ("v1", SpecConfig(version="v1")),
                       ("v2", SpecConfig(version="v2"))]:
        eng = Engine(DEMO_MODEL, spec=spec, attention_backend="torch", device="cpu",
                     cache=CacheConfig(page_size=64), max_reqs=8, max_context_len=512)
        res = eng.generate(prompts, max_new_tokens=64, stop=list(STOP))
        runs[name] = ([r.output_ids for r in res], [r.text for r in res],
                      [r.finished_reason for r in res],
                      [r.metrics.completion_tokens for r in res], eng.metrics.generated_tokens)
    ids, _, reasons, counts, total = runs["off"]
    assert reasons.count("stop") >= 2, reasons  # the stop string ends most requests
    assert counts == [len(i) for i in ids] and total == sum(counts)
    assert runs["v1"] == runs["off"]
    assert runs["v2"] == runs["off"]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_spec_stops_at_eos_and_length_like_plain(version):
    """eos or max_new_tokens inside an accepted chain: nothing after it is kept or counted."""
    ref = mock_greedy_reference([5, 6, 7], 12)
    for kw, n in [(dict(stop_token_ids=[ref[5]]), ref.index(ref[5]) + 1), ({}, 6)]:
        counts = []
        for spec in (SpecConfig.off(), SpecConfig(version=version)):
            eng = Engine(runner=build_mock_runner(), spec=spec, **kw)
            (r,) = eng.generate([[5, 6, 7]], max_new_tokens=6 if not kw else 12)
            assert r.output_ids == ref[:n]
            counts.append(eng.metrics.generated_tokens)
        assert counts == [n, n]


def test_failed_tp_start_leaves_no_worker_running(tiny_ckpt):
    """A setting refused after the workers started (num_pages=1: the scheduler needs a scratch
    page) raises at once and stops the workers; they must not wait on their queue for the GC."""
    import multiprocessing as mp

    before = {p.pid for p in mp.active_children()}
    try:
        Engine(tiny_ckpt, tp_size=2, spec=SpecConfig.off(), attention_backend="torch",
               num_pages=1, max_reqs=4, max_context_len=64)
    except ValueError as e:  # checked while the traceback (and the half-built engine) lives
        assert "num_pages" in str(e)
        assert [p for p in mp.active_children() if p.pid not in before] == []
    else:
        pytest.fail("num_pages=1 was accepted")


def test_empty_stop_string_and_negative_max_new_tokens_are_refused():
    eng = Engine(runner=build_mock_runner(), spec=SpecConfig.off())
    with pytest.raises(ValueError, match="empty stop string matches at once"):
        eng.add_request([1, 2, 3], max_new_tokens=4, stop=["w1", ""])
    with pytest.raises(ValueError, match="max_new_tokens -1: must be >= 1"):
        eng.add_request([1, 2, 3], max_new_tokens=-1)
    assert not eng.scheduler.has_work


def test_any_error_in_a_tp_step_stops_the_workers(tiny_ckpt, monkeypatch):
    """An exception on rank 0 mid-step (not only a dead rank) shuts the TP engine down: the other
    ranks ran the same plan and would otherwise wait in a collective until the timeout."""
    import multiprocessing as mp

    before = {p.pid for p in mp.active_children()}
    eng = Engine(tiny_ckpt, tp_size=2, spec=SpecConfig.off(), attention_backend="torch",
                 max_reqs=4, max_context_len=64)

    def boom(plan):
        raise ValueError("planted failure on rank 0")

    monkeypatch.setattr(eng.worker, "execute", boom)
    eng.add_request([1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match="planted failure"):
        eng.step()
    assert eng.workers is None
    assert [p for p in mp.active_children() if p.pid not in before] == []
    with pytest.raises(RankFailedError, match="shut down"):
        eng.step()


def test_capture_pauses_python_gc():
    """The graph capture runs with Python's GC paused and restores its state (a finalizer of an
    engine dropped earlier must not free CUDA objects inside a capture)."""
    import gc

    from mla_spec.runtime.step_graph import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # was off: stays off
    finally:
        gc.enable()


@pytest.mark.gpu
def test_engines_built_in_sequence_all_capture(tiny_ckpt):
    """Engines built one after another in one process (as bench_e2e does: batch 1, then 32)
    each capture their graphs; a failed capture must not leave torch's RNG in capture state,
    which would break the next engine's weight init."""
    from mla_spec.config import CacheConfig

    for spec, bss in ((SpecConfig(version="v1"), (1, 2)), (SpecConfig(version="v1"), (4, 8)),
                      (SpecConfig(version="v2"), (8,))):
        eng = Engine(tiny_ckpt, spec=spec, attention_backend="triton",
                     cache=CacheConfig(page_size=16, kv_dtype="fp8_e4m3"), device="cuda",
                     num_pages=64, max_reqs=16, max_context_len=128, cuda_graph=True,
                     graph_batch_sizes=bss)
        g = eng.runner.graphs
        assert g.disabled_reason is None and g.graphs, g.disabled_reason
        assert eng.generate(REAL_PROMPTS[:1], max_new_tokens=4)[0].output_ids
        del eng
