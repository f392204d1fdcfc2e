"""MTP (NextN) layer: shared embed/head, paged path == dense path, loader name mapping."""

from __future__ import annotations

import torch

from mla_spec.attention import create_backend
from mla_spec.forward_batch import ForwardBatch
from mla_spec.kv_cache import MLATokenToKVPool, ReqToTokenPool, assign_request_slots
from mla_spec.loader import load_checkpoint


def test_mtp_paged_equals_dense_and_shares_modules(fp32_ckpt, tiny_cfg, tiny_sd):
    ck = load_checkpoint(fp32_ckpt)
    model, mtp = ck.model, ck.mtp
    assert mtp.embed_tokens is model.embed_tokens and mtp.lm_head is model.lm_head
    n = tiny_cfg.num_hidden_layers
    torch.testing.assert_close(mtp.eh_proj.weight, tiny_sd[f"model.layers.{n}.eh_proj.weight"])
    torch.testing.assert_close(mtp.decoder.self_attn.kv_b_proj.weight,
                               tiny_sd[f"model.layers.{n}.self_attn.kv_b_proj.weight"])
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in mtp.state_dict())
    tokens = torch.randint(0, tiny_cfg.vocab_size, (1, 8))
    with torch.no_grad():
        h = model.forward_train(tokens)  # [1, 8, hidden] after the final norm
        dense = mtp.forward_train(tokens[:, 1:], h[:, :-1])  # [1, 7, hidden]
    # the same through the draft's one-layer paged pool
    pool = MLATokenToKVPool(1, 2, 4, torch.float32, kv_lora_rank=tiny_cfg.kv_lora_rank,
                            qk_rope_head_dim=tiny_cfg.qk_rope_head_dim)
    r2t = ReqToTokenPool(1, 8)
    assign_request_slots(r2t.req_to_token, 0, [1, 0], 4)
    batch = ForwardBatch.extend([0], [7], req_pool_indices=[0],
                                out_cache_loc=r2t.req_to_token[0, :7].long())
    batch.token_to_kv_pool = pool
    batch.attn_backend = create_backend("torch", num_heads=model.num_local_heads,
                                        softmax_scale=tiny_cfg.softmax_scale, kv_pool=pool,
                                        req_to_token=r2t)
    with torch.no_grad():
        paged = mtp(tokens[0, 1:], batch.positions, h[0, :-1], batch)
    torch.testing.assert_close(paged, dense[0], rtol=1e-4, atol=1e-4)
    logits = mtp.compute_logits(paged)
    assert logits.shape == (7, tiny_cfg.vocab_size) and logits.dtype == torch.float32
    # the combination order is cat(enorm(embed), hnorm(hidden))
    e = mtp.enorm(model.embed_tokens(tokens[0, 1:2]))
    hh = mtp.hnorm(h[0, :1])
    torch.testing.assert_close(mtp._combine(tokens[0, 1:2], h[0, :1]),
                               torch.cat([e, hh], -1) @ mtp.eh_proj.weight.T)
