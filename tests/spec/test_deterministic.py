"""``Engine(deterministic=True)``: batch-invariant forwards, so speculation gives plain greedy's
tokens exactly. On the CPU here (torch attention); the same check on a GPU (triton attention,
CUDA graphs) is ``test_spec_equals_off_on_gpu``."""

from __future__ import annotations

import pytest
import torch

from mla_spec.cli import DEMO_MODEL
from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.engine import Engine
from mla_spec.eval import build_prompts, heldout_problems
from mla_spec.models.batch_invariant import batch_invariant, per_row

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "config.json").exists(),
                                reason="the embedded model is not installed")


def test_per_row_splits_only_inside_the_block():
    calls = []

    def fn(x):
        calls.append(x.shape[0])
        return x * 2

    x = torch.randn(5, 3)
    torch.testing.assert_close(per_row(fn, x), x * 2)
    assert calls == [5]
    with batch_invariant():
        torch.testing.assert_close(per_row(fn, x), x * 2)
        with batch_invariant(False):
            per_row(fn, x)
    assert calls == [5, 1, 1, 1, 1, 1, 5]


def test_a_rows_hidden_does_not_depend_on_its_batch(monkeypatch):
    """Under ``batch_invariant()`` a prompt's hidden rows are the same bits alone and beside
    another prompt (the row-mixing ops then see different row counts)."""
    from mla_spec.model_api import load_model

    monkeypatch.setenv("MLA_SPEC_TRITON_ON_CPU", "0")
    model = load_model(DEMO_MODEL, device="cpu")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 150, (3, 11), generator=g)
    with batch_invariant():
        alone = model.hidden(ids[:1])
        together = model.hidden(ids)
    assert torch.equal(alone[0], together[0])


def _tokens(spec: SpecConfig, backend: str, device: str, bs: int, new: int) -> list:
    prompts = build_prompts(heldout_problems(bs), k_shots=1)
    with Engine(DEMO_MODEL, spec=spec, attention_backend=backend, device=device,
                cache=CacheConfig(page_size=64 if device == "cuda" else 16,
                                  kv_dtype="fp8_e4m3"),
                max_reqs=bs + 1, max_context_len=512, deterministic=True) as eng:
        out = [r.output_ids for r in eng.generate(prompts, max_new_tokens=new)]
        return out, eng.avg_accept_length


def test_spec_equals_off_token_for_token(monkeypatch):
    monkeypatch.setenv("MLA_SPEC_TRITON_ON_CPU", "0")
    off, _ = _tokens(SpecConfig.off(), "torch", "cpu", 3, 12)
    v2, accept = _tokens(SpecConfig(version="v2"), "torch", "cpu", 3, 12)
    assert v2 == off
    assert accept > 1.5


def test_refuses_a_backend_without_the_option():
    from mla_spec.attention.torch_ref import TorchMLABackend

    class Plain(TorchMLABackend):  # a backend whose constructor takes no options
        def __init__(self, num_heads, softmax_scale, kv_pool, req_to_token, device=None):
            super().__init__(num_heads, softmax_scale, kv_pool, req_to_token, device)

    with pytest.raises(ValueError, match="deterministic option"):
        Engine(DEMO_MODEL, spec=SpecConfig.off(), attention_backend=Plain, device="cpu",
               deterministic=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_spec_equals_off_on_gpu():
    off, _ = _tokens(SpecConfig.off(), "triton", "cuda", 32, 48)
    for version in ("v2", "v1"):
        spec, accept = _tokens(SpecConfig(version=version), "triton", "cuda", 32, 48)
        diff = [i for i, (a, b) in enumerate(zip(off, spec)) if a != b]
        assert not diff, f"spec {version}: sequences {diff} differ from spec off"
        assert accept > 1.5
