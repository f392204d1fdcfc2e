"""NVFP4 (W4A16) weights decoded in registers: ``nvfp4_gemm`` and ``fused_moe_nvfp4``."""

from mla_spec.kernels.nvfp4.configs import (
    PINNED_CONFIGS,
    PINNED_CUDA,
    CudaMmaConfig,
    GemvConfig,
    MoeGemvConfig,
    NVFP4MmaConfig,
)
from mla_spec.kernels.nvfp4.gemm import nvfp4_gemm
from mla_spec.kernels.nvfp4.moe import MOE_GEMV_MAX_M, fused_moe_nvfp4
from mla_spec.kernels.nvfp4.reference import fused_moe_ref, nvfp4_gemm_ref

__all__ = ["nvfp4_gemm", "nvfp4_gemm_ref", "fused_moe_nvfp4", "fused_moe_ref", "MOE_GEMV_MAX_M",
           "GemvConfig", "NVFP4MmaConfig", "CudaMmaConfig", "MoeGemvConfig", "PINNED_CONFIGS",
           "PINNED_CUDA"]
