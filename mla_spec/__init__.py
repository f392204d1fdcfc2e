"""mla_spec: the attention path of DeepSeek-V3 FP4 serving with MTP speculative decoding.

Public API re-exports only; see README.md for the tour. The configs, forward modes and batches
import eagerly; everything that pulls in kernels or the model is resolved on first access, so
``import mla_spec`` stays light and needs neither a GPU nor FlashInfer.

Where no CUDA device is available and ``TRITON_INTERPRET`` is unset, the import sets it to "1"
before anything imports triton, so the Triton kernels run in Triton's CPU interpreter with no
setup, while the dispatching entry points keep their torch twins on CPU
(``MLA_SPEC_TRITON_ON_CPU``; ``mla_spec.device.interpret_triton_without_gpu`` says more). Triton
reads the variable when each ``@triton.jit`` runs, its own helpers (``tl.sum``, ...) included at
``import triton``: import mla_spec before triton, or set ``TRITON_INTERPRET=1`` before
``import triton`` (when triton comes first, the import warns and leaves the interpreter off).
"""

from __future__ import annotations

import importlib

from mla_spec.device import interpret_triton_without_gpu

interpret_triton_without_gpu()  # first: before anything below imports triton

from mla_spec.config import CacheConfig, ModelConfig, ParallelConfig, SpecConfig  # noqa: E402
from mla_spec.forward_batch import ForwardBatch  # noqa: E402
from mla_spec.forward_mode import CaptureHiddenMode, ForwardMode  # noqa: E402

__version__ = "0.1.0"

_LAZY = {
    # engine and runner
    "Engine": "mla_spec.engine", "Result": "mla_spec.engine",
    "RequestRejectedError": "mla_spec.engine", "PipelineStepper": "mla_spec.pipeline",
    "ModelRunner": "mla_spec.model_runner",
    # model, checkpoints, parallelism
    "load_model": "mla_spec.model_api", "save_checkpoint": "mla_spec.checkpoint_writer",
    "load_checkpoint": "mla_spec.loader", "CheckpointError": "mla_spec.loader",
    "DeepseekV3ForCausalLM": "mla_spec.models.deepseek_v3", "DeepseekV3MTP": "mla_spec.models.mtp",
    "launch": "mla_spec.runtime.launch", "spawn_workers": "mla_spec.runtime.workers",
    "RankFailedError": "mla_spec.runtime.workers", "memory_plan": "mla_spec.memory_plan",
    # KV cache and attention
    "MLATokenToKVPool": "mla_spec.kv_cache", "ReqToTokenPool": "mla_spec.kv_cache",
    "PageAllocator": "mla_spec.kv_cache", "KVCacheFullError": "mla_spec.kv_cache",
    "create_backend": "mla_spec.attention", "register_backend": "mla_spec.attention",
    "MLABackend": "mla_spec.attention.base", "check_backend": "mla_spec.attention.conformance",
    # kernels and quantization
    "pad_draft_extend_query": "mla_spec.kernels.pad",
    "unpad_draft_extend_output": "mla_spec.kernels.pad", "mla_decode": "mla_spec.kernels.mla",
    "quantize_fp8": "mla_spec.quant.fp8", "dequantize_fp8": "mla_spec.quant.fp8",
    "NVFP4Tensor": "mla_spec.quant.nvfp4", "quantize_nvfp4": "mla_spec.quant.nvfp4",
    "dequantize_nvfp4": "mla_spec.quant.nvfp4", "NVFP4Linear": "mla_spec.models.linear",
    "nvfp4_gemm": "mla_spec.kernels.nvfp4", "fused_moe_nvfp4": "mla_spec.kernels.nvfp4",
    # the embedded model
    "EMBEDDED_MODEL": "mla_spec.data",
}

__all__ = ["CacheConfig", "CaptureHiddenMode", "ForwardBatch", "ForwardMode", "ModelConfig",
           "ParallelConfig", "SpecConfig", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mla_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
