"""Tensor parallelism on gloo: TP 2 / 4 == TP 1, a dead or failing rank ends the run fast."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from mla_spec.checkpoint_writer import random_state_dict, save_checkpoint, tiny_config
from mla_spec.distributed import default_timeout_s, tp_all_reduce
from mla_spec.forward_batch import ForwardBatch
from mla_spec.loader import load_checkpoint
from mla_spec.model_api import prefill_forward
from mla_spec.runtime.launch import launch
from mla_spec.runtime.workers import RankFailedError, spawn_workers

CFG = tiny_config()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    sd = random_state_dict(CFG, seed=5)
    root = tmp_path_factory.mktemp("tp")
    return {
        "fp32": save_checkpoint(sd, CFG, root / "fp32", quantize=False, dtype=torch.float32),
        "fp4": save_checkpoint(sd, CFG, root / "fp4", quantize=True, dtype=torch.float32,
                               shards=3),
    }


def _rank_logits(rank, world, path, ids):
    """Target logits of a prefill and the MTP draft logits on top of it (one rank)."""
    from mla_spec.attention import create_backend
    from mla_spec.kv_cache import MLATokenToKVPool, ReqToTokenPool, assign_request_slots

    ck = load_checkpoint(path, tp_rank=rank, tp_size=world)
    h = prefill_forward(ck.model, ids, attention_backend="torch")  # [1, T, hidden]
    T = ids.shape[1]
    pool = MLATokenToKVPool(1, 1, T, torch.float32, kv_lora_rank=CFG.kv_lora_rank,
                            qk_rope_head_dim=CFG.qk_rope_head_dim)
    r2t = ReqToTokenPool(1, T)
    assign_request_slots(r2t.req_to_token, 0, [0], T)
    b = ForwardBatch.extend([0], [T - 1], req_pool_indices=[0],
                            out_cache_loc=torch.arange(T - 1))
    b.token_to_kv_pool = pool
    b.attn_backend = create_backend("torch", num_heads=ck.model.num_local_heads,
                                    softmax_scale=CFG.softmax_scale, kv_pool=pool,
                                    req_to_token=r2t)
    with torch.no_grad():
        d = ck.mtp(ids[0, 1:], b.positions, h[0, :-1], b)
    return ck.model.compute_logits(h), ck.mtp.compute_logits(d)


@pytest.mark.parametrize("kind,world", [("fp32", 2), ("fp4", 4)])
def test_tp_matches_tp1(ckpts, kind, world):
    ids = torch.randint(0, CFG.vocab_size, (1, 7))
    ref_t, ref_d = _rank_logits(0, 1, ckpts[kind], ids)
    outs = launch(_rank_logits, world, backend="gloo", args=(ckpts[kind], ids))
    assert len(outs) == world
    for t, d in outs:
        torch.testing.assert_close(t, ref_t, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(d, ref_d, rtol=1e-4, atol=1e-4)
        assert torch.equal(t, outs[0][0]) and torch.equal(d, outs[0][1])  # same bits on ranks


def _all_reduce_or_die(rank, world, die_rank, how):
    x = torch.ones(4)
    tp_all_reduce(x)
    if rank == die_rank:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("boom on purpose")
    for _ in range(20):  # the survivors would block here for the collective timeout
        tp_all_reduce(x)
        time.sleep(0.05)
    return x


def test_launch_results_and_all_reduce():
    outs = launch(_all_reduce_or_die, 2, backend="gloo", args=(-1, ""), timeout_s=60)
    assert [o.tolist() for o in outs][0][0] == 2.0 ** 21


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_dead_rank_fails_fast(how):
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1") as e:
        launch(_all_reduce_or_die, 3, backend="gloo", args=(1, how), timeout_s=60)
    assert time.monotonic() - t0 < 20  # collective timeout is 60 s: the watchdog ended it
    if how == "raise":
        assert "boom on purpose" in str(e.value)


def _worker(rank, world, die):
    x = torch.full((3,), float(rank))
    dist.all_reduce(x)
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_spawn_workers_caller_is_rank0():
    w = spawn_workers(3, _worker, (False,), backend="gloo", timeout_s=30)
    try:
        assert dist.get_rank() == 0 and dist.get_world_size() == 3
        x = torch.zeros(3)
        dist.all_reduce(x)
        assert x.tolist() == [3.0, 3.0, 3.0]
        dist.barrier()
    finally:
        w.shutdown()
    assert not dist.is_initialized() and w.failure is None


@pytest.mark.parametrize("timeout_s", [5, None], ids=["5s", "default"])
def test_spawn_workers_dead_worker_detected(timeout_s):
    """Also under the long gloo default (300 s): the dead peer's closed sockets end the wait."""
    w = spawn_workers(2, _worker, (True,), backend="gloo", timeout_s=timeout_s,
                      interrupt_main=False)
    try:
        dist.all_reduce(torch.zeros(3))
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - gloo's error type varies by version
            dist.barrier()
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 5
        while w.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(RankFailedError, match="rank 1 died"):
            w.check()
    finally:
        w.shutdown()


class _DieOnUnpickle:
    """Kills the worker while its arguments are unpickled: before it joins the rendezvous."""

    def __reduce__(self):
        return os._exit, (3,)


def test_worker_dying_before_rendezvous_fails_fast():
    assert default_timeout_s("gloo") >= 300 and default_timeout_s("nccl") == 30
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank [12] died \(exit code 3\) while starting"):
        spawn_workers(3, _worker, (_DieOnUnpickle(),), backend="gloo")
    assert time.monotonic() - t0 < 20  # not the 300 s rendezvous timeout
    assert not dist.is_initialized()


def test_launch_under_torchrun(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import torch
        from mla_spec.distributed import tp_all_reduce
        from mla_spec.runtime.launch import launch

        def fn(rank, world):
            return float(tp_all_reduce(torch.tensor([rank + 1.0]))[0])

        if __name__ == "__main__":
            out = launch(fn, 2, backend="gloo")
            with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt"), "w") as f:
                f.write(repr(out))
    """))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script), str(tmp_path)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "[3.0, 3.0]"


def _train_forward(rank, world, path, ids):
    ck = load_checkpoint(path, tp_rank=rank, tp_size=world, load_mtp=False)
    with torch.no_grad():
        logits = ck.model.compute_logits(ck.model.forward_train(ids))
    try:
        ck.model.forward_train(ids)
    except NotImplementedError as e:
        return logits, str(e)
    return logits, None


def test_forward_train_under_tp(ckpts):
    """Dense path under TP gives TP-1 logits without grad; with autograd it refuses clearly."""
    ids = torch.randint(0, CFG.vocab_size, (1, 5))
    ref, _ = _train_forward(0, 1, ckpts["fp32"], ids)
    for logits, err in launch(_train_forward, 2, backend="gloo", args=(ckpts["fp32"], ids)):
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
        assert err is not None and "run forward_train at TP 1" in err
