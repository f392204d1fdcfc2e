"""The whole-step bodies (``runtime/step_graph.py``) on the CPU: the decode step and the v1 / v2
rounds (v1's draft extend laid out on the device at its capacity) run on static batches refreshed
from (request rows, lengths) on the device give the same tokens and accept lengths as the plain
per-batch path. On a GPU the same bodies are captured in CUDA graphs (``tests/test_engine.py``'s
and ``tests/spec/test_eagle.py``'s GPU tests compare graphs against eager)."""

from __future__ import annotations

import pytest

from mla_spec.cli import DEMO_MODEL
from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.engine import Engine
from mla_spec.eval import build_prompts, heldout_problems
from mla_spec.runtime.step_graph import StepGraphs

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "config.json").exists(),
                                reason="the embedded model is not installed")


def _generate(spec: SpecConfig, bodies: bool, monkeypatch) -> tuple[list, list, int]:
    monkeypatch.setenv("MLA_SPEC_TRITON_ON_CPU", "0")  # the ops' torch twins, our attention
    texts = build_prompts(heldout_problems(3), k_shots=0)
    with Engine(DEMO_MODEL, spec=spec, attention_backend="triton", device="cpu",
                cache=CacheConfig(page_size=16, kv_dtype="fp8_e4m3"), max_reqs=8,
                max_context_len=128, cuda_graph=False) as eng:
        prompts = [eng.encode(t)[-20:] for t in texts]  # short: Triton's interpreter attends
        replays = []
        if bodies:  # three requests run in bucket 4: one padded row (scratch row 0, length 0)
            steps = StepGraphs.capture(eng.runner, eng.worker, [1, 4], use_graphs=False)
            kind = "round" if spec.enabled else "decode"
            assert steps is not None and {k for k, _ in steps.graphs} == {kind}
            real = steps.replay
            monkeypatch.setattr(steps, "replay", lambda k, p: replays.append(k) or real(k, p))
            eng.runner.step_graphs = steps
        res = eng.generate(prompts, max_new_tokens=8)
        return [r.output_ids for r in res], [r.accept_lengths for r in res], len(replays)


@pytest.mark.parametrize("version", ["off", "v1", "v2"])
def test_step_bodies_equal_the_plain_path(version, monkeypatch):
    spec = SpecConfig.off() if version == "off" else SpecConfig(version=version)
    plain, plain_acc, _ = _generate(spec, False, monkeypatch)
    steps, steps_acc, used = _generate(spec, True, monkeypatch)
    assert used > 0
    assert steps == plain
    assert steps_acc == plain_acc
    if version != "off":
        assert max(a for acc in steps_acc for a in acc) > 1  # the drafts were checked for real
