"""mla_spec: the attention path of DeepSeek-V3 FP4 serving with MTP speculative decoding.

Public API re-exports only; see README.md for the tour. The configs, forward modes and batches
import eagerly; everything that pulls in kernels or the model is resolved on first access, so
``import mla_spec`` stays light and needs neither a GPU nor FlashInfer.
"""

from __future__ import annotations

import importlib

from mla_spec.config import CacheConfig, ModelConfig, ParallelConfig, SpecConfig
from mla_spec.forward_batch import ForwardBatch
from mla_spec.forward_mode import CaptureHiddenMode, ForwardMode

__version__ = "0.1.0"

_LAZY = {
    # engine and runner
    "Engine": "mla_spec.engine",
    "Result": "mla_spec.engine",
    "RequestRejectedError": "mla_spec.engine",
    "ModelRunner": "mla_spec.model_runner",
    # model, checkpoints, parallelism
    "load_model": "mla_spec.model_api",
    "load_checkpoint": "mla_spec.loader",
    "CheckpointError": "mla_spec.loader",
    "save_checkpoint": "mla_spec.checkpoint_writer",
    "DeepseekV3ForCausalLM": "mla_spec.models.deepseek_v3",
    "DeepseekV3MTP": "mla_spec.models.mtp",
    "launch": "mla_spec.parallel",
    "spawn_workers": "mla_spec.parallel",
    "RankFailedError": "mla_spec.parallel",
    "memory_plan": "mla_spec.memory_plan",
    # KV cache and attention
    "MLATokenToKVPool": "mla_spec.kv_cache",
    "ReqToTokenPool": "mla_spec.kv_cache",
    "PageAllocator": "mla_spec.kv_cache",
    "KVCacheFullError": "mla_spec.kv_cache",
    "create_backend": "mla_spec.attention",
    "MLABackend": "mla_spec.attention.base",
    # kernels and quantization
    "pad_draft_extend_query": "mla_spec.kernels.draft_extend_pad",
    "unpad_draft_extend_output": "mla_spec.kernels.draft_extend_pad",
    "mla_decode": "mla_spec.kernels.mla_decode",
    "quantize_fp8": "mla_spec.quant.fp8",
    "dequantize_fp8": "mla_spec.quant.fp8",
    "NVFP4Tensor": "mla_spec.quant.nvfp4",
    "quantize_nvfp4": "mla_spec.quant.nvfp4",
    "dequantize_nvfp4": "mla_spec.quant.nvfp4",
    "NVFP4Linear": "mla_spec.quant.nvfp4_linear",
    "nvfp4_gemm": "mla_spec.kernels.nvfp4_gemm",
    "fused_moe_nvfp4": "mla_spec.kernels.nvfp4_moe",
    # the embedded model
    "EMBEDDED_MODEL": "mla_spec.data",
}

__all__ = [
    "CacheConfig", "CaptureHiddenMode", "ForwardBatch", "ForwardMode", "ModelConfig",
    "ParallelConfig", "SpecConfig", *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mla_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
