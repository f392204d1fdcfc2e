"""DeepSeek-V3's multi-token-prediction (MTP / NextN) layer, used as the EAGLE draft model.

At position ``p`` it combines the target's hidden ``h_p`` with the embedding of ``t_{p+1}`` and
predicts ``t_{p+2}``::

    x  = eh_proj(cat(enorm(embed(t_{p+1})), hnorm(h_p)))      [N, 2*hidden] -> [N, hidden]
    x  = decoder_layer(x)                                     (MLA + MoE, its own KV cache)
    h' = shared_head.norm(x)                                  -> logits = lm_head(h')

``embed_tokens`` / ``lm_head`` are the target's; ``h'`` is fed back by the next draft step.
"""

import torch
from torch import nn

from mla_spec.models.deepseek_v3 import DeepseekV3DecoderLayer
from mla_spec.models.linear import ReplicatedLinear
from mla_spec.models.norm import RMSNorm
from mla_spec.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, lm_head_logits

__all__ = ["DeepseekV3MTP"]


class _SharedHead(nn.Module):
    def __init__(self, cfg, dtype, device) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)


class DeepseekV3MTP(nn.Module):
    """The NextN layer on one TP rank. ``quant_cfg`` is ignored (the layer is BF16, as SGLang
    forces for ModelOpt FP4); ``embed_tokens`` / ``lm_head``: the target's, shared (fresh ones
    without them); ``kv_layer_id``: the layer in the draft KV pool."""

    def __init__(self, cfg, quant_cfg=None, tp_rank: int = 0, tp_size: int = 1,
                 dtype=torch.float32, device=None, *, embed_tokens: nn.Module | None = None,
                 lm_head: nn.Module | None = None, kv_layer_id: int = 0) -> None:
        super().__init__()
        del quant_cfg
        self.cfg, self.tp_rank, self.tp_size, self.dtype = cfg, tp_rank, tp_size, dtype
        self.layer_id = cfg.num_hidden_layers
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.eh_proj = ReplicatedLinear(2 * h, h, dtype=dtype, device=device)
        self.decoder = DeepseekV3DecoderLayer(cfg, self.layer_id, quant_cfg=None, tp_size=tp_size,
                                              dtype=dtype, device=device, kv_layer_id=kv_layer_id)
        self.shared_head = _SharedHead(cfg, dtype, device)
        # Shared modules are held outside the module tree so state_dict() has only MTP weights.
        self._shared = {
            "embed_tokens": embed_tokens or VocabParallelEmbedding(
                cfg.vocab_size, h, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device),
            "lm_head": lm_head or ParallelLMHead(h, cfg.vocab_size, tp_rank=tp_rank,
                                                 tp_size=tp_size, dtype=dtype, device=device),
        }

    @property
    def embed_tokens(self) -> nn.Module:
        return self._shared["embed_tokens"]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared["lm_head"]

    def set_embed_and_head(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Share the target's embedding and head (SGLang's ``set_embed_and_head``)."""
        self._shared = {"embed_tokens": embed_tokens, "lm_head": lm_head}

    def _combine(self, input_ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        e = self.enorm(self.embed_tokens(input_ids))
        return self.eh_proj(torch.cat([e, self.hnorm(target_hidden.to(e.dtype))], dim=-1))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                target_hidden: torch.Tensor, batch) -> torch.Tensor:
        """Draft hidden ``[N, hidden]`` (after ``shared_head.norm``) from row-aligned tokens
        ``t_{p+1}`` ``[N]``, positions ``p`` ``[N]`` and states ``h_p`` ``[N, hidden]``."""
        x = self._combine(input_ids, target_hidden)
        x = self.decoder(positions, x, batch)
        return self.shared_head.norm(x)

    def forward_train(self, input_ids: torch.Tensor, target_hidden: torch.Tensor,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """Dense causal MTP: ``input_ids [B, T]`` (token ``p+1`` at column ``p``),
        ``target_hidden [B, T, hidden]`` (``h_p`` at column ``p``) -> ``[B, T, hidden]``: for
        ``tokens [B, L]`` pass ``tokens[:, 1:]`` and ``hidden[:, :-1]``."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self._combine(input_ids, target_hidden)
        x = self.decoder.forward_train(positions, x)
        return self.shared_head.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> fp32 logits through the shared ``lm_head``."""
        return lm_head_logits(self.lm_head, hidden)
