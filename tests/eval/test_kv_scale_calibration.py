"""Calibrated FP8 KV scales: computed from the cached latent, written, loaded, served.

``calibrate_kv_scales`` gives each attention layer ``amax / 448`` of what the KV cache stores
(``[kv_a_layernorm(ckv) | rope(k_pe)]``); ``save_checkpoint`` writes them as
``model.layers.{i}.self_attn.k_scale`` / ``v_scale``; the loader and ``ModelRunner`` put them on
the FP8 pools (the MTP layer's on the draft pool), and a reader that drops one of them moves the
served numbers (with unit scales it would not: the reason the embedded model carries real ones).
"""

from __future__ import annotations

import pytest
import torch

from mla_spec.checkpoint_writer import calibrate_kv_scales, save_checkpoint, tiny_config
from mla_spec.config import CacheConfig
from mla_spec.model_api import load_model, prefill_forward
from mla_spec.models.deepseek_v3 import DeepseekV3ForCausalLM
from mla_spec.models.mtp import DeepseekV3MTP

CFG = tiny_config()
N = CFG.num_hidden_layers


def _models(seed: int = 0):
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(CFG, dtype=torch.float32)
    mtp = DeepseekV3MTP(CFG, dtype=torch.float32, embed_tokens=model.embed_tokens,
                        lm_head=model.lm_head)
    with torch.no_grad():
        for mod in (model, mtp):
            for name, p in mod.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 3.0)  # uneven norm weights: amax far from 1
                else:
                    p.normal_(0.0, 0.02)
    return model.eval(), mtp.eval()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model, mtp = _models()
    ids = torch.randint(0, CFG.vocab_size, (3, 37), generator=torch.Generator().manual_seed(1))
    scales = calibrate_kv_scales(model, mtp, ids)
    path = save_checkpoint(model, CFG, tmp_path_factory.mktemp("kv") / "ck", quantize=True,
                           mtp=mtp, dtype=torch.float32, kv_scales=scales)
    return model, mtp, ids, scales, path


def test_scales_are_amax_of_the_cached_latent_over_448(calibrated):
    model, mtp, ids, scales, _ = calibrated
    assert sorted(scales) == list(range(N + 1))  # target layers and the MTP layer
    for k, v in scales.values():
        assert k == v and 0 < k and k != 1.0
    with torch.no_grad():  # layer 0 by hand: the first layer's input is the embedding
        attn = model.layers[0].self_attn
        x = model.layers[0].input_layernorm(model.embed_tokens(ids))
        ckv, k_pe = attn._latent(x)
        pos = torch.arange(ids.shape[1])
        _, kpe = attn.rotary_emb(pos, k_pe[:, :, None, :].clone(), k_pe)
        amax = max(ckv.abs().max().item(), kpe.abs().max().item())
    assert scales[0][0] == pytest.approx(amax / 448.0, rel=1e-6)
    # the hooks are gone: a second run gives the same and leaves no extra hooks behind
    assert calibrate_kv_scales(model, mtp, ids) == scales
    assert not model.layers[0].self_attn.kv_a_layernorm._forward_hooks


def test_bad_calibration_input_is_refused():
    model, mtp = _models()
    with pytest.raises(ValueError, match=r"input_ids \[B, T\]"):
        calibrate_kv_scales(model, mtp, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"input_ids \[B, T\]"):
        calibrate_kv_scales(model, mtp, torch.zeros((2, 0), dtype=torch.int64))


def test_one_token_calibration_skips_the_mtp_layer_cleanly():
    model, mtp = _models()
    with pytest.raises(ValueError, match="layer 3: KV amax"):  # MTP not run on 1 token
        calibrate_kv_scales(model, mtp, torch.tensor([[5]]))
    assert sorted(calibrate_kv_scales(model, None, torch.tensor([[5]]))) == list(range(N))


def test_written_scales_reach_the_fp8_pools(calibrated):
    from mla_spec.model_runner import ModelRunner

    *_, scales, path = calibrated
    lm = load_model(path, attention_backend="torch", kv_dtype="fp8_e4m3", device="cpu")
    assert sorted(lm.kv_scales) == sorted(scales)
    for layer, (k, v) in scales.items():  # stored as fp32 scalars
        assert lm.kv_scales[layer] == pytest.approx((k, v), rel=1e-6)
    kw = dict(attention_backend="torch", device="cpu", num_pages=4, max_reqs=2,
              max_context_len=64)
    runner = ModelRunner.from_checkpoint(path, cache=CacheConfig(kv_dtype="fp8_e4m3"), **kw)
    target, draft = runner.pools["target"], runner.pools["draft"]
    assert target.k_scales == pytest.approx([scales[i][0] for i in range(N)])
    assert target.v_scales == pytest.approx([scales[i][1] for i in range(N)])
    assert draft.k_scales == pytest.approx([scales[N][0]])
    plain = ModelRunner.from_checkpoint(path, cache=CacheConfig(kv_dtype="float32"), **kw)
    assert plain.pools["target"].read_scales(0) == (1.0, 1.0)  # not FP8: stored as is


def test_served_numbers_follow_the_scales(calibrated):
    *_, scales, path = calibrated
    lm = load_model(path, attention_backend="torch", kv_dtype="fp8_e4m3", device="cpu")
    ids = torch.randint(0, CFG.vocab_size, (2, 21), generator=torch.Generator().manual_seed(4))
    ks = [scales[i][0] for i in range(N)]
    ref = prefill_forward(lm.model, ids, kv_dtype=torch.float32, attention_backend="torch")
    fp8 = lm.hidden(ids)  # the calibrated scales, as served
    rel = lambda a: ((a - ref).norm() / ref.norm()).item()  # noqa: E731
    assert rel(fp8) < 0.1
    # a reader that drops v_scale: harmless with unit scales, visible with calibrated ones
    no_v = prefill_forward(lm.model, ids, kv_dtype=torch.float8_e4m3fn,
                           attention_backend="torch", k_scale=ks, v_scale=1.0)
    assert rel(no_v) > 5 * rel(fp8) and rel(no_v) > 0.1
    unit = prefill_forward(lm.model, ids, kv_dtype=torch.float8_e4m3fn, attention_backend="torch")
    unit_no_v = prefill_forward(lm.model, ids, kv_dtype=torch.float8_e4m3fn,
                                attention_backend="torch", k_scale=1.0, v_scale=1.0)
    assert torch.equal(unit, unit_no_v)
