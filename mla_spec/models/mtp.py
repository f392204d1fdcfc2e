"""DeepSeek-V3's multi-token-prediction (MTP / NextN) layer, used as the EAGLE draft model.

At position ``p`` the MTP layer combines the target model's hidden state ``h_p`` (after the
target's final norm) with the embedding of the *next* token ``t_{p+1}`` and predicts ``t_{p+2}``::

    x  = eh_proj(cat(enorm(embed(t_{p+1})), hnorm(h_p)))      [N, 2*hidden] -> [N, hidden]
    x  = decoder_layer(x)                                     (MLA + MoE, its own KV cache)
    h' = shared_head.norm(x)                                  -> logits = lm_head(h')

(the order inside ``cat`` is embedding first, then hidden, as SGLang does). ``embed_tokens`` and
``lm_head`` are the target's (shared, not copied); the checkpoint's ``shared_head.head`` and the
layer's own ``embed_tokens`` copy are not loaded. In the checkpoint the layer is
``model.layers.{num_hidden_layers}.*`` (61 for DeepSeek-V3), BF16 in NVIDIA's FP4 checkpoints.
The draft's KV pool has one layer, so the decoder layer writes/reads pool layer 0.

The returned ``h'`` is both what ``compute_logits`` consumes and the hidden state the next draft
step feeds back as ``target_hidden``.
"""

from __future__ import annotations

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
    """The NextN layer on one TP rank.

    Parameters
    ----------
    cfg : ModelConfig
    quant_cfg : ignored for the layer's linears (the MTP layer is BF16, as SGLang forces for
        ModelOpt FP4); kept for signature symmetry with the target
    embed_tokens, lm_head : the target's modules (shared). Without them the MTP owns fresh ones.
    kv_layer_id : the layer index in the draft KV pool (0)
    """

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
        self.decoder = DeepseekV3DecoderLayer(
            cfg, self.layer_id, quant_cfg=None, tp_size=tp_size, dtype=dtype, device=device,
            kv_layer_id=kv_layer_id,
        )
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
        """Draft hidden ``[N, hidden]`` (after ``shared_head.norm``).

        ``input_ids [N]`` are the tokens ``t_{p+1}``, ``positions [N]`` the positions ``p`` and
        ``target_hidden [N, hidden]`` the states ``h_p`` (row-aligned).
        """
        x = self._combine(input_ids, target_hidden)
        x = self.decoder(positions, x, batch)
        return self.shared_head.norm(x)

    def forward_train(self, input_ids: torch.Tensor, target_hidden: torch.Tensor,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """Dense causal MTP: ``input_ids [B, T]`` (token ``p+1`` at column ``p``),
        ``target_hidden [B, T, hidden]`` (``h_p`` at column ``p``) -> ``[B, T, hidden]``.

        For a sequence ``tokens [B, L]`` call it with ``tokens[:, 1:]`` and the target's
        ``hidden[:, :-1]``; logits at column ``p`` then predict ``tokens[:, p + 2]``.
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self._combine(input_ids, target_hidden)
        x = self.decoder.forward_train(positions, x)
        return self.shared_head.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> fp32 logits through the shared ``lm_head``."""
        return lm_head_logits(self.lm_head, hidden)
