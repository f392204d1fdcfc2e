"""DeepSeek-V3 model: parity with transformers, absorbed == training path, incremental steps."""

from __future__ import annotations

import pytest
import torch
from hf_reference import build_hf_model

from mla_spec.forward_batch import ForwardBatch
from mla_spec.loader import load_checkpoint
from mla_spec.model_api import load_model, prefill_forward
from mla_spec.models import DeepseekV3ForCausalLM


@pytest.fixture(scope="module")
def loaded(fp32_ckpt):
    return load_model(fp32_ckpt, device="cpu", attention_backend="torch")


def test_logits_match_transformers(tiny_cfg, tiny_sd, loaded):
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 11))
    hf = build_hf_model(tiny_cfg, tiny_sd)
    with torch.no_grad():
        ref = hf(ids).logits.float()
        train = loaded.model.compute_logits(loaded.model.forward_train(ids))
    absorbed = loaded.logits(ids)  # EXTEND through the paged cache + torch backend
    assert absorbed.shape == (2, 11, tiny_cfg.vocab_size) and absorbed.dtype == torch.float32
    torch.testing.assert_close(train, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(absorbed, ref, rtol=1e-4, atol=1e-4)
    assert ref.std() > 0.5  # O(1) logits: the comparison is not vacuous


def _pool(cfg, dtype, pages=8, page_size=4):
    from mla_spec.kv_cache import MLATokenToKVPool, ReqToTokenPool, assign_request_slots

    pool = MLATokenToKVPool(cfg.num_hidden_layers, pages, page_size, dtype,
                            kv_lora_rank=cfg.kv_lora_rank,
                            qk_rope_head_dim=cfg.qk_rope_head_dim)
    r2t = ReqToTokenPool(2, pages * page_size // 2)
    half = pages // 2
    # request 0 gets the odd pages reversed, request 1 the even ones: non-contiguous slots
    assign_request_slots(r2t.req_to_token, 0, list(range(pages - 1, 0, -2)), page_size)
    assign_request_slots(r2t.req_to_token, 1, list(range(0, pages, 2))[:half], page_size)
    return pool, r2t


def _step(model, pool, r2t, batch, ids):
    from mla_spec.attention import create_backend

    rows = [(b, batch.extend_prefix_lens_cpu[b] + i)
            for b in range(batch.batch_size) for i in range(batch.seq_lens_q_cpu[b])]
    batch.out_cache_loc = torch.tensor([int(r2t.req_to_token[b, p]) for b, p in rows])
    batch.req_pool_indices = torch.arange(batch.batch_size)
    be = create_backend("torch", num_heads=model.num_local_heads,
                        softmax_scale=model.cfg.softmax_scale, kv_pool=pool, req_to_token=r2t)
    batch.token_to_kv_pool, batch.attn_backend = pool, be
    be.plan(batch)
    with torch.no_grad():
        return model.compute_logits(model(ids, batch.positions, batch))


def test_incremental_steps_match_full_prefill(loaded, tiny_cfg):
    """Prefill ragged prefixes, then a verify-style extend and a decode: same logits."""
    m = loaded.model
    seqs = torch.randint(0, tiny_cfg.vocab_size, (2, 9))
    full = m.compute_logits(m.forward_train(seqs))
    pool, r2t = _pool(tiny_cfg, torch.float32)
    # step 1: request 0 prefills 5 tokens, request 1 prefills 1 token
    b1 = ForwardBatch.extend([0, 0], [5, 1])
    out1 = _step(m, pool, r2t, b1, torch.cat([seqs[0, :5], seqs[1, :1]]))
    torch.testing.assert_close(out1[:5], full[0, :5], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out1[5:], full[1, :1], rtol=1e-4, atol=1e-4)
    # step 2: extend 3 rows on request 0 (prefix 5) and 7 rows on request 1 (prefix 1)
    b2 = ForwardBatch.extend([5, 1], [3, 7])
    out2 = _step(m, pool, r2t, b2, torch.cat([seqs[0, 5:8], seqs[1, 1:8]]))
    torch.testing.assert_close(out2[:3], full[0, 5:8], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out2[3:], full[1, 1:8], rtol=1e-4, atol=1e-4)
    # step 3: decode one token each
    b3 = ForwardBatch.decode([9, 9])
    out3 = _step(m, pool, r2t, b3, seqs[:, 8])
    torch.testing.assert_close(out3, full[:, 8], rtol=1e-4, atol=1e-4)


def test_idle_batch(loaded):
    pool, r2t = _pool(loaded.cfg, torch.float32)
    out = _step(loaded.model, pool, r2t, ForwardBatch.idle(), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0, loaded.cfg.vocab_size)


def test_bf16_absorbed_close_to_training(fp32_ckpt, tiny_cfg):
    ck = load_checkpoint(fp32_ckpt, dtype=torch.bfloat16, load_mtp=False)
    assert ck.model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, tiny_cfg.vocab_size, (1, 8))
    h = prefill_forward(ck.model, ids, attention_backend="torch")
    with torch.no_grad():
        ref = ck.model.forward_train(ids)
    assert h.dtype == torch.bfloat16
    torch.testing.assert_close(h.float(), ref.float(), rtol=0.05, atol=0.05)


def test_forward_train_is_differentiable(tiny_cfg, tiny_sd):
    m = DeepseekV3ForCausalLM(tiny_cfg)
    m.load_state_dict({k: v for k, v in tiny_sd.items()
                       if not k.startswith(f"model.layers.{tiny_cfg.num_hidden_layers}.")})
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 6))
    logits = m.compute_logits(m.forward_train(ids))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    layer = m.model.layers[tiny_cfg.first_k_dense_replace]
    assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0
    assert layer.self_attn.kv_b_proj.weight.grad.abs().sum() > 0
    assert m.model.embed_tokens.weight.grad.abs().sum() > 0
    assert layer.mlp.gate.e_score_correction_bias.requires_grad is False


def test_variant_without_q_lora_with_bias_matches_transformers(tmp_path):
    """q_proj instead of q_a/q_b (q_lora_rank None), attention biases, default RoPE."""
    from mla_spec.checkpoint_writer import random_state_dict, save_checkpoint, tiny_config

    cfg = tiny_config(q_lora_rank=None, attention_bias=True, rope_scaling=None,
                      num_hidden_layers=2, n_shared_experts=2, norm_topk_prob=False)
    sd = random_state_dict(cfg, seed=7)
    assert "model.layers.0.self_attn.q_proj.weight" in sd
    assert "model.layers.0.self_attn.o_proj.bias" in sd
    path = save_checkpoint(sd, cfg, tmp_path / "v", quantize=False, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    with torch.no_grad():
        ref = build_hf_model(cfg, sd)(ids).logits.float()
    out = load_model(path, attention_backend="torch").logits(ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
