"""A backend defined outside the package: registered, checked for conformance, served by the
engine by name, by class and by ``module:Class``, at TP 1 and on gloo ranks (a class defined in a
function travels to them by value), and reached from the command line."""

from __future__ import annotations

import pickle

import pytest
from windowed_backend import WindowedBackend

from mla_spec import (
    EMBEDDED_MODEL,
    CacheConfig,
    Engine,
    SpecConfig,
    check_backend,
    register_backend,
)
from mla_spec.attention import BACKENDS, create_backend, get_backend_class
from mla_spec.attention.base import MLABackend
from mla_spec.attention.synthetic import make_scene
from mla_spec.attention.torch_ref import TorchMLABackend
from mla_spec.cli import build_parser
from mla_spec.eval import build_prompts, heldout_problems
from mla_spec.forward_mode import ForwardMode
from mla_spec.quant.fp8 import FP8_DTYPE

SMALL = dict(kv_lora_rank=32, qk_rope_head_dim=16)
PROMPTS = build_prompts(heldout_problems(2), k_shots=1)


@pytest.fixture(autouse=True)
def _restore_registry():
    saved = dict(BACKENDS)
    yield
    BACKENDS.clear()
    BACKENDS.update(saved)


def test_register_backend_by_name_decorator_and_path():
    assert BACKENDS["windowed"] is WindowedBackend and WindowedBackend.name == "windowed"
    assert get_backend_class("windowed_backend:WindowedBackend") is WindowedBackend

    @register_backend("oracle-copy")
    class Copy(TorchMLABackend):
        pass

    assert Copy.name == "oracle-copy" and get_backend_class("oracle-copy") is Copy
    sc = make_scene(ForwardMode.DECODE, [5, 9], [1, 1], **SMALL)
    be = create_backend("oracle-copy", num_heads=2, softmax_scale=0.3, kv_pool=sc.pool,
                        req_to_token=sc.req_pool)
    assert type(be) is Copy
    with pytest.raises(ValueError, match="other than 'auto' and the built-ins"):
        register_backend("triton", Copy)
    with pytest.raises(TypeError, match="needs an MLABackend subclass"):
        register_backend("dict", dict)

    class NoForward(MLABackend):
        pass

    with pytest.raises(TypeError, match="does not implement forward"):
        register_backend("abstract", NoForward)
    with pytest.raises(ValueError, match="an MLABackend subclass, or 'module.path:ClassName'"):
        get_backend_class("sdpa")
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        get_backend_class("no_such_module:X")


def test_classes_defined_in_functions_pickle_by_value():
    Local = type("Local", (WindowedBackend,), {"window": 5})
    assert pickle.loads(pickle.dumps(Local)).window == 5  # by value: not importable
    assert pickle.loads(pickle.dumps(WindowedBackend)) is WindowedBackend  # by reference


def test_conformance_of_the_windowed_backend(monkeypatch):
    monkeypatch.setenv("MLA_SPEC_TRITON_ON_CPU", "0")  # scenes: torch stores, not the interpreter
    # a window longer than every context is exact attention: everything passes
    wide = check_backend(WindowedBackend, "cpu", backend_kwargs={"window": 1000}, **SMALL)
    assert wide.ok and wide.count("pass") == 14, str(wide)
    # a short window fails where contexts are longer than it, and the report says by how much
    narrow = check_backend("windowed", "cpu", kv_dtypes=(FP8_DTYPE,), **SMALL)  # window 8
    assert not narrow.ok
    failed = {(r.case, r.kv_dtype) for r in narrow.failures}
    assert ("TARGET_VERIFY", "fp8_e4m3") in failed and ("IDLE", "fp8_e4m3") not in failed
    assert all("> tol" in r.detail and r.error > 0.02 for r in narrow.failures)
    assert "FAIL" in str(narrow) and "windowed" in str(narrow)


def _generate(backend, tp=1, tokens=8):
    eng = Engine(EMBEDDED_MODEL, tp_size=tp, spec=SpecConfig(version="v2"),
                 cache=CacheConfig(page_size=16, kv_dtype="fp8_e4m3"), attention_backend=backend,
                 device="cpu", max_reqs=2, max_context_len=256)
    try:
        assert eng.runner.backends["target"].name == get_backend_class(backend).name
        return [r.output_ids for r in eng.generate(PROMPTS, max_new_tokens=tokens)]
    finally:
        eng.shutdown()


def test_engine_serves_a_registered_backend():
    exact = _generate("torch")
    wide = type("Wide", (WindowedBackend,), {"window": 10_000})
    assert _generate(wide) == exact  # a window past every context changes nothing
    assert _generate("windowed") != exact  # 8 positions: the answers change


@pytest.fixture(scope="module")
def narrow():
    """A class made in a function (not importable by the ranks) and its TP 1 tokens."""
    cls = type("Narrow", (WindowedBackend,), {"window": 16})
    return cls, _generate(cls, tokens=6)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_ranks_get_a_class_defined_in_a_function(tp, narrow):
    cls, tp1_tokens = narrow
    assert _generate(cls, tp=tp, tokens=6) == tp1_tokens


def test_command_line_imports_and_registers_module_paths(capsys):
    args = build_parser().parse_args(["demo", "--attention-backend",
                                      "windowed_backend:WindowedBackend"])
    assert get_backend_class(args.attention_backend) is WindowedBackend
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--attention-backend", "windowed_backend:Nope"])
    assert "windowed_backend has no Nope" in capsys.readouterr().err
