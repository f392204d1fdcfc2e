"""mla_spec: the attention path of DeepSeek-V3 FP4 serving with MTP speculative decoding.

Public API re-exports only; see README.md for the tour.
"""

from mla_spec.config import CacheConfig, ModelConfig, ParallelConfig, SpecConfig
from mla_spec.forward_batch import ForwardBatch
from mla_spec.forward_mode import CaptureHiddenMode, ForwardMode

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "CaptureHiddenMode",
    "ForwardBatch",
    "ForwardMode",
    "ModelConfig",
    "ParallelConfig",
    "SpecConfig",
]
