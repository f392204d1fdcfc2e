"""DeepSeek-V3 for causal LM: decoder layers, the model, final norm and lm_head.

Module names follow the checkpoint (``model.embed_tokens``, ``model.layers.{i}.self_attn.*``,
``model.layers.{i}.mlp.*``, ``model.norm``, ``lm_head``) so ``state_dict()`` keys are checkpoint
keys (for TP ranks, each tensor is that rank's shard; see ``mla_spec.loader``).

A decoder layer is pre-norm:  ``h = h + attn(input_layernorm(h))``;
``h = h + mlp(post_attention_layernorm(h))``, where ``mlp`` is the dense SwiGLU MLP for the first
``first_k_dense_replace`` layers and the MoE after.

Two entry points share every weight:

- ``forward(input_ids [N], positions [N], batch)``: serving. Rows of all requests are packed;
  attention is the absorbed MLA over the paged KV cache through ``batch.attn_backend``.
  Returns the hidden state **after** the final norm ``[N, hidden]`` (SGLang's convention: what
  the MTP layer consumes); ``compute_logits(hidden)`` -> fp32 ``[N, vocab]``, identical on all
  ranks (embedding and lm_head are vocab-parallel: ``mla_spec.models.vocab_parallel``).
- ``forward_train(input_ids [B, T])``: dense causal attention, differentiable, same math.
"""

from __future__ import annotations

import torch
from torch import nn

from mla_spec.models.mla import MLAAttention
from mla_spec.models.moe import DeepseekV3MoE, DenseMLP
from mla_spec.models.norm import RMSNorm
from mla_spec.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

__all__ = ["DeepseekV3DecoderLayer", "DeepseekV3Model", "DeepseekV3ForCausalLM"]


def _quantized_fn(quant_cfg):
    if quant_cfg is None:
        return lambda name: False
    return quant_cfg.is_quantized


class DeepseekV3DecoderLayer(nn.Module):
    """One pre-norm decoder layer.

    ``layer_id`` is the checkpoint index (decides dense vs MoE, and the weight names);
    ``kv_layer_id`` the index into the KV pool (defaults to ``layer_id``; the MTP layer uses 0).
    """

    def __init__(self, cfg, layer_id: int, *, quant_cfg=None, tp_size: int = 1,
                 dtype=torch.float32, device=None, kv_layer_id: int | None = None,
                 prefix: str | None = None) -> None:
        super().__init__()
        prefix = prefix or f"model.layers.{layer_id}"
        q = _quantized_fn(quant_cfg)
        kw = dict(quantized=q, tp_size=tp_size, dtype=dtype, device=device)
        self.layer_id = layer_id
        self.self_attn = MLAAttention(
            cfg, layer_id if kv_layer_id is None else kv_layer_id,
            prefix=f"{prefix}.self_attn", **kw,
        )
        if cfg.is_moe_layer(layer_id):
            self.mlp = DeepseekV3MoE(cfg, prefix=f"{prefix}.mlp", **kw)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, prefix=f"{prefix}.mlp",
                                **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                                       device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                                                device=device)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, hidden]`` through the paged-cache attention.

        The residual add after attention is fused with the post-attention norm (one kernel on
        CUDA, the same bits as ``h + a`` then the norm).
        """
        a = self.self_attn(positions, self.input_layernorm(h), batch)
        x, h = self.post_attention_layernorm.forward_add(a, h)
        return h + self.mlp(x)

    def forward_train(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``[B, T, hidden]`` -> ``[B, T, hidden]`` with dense causal attention."""
        h = h + self.self_attn.forward_train(positions, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3Model(nn.Module):
    """``embed_tokens``, ``num_hidden_layers`` decoder layers, final ``norm``."""

    def __init__(self, cfg, *, quant_cfg=None, tp_rank: int = 0, tp_size: int = 1,
                 dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                   tp_rank=tp_rank, tp_size=tp_size,
                                                   dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(cfg, i, quant_cfg=quant_cfg, tp_size=tp_size, dtype=dtype,
                                   device=device)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 target model on one TP rank.

    Parameters
    ----------
    cfg : ModelConfig
    quant_cfg : QuantConfig | None (None: every linear BF16 / ``dtype``)
    tp_rank, tp_size : this rank and the TP world size (heads and intermediate dims are split)
    dtype : compute / storage dtype of non-quantized weights (bf16 on GPU, fp32 on CPU runs)
    device : where the weights live
    """

    def __init__(self, cfg, quant_cfg=None, tp_rank: int = 0, tp_size: int = 1,
                 dtype=torch.float32, device=None) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} must be in [0, tp_size {tp_size})")
        self.cfg, self.quant_cfg = cfg, quant_cfg
        self.tp_rank, self.tp_size, self.dtype = tp_rank, tp_size, dtype
        self.model = DeepseekV3Model(cfg, quant_cfg=quant_cfg, tp_rank=tp_rank,
                                     tp_size=tp_size, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp_rank=tp_rank,
                                      tp_size=tp_size, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kv_scales: dict[int, tuple[float, float]] = {}  # set by the loader (fp8 KV)

    # ---- convenience views ---------------------------------------------------------------
    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def num_local_heads(self) -> int:
        return self.cfg.num_attention_heads // self.tp_size

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # ---- serving -------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        """``input_ids [N]``, ``positions [N]`` -> hidden after the final norm ``[N, hidden]``.

        Serving only (runs under ``no_grad``; use :meth:`forward_train` for gradients).
        """
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(positions, h, batch)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> fp32 logits ``[..., vocab]`` (same bits on every rank).

        The matmul runs in the weight dtype (fp32 accumulate on GPU), then casts to fp32; under
        TP each rank computes its vocabulary slice and an all-gather joins them.
        """
        return self.lm_head.logits(hidden)

    # ---- training ------------------------------------------------------------------------
    def forward_train(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """``input_ids [B, T]`` -> hidden after the final norm ``[B, T, hidden]``.

        Dense causal attention over the T tokens (positions ``0..T-1`` unless given),
        differentiable. ``compute_logits`` turns it into logits.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"forward_train takes input_ids [B, T], got {tuple(input_ids.shape)}")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer.forward_train(positions, h)
        return self.model.norm(h)
