"""Checkpoint loader: NVFP4 / BF16 layouts, TP shards, quant configs, and every error case."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_spec.checkpoint_writer import random_state_dict, save_checkpoint, tiny_config
from mla_spec.loader import CheckpointError, load_checkpoint
from mla_spec.model_api import load_model, prefill_forward
from mla_spec.models.linear import dequantize_weight
from mla_spec.models.quant_config import QuantConfig

CFG = tiny_config()


@pytest.fixture(scope="module")
def sd():
    return random_state_dict(CFG, seed=3)


@pytest.fixture(scope="module")
def fp4(sd, tmp_path_factory):
    return save_checkpoint(sd, CFG, tmp_path_factory.mktemp("l") / "fp4", quantize=True,
                           shards=2, kv_scales={0: (0.5, 0.25), 2: (2.0, 2.0)})


@pytest.fixture
def broken(fp4, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(fp4, dst)
    return dst


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


def _edit(path, fn):
    """Apply ``fn(tensors: dict)`` to the shard holding the first layer-0 tensor; keep index."""
    idx = _index(path)
    fname = idx["weight_map"]["model.layers.0.mlp.down_proj.weight"]
    t = load_file(str(path / fname))
    fn(t)
    save_file(t, str(path / fname))
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != fname}
    idx["weight_map"].update({k: fname for k in t})
    (path / "model.safetensors.index.json").write_text(json.dumps(idx))
    return fname


def test_layout_written_like_modelopt(fp4):
    q = json.loads((fp4 / "hf_quant_config.json").read_text())
    assert q["producer"]["name"] == "modelopt"
    assert q["quantization"]["quant_algo"] == "NVFP4" and q["quantization"]["group_size"] == 16
    assert q["quantization"]["kv_cache_quant_algo"] == "FP8"
    t = {}
    for f in sorted(fp4.glob("*.safetensors")):
        t.update(load_file(str(f)))
    e = "model.layers.1.mlp.experts.3.down_proj"
    assert t[e + ".weight"].dtype == torch.uint8
    assert t[e + ".weight"].shape == (CFG.hidden_size, CFG.moe_intermediate_size // 2)
    assert t[e + ".weight_scale"].dtype == torch.float8_e4m3fn
    assert t[e + ".weight_scale_2"].dtype == torch.float32 and t[e + ".input_scale"].numel() == 1
    assert t["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    n = CFG.num_hidden_layers
    assert t[f"model.layers.{n}.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    assert f"model.layers.{n}.shared_head.head.weight" in t


def test_nvfp4_logits_match_dequantized_model(fp4, sd, tmp_path):
    """The FP4 checkpoint's logits == a BF16-free fp32 model built from its dequantized weights."""
    t = {}
    for f in sorted(fp4.glob("*.safetensors")):
        t.update(load_file(str(f)))
    deq = {}
    for k, v in t.items():
        if k.endswith(".weight") and v.dtype == torch.uint8:
            p = k[: -len(".weight")]
            deq[k] = dequantize_weight(v, t[p + ".weight_scale"], t[p + ".weight_scale_2"],
                                       torch.float32)
        elif not k.endswith((".weight_scale", ".weight_scale_2", ".input_scale", "k_scale",
                             "v_scale")):
            deq[k] = v.float()
    ref_path = save_checkpoint(deq, CFG, tmp_path / "deq", quantize=False, dtype=torch.float32)
    ids = torch.randint(0, CFG.vocab_size, (2, 6))
    a = load_model(fp4, device="cpu", attention_backend="torch").logits(ids)
    b = load_model(ref_path, device="cpu", attention_backend="torch").logits(ids)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # and the quantization really changed something vs the original weights
    c = load_model(save_checkpoint(sd, CFG, tmp_path / "orig", quantize=False,
                                   dtype=torch.float32), attention_backend="torch").logits(ids)
    assert (a - c).abs().max() > 1e-3


def test_tp_shards_of_nvfp4_and_heads(fp4):
    full = load_checkpoint(fp4, load_mtp=False).model
    r1 = load_checkpoint(fp4, tp_rank=1, tp_size=2).model
    inter, h = CFG.moe_intermediate_size, CFG.hidden_size
    fd, rd = full.layers[1].mlp.experts[5].down_proj, r1.layers[1].mlp.experts[5].down_proj
    assert rd.weight.shape == (h, inter // 4) and rd.weight_scale.shape == (h, inter // 32)
    assert torch.equal(rd.weight, fd.weight[:, inter // 4:])
    assert torch.equal(rd.weight_scale.view(torch.uint8),
                       fd.weight_scale.view(torch.uint8)[:, inter // 32:])
    fu, ru = full.layers[0].mlp.up_proj, r1.layers[0].mlp.up_proj
    assert torch.equal(ru.weight, fu.weight[CFG.intermediate_size // 2:])
    hk = CFG.qk_nope_head_dim + CFG.v_head_dim
    fk, rk = full.layers[0].self_attn.kv_b_proj, r1.layers[0].self_attn.kv_b_proj
    assert torch.equal(rk.weight, fk.weight[2 * hk:])  # heads 2, 3
    fo, ro = full.layers[0].self_attn.o_proj, r1.layers[0].self_attn.o_proj
    assert torch.equal(ro.weight, fo.weight[:, 2 * CFG.v_head_dim:])
    assert torch.equal(r1.layers[0].self_attn.q_a_proj.weight,
                       full.layers[0].self_attn.q_a_proj.weight)  # replicated
    with pytest.raises(ValueError, match="not divisible by tp_size 3"):
        load_checkpoint(fp4, tp_rank=0, tp_size=3)


def test_kv_scales_and_fp8_cache(fp4):
    lm = load_model(fp4, attention_backend="torch", kv_dtype="fp8_e4m3")
    assert lm.kv_scales == {0: (0.5, 0.25), 2: (2.0, 2.0)}
    assert lm.kv_dtype == torch.float8_e4m3fn
    lm.kv_scales = {0: (0.5, 0.5), 2: (2.0, 2.0)}  # K and V share a row: equal scales round-trip
    ids = torch.randint(0, CFG.vocab_size, (1, 5))
    ref = load_model(fp4, attention_backend="torch").logits(ids)
    out = lm.logits(ids)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_exclude_globs_and_flat_quantization_config(broken):
    q = QuantConfig(exclude_modules=("lm_head", "model.layers.*.self_attn*", "model.layers.1*"))
    assert q.is_excluded("lm_head") and not q.is_excluded("lm_head2")
    assert q.is_excluded("model.layers.0.self_attn.kv_b_proj")
    assert not q.is_excluded("model.layers.0.mlp.gate_proj")
    assert q.is_excluded("model.layers.1.mlp.experts.0.up_proj")
    assert q.is_excluded("model.layers.12.mlp.up_proj")  # fullmatch of "1*" (SGLang semantics)
    # newer format: quantization_config in config.json, ``ignore`` + kv_cache_scheme
    hq = json.loads((broken / "hf_quant_config.json").read_text())["quantization"]
    (broken / "hf_quant_config.json").unlink()
    cfg = json.loads((broken / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
        "ignore": hq["exclude_modules"], "kv_cache_scheme": {"type": "float", "num_bits": 8},
    }
    (broken / "config.json").write_text(json.dumps(cfg))
    ck = load_checkpoint(broken)
    assert ck.quant_cfg.kv_cache_fp8 and ck.quant_cfg.exclude_modules == tuple(
        hq["exclude_modules"])
    assert ck.model.layers[0].mlp.gate_proj.quantized
    assert not ck.model.layers[0].self_attn.q_b_proj.quantized


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "dtype_fp4_as_bf16",
                                  "dtype_bf16_as_fp4", "truncated", "corrupt", "index_file",
                                  "index_tensor", "no_config", "bad_json"])
def test_errors_name_tensor_and_file(broken, case):
    name, want = "model.layers.0.mlp.down_proj.weight", None
    if case == "missing":
        _edit(broken, lambda t: t.pop(name))
        want = name
    elif case == "unexpected":
        fname = _edit(broken, lambda t: t.update({"model.layers.0.mlp.extra.weight":
                                                  torch.zeros(2)}))
        want = f"model.layers.0.mlp.extra.weight.*{fname}"
    elif case == "shape":
        fname = _edit(broken, lambda t: t.update({name: torch.zeros(3, 5, dtype=torch.uint8)}))
        want = rf"{name}.*{fname}.*shape \[3, 5\], expected \[64, 64\]"
    elif case == "dtype_fp4_as_bf16":
        _edit(broken, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
        want = f"{name}.*dtype BF16.*stored unquantized"
    elif case == "dtype_bf16_as_fp4":
        n2 = "model.layers.0.self_attn.q_b_proj.weight"
        _edit(broken, lambda t: t.update({n2: torch.zeros(96, 16, dtype=torch.uint8)}))
        want = f"{n2}.*dtype U8.*stored as NVFP4"
    elif case in ("truncated", "corrupt"):
        f = broken / _index(broken)["weight_map"][name]
        data = f.read_bytes()
        f.write_bytes(data[: len(data) - 100] if case == "truncated" else b"\xff" * 64 + data[64:])
        want = f.name
    elif case == "index_file":
        idx = _index(broken)
        idx["weight_map"][name] = "model-00009-of-00009.safetensors"
        (broken / "model.safetensors.index.json").write_text(json.dumps(idx))
        want = f"{name}.*model-00009-of-00009.safetensors.*does not exist"
    elif case == "index_tensor":
        idx = _index(broken)
        other = next(v for v in idx["weight_map"].values() if v != idx["weight_map"][name])
        idx["weight_map"][name] = other
        (broken / "model.safetensors.index.json").write_text(json.dumps(idx))
        want = f"{name}.*{other}.*lacks it"
    elif case == "no_config":
        (broken / "config.json").unlink()
        want = "no config.json"
    elif case == "bad_json":
        (broken / "hf_quant_config.json").write_text("{not json")
        want = "hf_quant_config.json: not valid JSON"
    with pytest.raises((CheckpointError, ValueError), match=want):
        load_checkpoint(broken)


def test_single_file_bf16_checkpoint(sd, tmp_path):
    p = save_checkpoint(sd, CFG, tmp_path / "bf16", quantize=False, shards=1)
    assert (p / "model.safetensors").exists() and not (p / "hf_quant_config.json").exists()
    ck = load_checkpoint(p)
    assert ck.quant_cfg is None and not ck.model.layers[0].mlp.gate_proj.quantized
    ids = torch.randint(0, CFG.vocab_size, (1, 4))
    h = prefill_forward(ck.model, ids, attention_backend="torch")
    assert torch.isfinite(h).all()


# ---- values: NaN / inf, scales, configs --------------------------------------------------------
def _poke(path, name, fn):
    """Replace the stored tensor ``name`` by ``fn(it)`` in its shard; return the shard's name."""
    fname = _index(path)["weight_map"][name]
    t = load_file(str(path / fname))
    t[name] = fn(t[name].clone())
    save_file(t, str(path / fname))
    return fname


def _at_random(t, value, seed):
    """``t`` with ``value`` at one random position (float tensors: through fp32)."""
    g = torch.Generator().manual_seed(seed)
    flat = t.float().reshape(-1)
    flat[int(torch.randint(0, flat.numel(), (1,), generator=g))] = value
    return flat.reshape(t.shape).to(t.dtype)


@pytest.mark.parametrize("name,value", [
    ("model.layers.0.self_attn.q_b_proj.weight", float("nan")),    # BF16 linear
    ("model.layers.1.mlp.gate.weight", float("inf")),              # router
    ("model.layers.2.post_attention_layernorm.weight", float("-inf")),
    ("model.norm.weight", float("nan")),
    ("model.layers.1.mlp.experts.3.down_proj.weight_scale", float("nan")),  # e4m3 block scales
])
def test_non_finite_weight_is_refused_naming_tensor_and_file(broken, name, value):
    fname = _poke(broken, name, lambda t: _at_random(t, value, seed=len(name)))
    with pytest.raises(CheckpointError, match=rf"{name}.*{fname}.*NaN or inf.*check_finite=False"):
        load_checkpoint(broken)
    with pytest.raises(CheckpointError, match=name):
        load_model(broken, device="cpu")
    lm = load_model(broken, device="cpu", check_finite=False)  # the opt-out loads it as stored
    assert lm.cfg.num_hidden_layers == CFG.num_hidden_layers


@pytest.mark.parametrize("leaf,value", [("weight_scale_2", 0.0), ("weight_scale_2", float("nan")),
                                        ("weight_scale_2", -0.5), ("input_scale", float("inf"))])
def test_bad_global_scale_is_refused_even_without_the_scan(broken, leaf, value):
    name = f"model.layers.2.mlp.experts.5.gate_proj.{leaf}"
    fname = _poke(broken, name, lambda t: torch.full_like(t, value))
    for cf in (True, False):
        with pytest.raises(CheckpointError, match=rf"{name}.*{fname}.*{leaf}.*positive and finite"):
            load_checkpoint(broken, check_finite=cf)


def test_negative_block_scale_refused(broken):
    name = "model.layers.0.mlp.up_proj.weight_scale"
    _poke(broken, name, lambda t: _at_random(t, -2.0, seed=5))
    with pytest.raises(CheckpointError, match=rf"{name}.*>= 0"):
        load_checkpoint(broken)


@pytest.mark.parametrize("value", [float("nan"), 0.0, -1.0])
def test_bad_kv_scale_refused(broken, value):
    name = next(k for k in _index(broken)["weight_map"] if k.endswith("k_scale"))
    fname = _poke(broken, name, lambda t: torch.full_like(t, value))
    with pytest.raises(CheckpointError, match=rf"{name}.*{fname}.*KV scale.*positive and finite"):
        load_checkpoint(broken)


def test_finite_check_keeps_valid_weights_bit_identical(fp4):
    a = load_checkpoint(fp4, load_mtp=False).model.state_dict()
    b = load_checkpoint(fp4, load_mtp=False, check_finite=False).model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k])


@pytest.mark.parametrize("key", ["num_experts_per_tok", "n_group", "kv_lora_rank"])
def test_config_without_architecture_key_is_refused(broken, key):
    cfg = json.loads((broken / "config.json").read_text())
    cfg.pop(key)
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"{broken / 'config.json'}: .*'{key}'"):
        load_checkpoint(broken)


@pytest.mark.parametrize("field,value,want", [
    ("kv_cache_quant_algo", "INT8", "kv_cache_quant_algo 'INT8': supported 'FP8'"),
    ("quant_algo", "FP8", "quant_algo 'FP8': supported 'NVFP4'"),
])
def test_unsupported_quant_config_is_refused(broken, field, value, want):
    hq = json.loads((broken / "hf_quant_config.json").read_text())
    hq["quantization"][field] = value
    (broken / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(CheckpointError, match=f"hf_quant_config.json: {want}"):
        load_checkpoint(broken)


def test_embedded_model_loads_with_the_scan():
    from mla_spec import EMBEDDED_MODEL

    lm = load_model(EMBEDDED_MODEL, device="cpu", attention_backend="torch")
    assert lm.quant_cfg.kv_cache_fp8 and lm.cfg.num_experts_per_tok == 2
