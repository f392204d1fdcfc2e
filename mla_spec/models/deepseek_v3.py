"""DeepSeek-V3 for causal LM: decoder layers, the model, final norm and lm_head.

Module names follow the checkpoint, so ``state_dict()`` keys are checkpoint keys. Pre-norm
layers: ``h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))`` (dense MLP for
the first ``first_k_dense_replace`` layers, MoE after). ``forward(input_ids [N], positions [N],
batch)`` serves packed rows with absorbed MLA and returns the hidden state after the final norm
(what MTP consumes); ``forward_train(input_ids [B, T])`` is the dense, differentiable twin.
"""

import torch
from torch import nn

from mla_spec.models.mla import MLAAttention
from mla_spec.models.moe import DeepseekV3MoE, DenseMLP
from mla_spec.models.norm import RMSNorm
from mla_spec.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

__all__ = ["DeepseekV3DecoderLayer", "DeepseekV3Model", "DeepseekV3ForCausalLM"]


class DeepseekV3DecoderLayer(nn.Module):
    """One pre-norm decoder layer; ``layer_id`` the checkpoint index (dense or MoE, weight
    names), ``kv_layer_id`` the KV pool's (default ``layer_id``; the MTP layer uses 0)."""

    def __init__(self, cfg, layer_id: int, *, quant_cfg=None, tp_size: int = 1,
                 dtype=torch.float32, device=None, kv_layer_id: int | None = None,
                 prefix: str | None = None) -> None:
        super().__init__()
        prefix = prefix or f"model.layers.{layer_id}"
        q = quant_cfg.is_quantized if quant_cfg is not None else None  # None: every linear dense
        kw = dict(quantized=q, tp_size=tp_size, dtype=dtype, device=device)
        self.layer_id = layer_id
        self.self_attn = MLAAttention(cfg, layer_id if kv_layer_id is None else kv_layer_id,
                                      prefix=f"{prefix}.self_attn", **kw)
        if cfg.is_moe_layer(layer_id):
            self.mlp = DeepseekV3MoE(cfg, prefix=f"{prefix}.mlp", **kw)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, prefix=f"{prefix}.mlp",
                                **kw)
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, hidden]`` through the paged-cache attention (the residual add
        is fused with the post-attention norm)."""
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
                                   device=device) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 target model on one TP rank of ``tp_size`` (heads and intermediate dims
    split). ``quant_cfg`` None: every linear dense; ``dtype``: of the dense weights."""

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

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        """``input_ids [N]``, ``positions [N]`` -> hidden after the final norm ``[N, hidden]``
        (serving, under ``no_grad``)."""
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(positions, h, batch)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> fp32 logits ``[..., vocab]`` (same bits on every rank)."""
        return self.lm_head.logits(hidden)

    def forward_train(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """``input_ids [B, T]`` -> hidden after the final norm ``[B, T, hidden]``; dense causal
        attention (positions ``0..T-1`` unless given), differentiable."""
        if input_ids.dim() != 2:
            raise ValueError(f"forward_train takes input_ids [B, T], got {tuple(input_ids.shape)}")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer.forward_train(positions, h)
        return self.model.norm(h)
