"""``load_model``: a checkpoint folder -> a single-rank model that scores token batches.

``load_model(path).logits(input_ids [B, T])`` runs one EXTEND through the serving path: the
quickest way to check a checkpoint or compare backends and KV dtypes without the engine.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from mla_spec.config import CacheConfig, ModelConfig
from mla_spec.forward_batch import ForwardBatch
from mla_spec.models.quant_config import QuantConfig

__all__ = ["LoadedModel", "load_model", "prefill_forward"]

log = logging.getLogger(__name__)


def prefill_forward(model, input_ids: torch.Tensor, *, kv_dtype: torch.dtype | None = None,
                    attention_backend: str = "auto", page_size: int = 16,
                    k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """One EXTEND step over a fresh KV pool (``kv_dtype``, default the model's) and backend:
    ``input_ids [B, T]`` -> hidden ``[B, T, hidden]``."""
    from mla_spec.attention import create_backend
    from mla_spec.kv_cache import MLATokenToKVPool, ReqToTokenPool, assign_request_slots
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got "
                         f"{tuple(input_ids.shape)}")
    cfg: ModelConfig = model.cfg
    dev = model.device
    B, T = input_ids.shape
    pages_per_req = -(-T // page_size)
    pool = MLATokenToKVPool(cfg.num_hidden_layers, B * pages_per_req, page_size,
                            kv_dtype or model.dtype, dev, k_scale=k_scale, v_scale=v_scale,
                            kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim)
    r2t = ReqToTokenPool(B, T, dev)
    for b in range(B):
        pages = list(range(b * pages_per_req, (b + 1) * pages_per_req))
        assign_request_slots(r2t.req_to_token, b, pages, page_size, 0, T)
    out_loc = r2t.req_to_token[:B, :T].reshape(-1).to(torch.int64)
    batch = ForwardBatch.extend([0] * B, [T] * B, req_pool_indices=list(range(B)),
                                out_cache_loc=out_loc, device=dev)
    backend = create_backend(attention_backend, num_heads=model.num_local_heads,
                             softmax_scale=cfg.softmax_scale, kv_pool=pool,
                             req_to_token=r2t, device=dev)
    batch.token_to_kv_pool, batch.attn_backend = pool, backend
    backend.plan(batch)
    with torch.no_grad():
        hidden = model(input_ids.reshape(-1).to(dev), batch.positions, batch)
    return hidden.view(B, T, -1)


@dataclass
class LoadedModel:
    """A TP-1 model plus its MTP layer, loaded from ``path``. See :func:`load_model`."""

    model: torch.nn.Module
    mtp: torch.nn.Module | None
    cfg: ModelConfig
    quant_cfg: QuantConfig | None
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    attention_backend: str
    kv_scales: dict
    path: Path

    def hidden(self, input_ids) -> torch.Tensor:
        """``[B, T]`` token ids -> final-norm hidden states ``[B, T, hidden]``."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        ks = vs = 1.0
        if self.kv_dtype == torch.float8_e4m3fn and self.kv_scales:
            n = self.cfg.num_hidden_layers
            ks = [self.kv_scales.get(i, (1.0, 1.0))[0] for i in range(n)]
            vs = [self.kv_scales.get(i, (1.0, 1.0))[1] for i in range(n)]
        return prefill_forward(self.model, ids, kv_dtype=self.kv_dtype,
                               attention_backend=self.attention_backend, k_scale=ks, v_scale=vs)

    def logits(self, input_ids) -> torch.Tensor:
        """``[B, T]`` token ids -> fp32 logits ``[B, T, vocab]`` (one EXTEND prefill)."""
        return self.model.compute_logits(self.hidden(input_ids))


def load_model(path: str | Path, *, device=None, dtype: torch.dtype | None = None,
               kv_dtype: str = "auto", attention_backend: str = "auto",
               load_mtp: bool = True, check_finite: bool = True) -> LoadedModel:
    """Load a DeepSeek-V3 checkpoint on one device (TP 1). ``device`` defaults to CUDA when
    available, ``dtype`` to bf16 on CUDA and fp32 on CPU; ``kv_dtype`` "auto" is the model's."""
    from mla_spec.device import default_device
    from mla_spec.loader import load_checkpoint
    dev = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kv = CacheConfig(kv_dtype=kv_dtype).torch_dtype(dtype)
    ck = load_checkpoint(path, dtype=dtype, device=dev, load_mtp=load_mtp,
                         check_finite=check_finite)
    log.info("loaded %s: %d layers, quant=%s, kv=%s, backend=%s", path,
             ck.cfg.num_hidden_layers, ck.quant_cfg and ck.quant_cfg.quant_algo, kv,
             attention_backend)
    return LoadedModel(ck.model, ck.mtp, ck.cfg, ck.quant_cfg, dev, dtype, kv,
                       attention_backend, ck.kv_scales, Path(path))
