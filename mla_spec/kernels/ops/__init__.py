"""The layer's small ops, each with its torch reference beside the kernel."""

from mla_spec.kernels.ops.bf16_gemv import bgemv, bgemv_supported, gemv_linear
from mla_spec.kernels.ops.kv_store import store_kv
from mla_spec.kernels.ops.rmsnorm import rms_norm, rms_norm_add, rms_norm_add_ref, rms_norm_ref
from mla_spec.kernels.ops.rope import apply_rope_interleaved, rope_cos_sin, rope_qk, rope_qk_ref
from mla_spec.kernels.ops.router import (
    fused_route,
    fused_route_ref,
    fused_route_supports,
    gate_logits,
    gate_logits_ref,
    route_tokens,
)

__all__ = ["bgemv", "bgemv_supported", "gemv_linear", "store_kv", "rms_norm", "rms_norm_add",
           "rms_norm_add_ref", "rms_norm_ref", "apply_rope_interleaved", "rope_cos_sin",
           "rope_qk", "rope_qk_ref", "fused_route", "fused_route_ref", "fused_route_supports",
           "gate_logits", "gate_logits_ref", "route_tokens"]
