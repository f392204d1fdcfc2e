"""DeepSeek-V3 model code: RoPE, RMSNorm, MLA, MoE, the decoder stack, and the MTP layer."""

from mla_spec.models.deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    DeepseekV3Model,
)
from mla_spec.models.mtp import DeepseekV3MTP
from mla_spec.models.quant_config import QuantConfig

__all__ = ["DeepseekV3DecoderLayer", "DeepseekV3ForCausalLM", "DeepseekV3Model", "DeepseekV3MTP",
           "QuantConfig"]
