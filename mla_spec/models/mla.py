"""Multi-head latent attention (MLA) of DeepSeek-V3: the absorbed inference path and training.

Projections (checkpoint names; H heads split over TP ranks)::

    q_a_proj [q_lora_rank, hidden] -> q_a_layernorm -> q_b_proj [H*192, q_lora_rank]: per head
        [q_nope 128 | q_pe 64]   (q_proj [H*192, hidden] when q_lora_rank is None)
    kv_a_proj_with_mqa [512+64, hidden] -> [latent 512 | k_pe 64]; ckv = kv_a_layernorm(latent)
    kv_b_proj [H*(128+128), 512]: per head [W_UK 128 rows | W_UV 128 rows]
    o_proj [hidden, H*128] (row-parallel: all-reduce)

Inference (absorbed; decode, verify, draft extend): the KV cache holds only ``[ckv | kpe]`` (576
per token, shared by all heads), and ``W_UK`` / ``W_UV`` move to the query / output side::

    q_nope_abs[n,h,:] = q_nope[n,h,:] @ W_UK[h]            [N, H, 512]
    score = softmax_scale * (q_nope_abs . ckv + q_pe . kpe)
    out_latent = softmax(score) @ ckv                      [N, H, 512]  (attention backend)
    out[n,h,:] = out_latent[n,h,:] @ W_UV[h]^T             [N, H, 128]  -> o_proj

This equals attention with ``k_nope = ckv @ W_UK^T`` and ``v = ckv @ W_UV^T``, which
:meth:`MLAAttention.forward_train` computes (dense causal SDPA, differentiable).
"""

import torch
import torch.nn.functional as F
from torch import nn

from mla_spec.kernels.ops import bgemv, bgemv_supported, gemv_linear
from mla_spec.models.batch_invariant import per_row
from mla_spec.models.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from mla_spec.models.norm import RMSNorm
from mla_spec.models.rope import DeepseekRotaryEmbedding

__all__ = ["MLAAttention"]


class MLAAttention(nn.Module):
    """One layer's MLA with ``H / tp_size`` local heads; ``layer_id`` indexes the KV pool (the
    MTP layer uses its own pool's 0); ``quantized``: ``prefix -> bool`` for the linears."""

    def __init__(self, cfg, layer_id: int, *, prefix: str = "", quantized=None,
                 tp_size: int = 1, dtype=torch.float32, device=None) -> None:
        super().__init__()
        H = cfg.num_attention_heads
        if H % tp_size:
            raise ValueError(f"num_attention_heads {H} is not divisible by tp_size {tp_size}")
        self.layer_id = layer_id
        self.num_heads = H // tp_size
        self.qk_nope_head_dim, self.qk_rope_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.q_lora_rank = cfg.q_lora_rank
        self.softmax_scale = cfg.softmax_scale
        qk = cfg.qk_head_dim
        q = quantized or (lambda name: False)
        bias = cfg.attention_bias
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, device=device)

        def lin(cls, name, i, o, **extra):
            return cls(i, o, quantized=q(f"{prefix}.{name}"), tp_size=tp_size, dtype=dtype,
                       device=device, **extra)

        if cfg.q_lora_rank is not None:
            self.q_a_proj = lin(ReplicatedLinear, "q_a_proj", cfg.hidden_size, cfg.q_lora_rank,
                                bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, **norm)
            self.q_b_proj = lin(ColumnParallelLinear, "q_b_proj", cfg.q_lora_rank, H * qk)
        else:
            self.q_proj = lin(ColumnParallelLinear, "q_proj", cfg.hidden_size, H * qk)
        self.kv_a_proj_with_mqa = lin(ReplicatedLinear, "kv_a_proj_with_mqa", cfg.hidden_size,
                                      cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, **norm)
        self.kv_b_proj = lin(ColumnParallelLinear, "kv_b_proj", cfg.kv_lora_rank,
                             H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = lin(RowParallelLinear, "o_proj", H * cfg.v_head_dim, cfg.hidden_size,
                          bias=bias)
        self.rotary_emb = DeepseekRotaryEmbedding(cfg, device=device)
        self._joint_qkv_a_storage()

    def _joint_qkv_a_storage(self) -> None:
        """Make the dense ``q_a_proj`` and ``kv_a_proj_with_mqa`` weights two views of one
        ``[q_lora_rank + 576, hidden]`` buffer, so inference runs one GEMM for both (they read
        the same input). Loaders copy in place and keep the views; ``.to()`` separates them."""
        if self.q_lora_rank is None:
            return
        qa, kva = self.q_a_proj, self.kv_a_proj_with_mqa
        if qa.quantized or kva.quantized or qa.bias is not None or kva.bias is not None:
            return
        joint = torch.empty(qa.out_features + kva.out_features, qa.in_features,
                            dtype=qa.weight.dtype, device=qa.weight.device)
        qa.weight = nn.Parameter(joint[: qa.out_features])
        kva.weight = nn.Parameter(joint[qa.out_features:])

    def _qkv_a_weight(self) -> torch.Tensor | None:
        """``[q_lora_rank + 576, hidden]`` view over both weights, or None (then two GEMMs run)."""
        if self.q_lora_rank is None:
            return None
        qa, kva = self.q_a_proj, self.kv_a_proj_with_mqa
        if qa.quantized or kva.quantized or qa.bias is not None or kva.bias is not None:
            return None
        wq, wk = qa.weight, kva.weight
        if torch.is_grad_enabled() and (wq.requires_grad or wk.requires_grad):
            return None
        if wq.dtype != wk.dtype or wq.device != wk.device or wq.dtype != qa.compute_dtype \
                or not (wq.is_contiguous() and wk.is_contiguous()) \
                or wq.shape[1] != wk.shape[1] \
                or wq.untyped_storage().data_ptr() != wk.untyped_storage().data_ptr() \
                or wk.storage_offset() != wq.storage_offset() + wq.numel():
            return None
        return wq.detach().as_strided((wq.shape[0] + wk.shape[0], wq.shape[1]), (wq.shape[1], 1))

    def _q(self, x: torch.Tensor, q_a: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """``x [..., hidden]`` -> ``q_nope [..., H, 128]``, ``q_pe [..., H, 64]`` (not roped).
        ``q_a``: ``q_a_proj(x)`` when already computed (the joint GEMM)."""
        if self.q_lora_rank is not None:
            q_a = self.q_a_proj(x) if q_a is None else q_a
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q = self.q_proj(x)
        q = q.unflatten(-1, (self.num_heads, -1))
        return q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    def _latent(self, x: torch.Tensor, latent: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., hidden]`` -> ``ckv [..., 512]`` (normed), ``k_pe [..., 64]`` (not roped).
        ``latent``: ``kv_a_proj_with_mqa(x)`` when already computed (the joint GEMM)."""
        latent = self.kv_a_proj_with_mqa(x) if latent is None else latent
        ckv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(ckv), k_pe

    def absorbed_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """``W_UK [H, 128, 512]`` and ``W_UV [H, 128, 512]`` (views of ``kv_b_proj``'s weight)."""
        w = self.kv_b_proj.dense_weight(dtype).view(self.num_heads, -1, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch) -> torch.Tensor:
        """Absorbed MLA over the paged cache: ``positions [N]``, ``x [N, hidden]`` -> ``[N,
        hidden]`` (all-reduced). Writes this step's ``[ckv | kpe]`` rows at
        ``batch.out_cache_loc``, then calls ``batch.attn_backend.forward(q_nope_abs [N, H, 512],
        q_pe [N, H, 64], layer_id, batch)``."""
        w_qkv_a = self._qkv_a_weight()
        if w_qkv_a is not None:  # one GEMM for q_a_proj and kv_a_proj_with_mqa
            q_a, latent = gemv_linear(x, w_qkv_a).split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
            q_nope, q_pe = self._q(x, q_a)
            ckv, k_pe = self._latent(x, latent)
        else:
            q_nope, q_pe = self._q(x)
            ckv, k_pe = self._latent(x)
        q_pe, kpe = self.rotary_emb(positions, q_pe, k_pe)
        w_uk, w_uv = self.absorbed_weights(x.dtype)
        q_nope_abs = _absorb_uk(q_nope, w_uk)  # [N, H, 512]
        batch.token_to_kv_pool.store(self.layer_id, batch.out_cache_loc, ckv, kpe)
        out = batch.attn_backend.forward(q_nope_abs, q_pe, self.layer_id, batch)  # [N, H, 512]
        out = _absorb_uv(out.to(x.dtype), w_uv)  # [N, H, 128]
        return self.o_proj(out.flatten(1))

    def forward_train(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Non-absorbed, dense causal, differentiable: ``x [B, T, hidden]`` -> same shape."""
        B, T, _ = x.shape
        q_nope, q_pe = self._q(x)  # [B, T, H, *]
        ckv, k_pe = self._latent(x)  # [B, T, 512], [B, T, 64]
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        kv = self.kv_b_proj(ckv).unflatten(-1, (self.num_heads, -1))
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(-1, -1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             scale=self.softmax_scale)  # [B, H, T, 128]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def _per_head(x: torch.Tensor, w: torch.Tensor, equation: str, w_einsum: torch.Tensor
              ) -> torch.Tensor:
    """``x [N, H, K]`` times ``w [H, N_out, K]`` per head -> contiguous ``[N, H, N_out]``: the
    BF16 GEMV where it runs, else ``einsum(equation, x, w_einsum)``; a row at a time inside
    ``batch_invariant()``."""
    def rows(xr: torch.Tensor) -> torch.Tensor:
        xt = xr.transpose(0, 1)  # [H, N, K]
        if bgemv_supported(xt, w) is not None:
            return torch.einsum(equation, xr, w_einsum)
        out = torch.empty(xr.shape[0], w.shape[0], w.shape[1], dtype=xr.dtype, device=xr.device)
        # no PDL kernel writes kv_b_proj's weight: the GEMV may load it before the previous
        # grid ends
        bgemv(xt, w, out.transpose(0, 1), static_w=True)
        return out
    return per_row(rows, x)


def _absorb_uk(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_nope [N, H, 128] @ W_UK [H, 128, 512]`` per head -> ``[N, H, 512]``."""
    return _per_head(q_nope, w_uk.transpose(1, 2), "nhd,hdc->nhc", w_uk)


def _absorb_uv(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``o_latent [N, H, 512]`` times ``W_UV [H, 128, 512]^T`` per head -> contiguous ``[N, H,
    128]`` (``o_proj`` reads it flattened)."""
    return _per_head(o_latent, w_uv, "nhc,hvc->nhv", w_uv)
