"""Attention backends for absorbed MLA over the paged latent cache, registered by name.

=========== ==================================================== ============================
name        implementation                                       runs on
=========== ==================================================== ============================
torch       the oracle: einsum, fp32 accumulation                any device
triton      our split-KV kernels (``kernels/mla``)                CUDA SM80+, CPU interpreter
flashinfer  ``flashinfer.mla.BatchMLAPagedAttentionWrapper``     CUDA SM80 / SM90
trtllm      ``flashinfer.decode.trtllm_batch_decode_with_kv_c…`` CUDA SM100 (kernel injectable)
=========== ==================================================== ============================

``create_backend("auto", ...)`` picks by device: SM100+ -> trtllm, SM80/SM90 -> triton, CPU ->
torch (the Triton interpreter is only used when "triton" is asked for explicitly), and logs why.
Asking for a backend the device cannot run raises an error naming those that can. Backend modules
are imported lazily, so ``import mla_spec`` never imports FlashInfer.
"""

from __future__ import annotations

import importlib
import logging

import torch

from mla_spec.attention.base import AttnPlan, MLABackend, UnsupportedError
from mla_spec.device import cuda_capability

__all__ = [
    "BACKENDS",
    "MLABackend",
    "AttnPlan",
    "UnsupportedError",
    "create_backend",
    "get_backend_class",
    "backends_for_device",
    "resolve_auto",
]

logger = logging.getLogger(__name__)

# name -> (module, class); imported on first use
BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("mla_spec.attention.torch_ref", "TorchMLABackend"),
    "triton": ("mla_spec.attention.triton_mla", "TritonMLABackend"),
    "flashinfer": ("mla_spec.attention.flashinfer_mla", "FlashInferMLABackend"),
    "trtllm": ("mla_spec.attention.trtllm_mla", "TRTLLMMLABackend"),
}


def get_backend_class(name: str) -> type[MLABackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: supported "
                         + ", ".join(["auto", *BACKENDS]))
    mod, cls = BACKENDS[name]
    return getattr(importlib.import_module(mod), cls)


def backends_for_device(device) -> dict[str, str | None]:
    """``{name: None if it can run on device else the reason}`` for every registered backend."""
    dev = torch.device(device)
    return {name: get_backend_class(name).device_reason(dev) for name in BACKENDS}


def resolve_auto(device) -> tuple[str, str]:
    """``(backend name, why)`` for ``"auto"`` on ``device``."""
    dev = torch.device(device)
    cap = cuda_capability(dev)
    if cap is None:
        return "torch", f"{dev.type} device: the torch oracle (Triton only runs on CUDA here)"
    if cap[0] >= 10:
        if get_backend_class("trtllm").device_reason(dev) is None:
            return "trtllm", f"SM{cap[0]}{cap[1]} (Blackwell): trtllm-gen MLA via FlashInfer"
        return "triton", f"SM{cap[0]}{cap[1]}: trtllm-gen unavailable, using our Triton kernels"
    if cap[0] >= 8:
        return "triton", (f"SM{cap[0]}{cap[1]}: our split-KV Triton kernels (faster than "
                          "FlashInfer's MLA with FP8 KV on Hopper)")
    return "torch", f"SM{cap[0]}{cap[1]} is below SM80: the torch oracle"


def create_backend(
    name: str = "auto",
    *,
    num_heads: int,
    softmax_scale: float,
    kv_pool,
    req_to_token,
    device=None,
    **kwargs,
) -> MLABackend:
    """Build an attention backend by name ("auto" | "torch" | "triton" | "flashinfer" | "trtllm").

    Parameters
    ----------
    num_heads : local query heads (128 / tp)
    softmax_scale : ``1/sqrt(192) * mscale**2`` (``ModelConfig.softmax_scale``)
    kv_pool : ``MLATokenToKVPool``
    req_to_token : ``ReqToTokenPool`` or its ``[max_reqs, max_ctx]`` int32 tensor
    device : defaults to the pool's device
    kwargs : backend-specific options (e.g. ``kernel=`` for trtllm, ``num_splits=`` for triton)
    """
    dev = torch.device(device) if device is not None else kv_pool.device
    if name == "auto":
        name, why = resolve_auto(dev)
        logger.info("attention backend auto -> %s (%s)", name, why)
    cls = get_backend_class(name)
    injected = name == "trtllm" and kwargs.get("kernel") is not None
    reason = None if injected else cls.device_reason(dev)
    if reason is not None:
        able = [n for n, r in backends_for_device(dev).items() if r is None]
        raise UnsupportedError(
            f"attention backend {name!r} cannot run on {dev}: {reason}. "
            f"Backends that can: {', '.join(able)}"
        )
    return cls(num_heads=num_heads, softmax_scale=softmax_scale, kv_pool=kv_pool,
               req_to_token=req_to_token, device=dev, **kwargs)
