"""Attention backends for absorbed MLA over the paged latent cache, registered by name.

=========== ==================================================== ============================
name        implementation                                       runs on
=========== ==================================================== ============================
torch       the oracle: einsum, fp32 accumulation                any device
triton      our split-KV kernels (``kernels/mla``)                CUDA SM80+, CPU interpreter
flashinfer  ``flashinfer.mla.BatchMLAPagedAttentionWrapper``     CUDA SM80 / SM90
trtllm      ``flashinfer.decode.trtllm_batch_decode_with_kv_c…`` CUDA SM100 (kernel injectable)
=========== ==================================================== ============================

``create_backend("auto", ...)`` picks by device (SM100+ trtllm, SM80/SM90 triton, CPU torch: the
Triton interpreter only when asked for) and logs why; a backend the device cannot run is refused,
naming those that can. Modules are imported lazily (``import mla_spec`` never imports FlashInfer).

A new backend (the contract: :class:`MLABackend`'s docstring) is registered by name with
:func:`register_backend` (also a decorator), or named ``"module.path:ClassName"`` (imported and
registered on first use: how the command line reaches one), or passed as the class itself.
``mla_spec.attention.conformance.check_backend`` scores it against the oracle in every mode.
"""

import importlib
import inspect
import logging

import torch

from mla_spec.attention.base import AttnPlan, MLABackend, UnsupportedError
from mla_spec.device import cuda_capability

__all__ = ["BACKENDS", "MLABackend", "AttnPlan", "UnsupportedError", "create_backend",
           "get_backend_class", "register_backend", "backends_for_device", "resolve_auto"]

logger = logging.getLogger(__name__)

# name -> (module, class) of the built-ins, imported on first use; or a registered class
BACKENDS: dict[str, tuple[str, str] | type[MLABackend]] = {
    "torch": ("mla_spec.attention.torch_ref", "TorchMLABackend"),
    "triton": ("mla_spec.attention.triton_mla", "TritonMLABackend"),
    "flashinfer": ("mla_spec.attention.flashinfer_mla", "FlashInferMLABackend"),
    "trtllm": ("mla_spec.attention.trtllm_mla", "TRTLLMMLABackend"),
}
_BUILTIN = tuple(BACKENDS)


def register_backend(name: str, cls: type[MLABackend] | None = None):
    """Register ``cls`` (an :class:`MLABackend` subclass) under ``name``; returns ``cls``.
    ``@register_backend("name")`` decorates a class. A class that does not set ``name`` itself
    gets this one. Registering a name again replaces the class (a notebook cell run twice); the
    built-in names and "auto" are refused."""
    if cls is None:
        return lambda c: register_backend(name, c)
    if not isinstance(name, str) or not name or name == "auto" or name in _BUILTIN:
        raise ValueError(f"backend name {name!r}: choose a non-empty name other than 'auto' "
                         f"and the built-ins ({', '.join(_BUILTIN)})")
    if not (isinstance(cls, type) and issubclass(cls, MLABackend)):
        raise TypeError(f"register_backend({name!r}, {cls!r}): needs an MLABackend subclass")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"{cls.__qualname__} does not implement {missing}")
    if "name" not in cls.__dict__:
        cls.name = name
    BACKENDS[name] = cls
    return cls


def get_backend_class(backend: str | type[MLABackend]) -> type[MLABackend]:
    """The class of a registered name, of ``"module.path:ClassName"`` (imported, registered under
    that string), or ``backend`` itself when it is an :class:`MLABackend` subclass."""
    if isinstance(backend, type) and issubclass(backend, MLABackend):
        return backend
    if isinstance(backend, str) and backend not in BACKENDS and ":" in backend:
        mod, _, qual = backend.partition(":")
        try:
            obj = importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"attention backend {backend!r}: cannot import {mod} ({e})") from e
        for part in qual.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"attention backend {backend!r}: {mod} has no {qual}")
        return register_backend(backend, obj)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: supported "
                         + ", ".join(["auto", *BACKENDS])
                         + ", an MLABackend subclass, or 'module.path:ClassName'")
    mod_or_cls = BACKENDS[backend]
    if isinstance(mod_or_cls, type):
        return mod_or_cls
    return getattr(importlib.import_module(mod_or_cls[0]), mod_or_cls[1])


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


def create_backend(name: str | type[MLABackend] = "auto", *, num_heads: int,
                   softmax_scale: float, kv_pool, req_to_token, device=None,
                   **kwargs) -> MLABackend:
    """Build an attention backend: "auto", a registered name ("torch" | "triton" | "flashinfer" |
    "trtllm" | yours), ``"module.path:ClassName"`` or an :class:`MLABackend` subclass.
    ``num_heads``: local query heads (128 / tp); ``softmax_scale``: ``ModelConfig.softmax_scale``
    (``1/sqrt(192) * mscale**2``); ``req_to_token``: a ``ReqToTokenPool`` or its int32 tensor;
    ``device``: default the pool's; ``kwargs``: backend options (trtllm ``kernel=``, ...)."""
    dev = torch.device(device) if device is not None else kv_pool.device
    if name == "auto":
        name, why = resolve_auto(dev)
        logger.info("attention backend auto -> %s (%s)", name, why)
    cls = get_backend_class(name)
    injected = cls.name == "trtllm" and kwargs.get("kernel") is not None
    reason = None if injected else cls.device_reason(dev)
    if reason is not None:
        able = [n for n, r in backends_for_device(dev).items() if r is None]
        raise UnsupportedError(f"attention backend {cls.name!r} cannot run on {dev}: {reason}. "
                               f"Backends that can: {', '.join(able)}")
    return cls(num_heads=num_heads, softmax_scale=softmax_scale, kv_pool=kv_pool,
               req_to_token=req_to_token, device=dev, **kwargs)
