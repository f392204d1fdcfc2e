"""Frozen configuration dataclasses: model, KV cache, speculative decoding, parallelism.
``ModelConfig.from_hf`` refuses a config.json lacking a ``REQUIRED_CONFIG_KEYS`` key.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

__all__ = ["ModelConfig", "CacheConfig", "SpecConfig", "ParallelConfig", "yarn_mscale",
           "REQUIRED_CONFIG_KEYS"]

log = logging.getLogger(__name__)

#: config.json keys ``ModelConfig.from_hf`` requires: each changes the shapes or the math (only
#: ``q_lora_rank`` may be null; ``rope_theta`` may sit in ``rope_parameters``).
REQUIRED_CONFIG_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "n_shared_experts", "n_routed_experts",
    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group", "num_experts_per_tok",
    "first_k_dense_replace", "norm_topk_prob", "max_position_embeddings", "rms_norm_eps",
    "rope_theta",
)
_NULLABLE_KEYS = ("q_lora_rank",)
# fields whose absence is not a default taken: no quantization_config means not quantized
_UNLOGGED_KEYS = ("quantization_config",)
_logged_defaults: set[tuple[str, str]] = set()


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor (1.0 when the context is not stretched)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 architecture (field names follow config.json)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    topk_method: str = "noaux_tc"
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    moe_layer_freq: int = 1
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    torch_dtype: str = "bfloat16"
    quantization_config: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % max(self.num_key_value_heads, 1) and self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {self.topk_method!r}: supported noaux_tc, greedy")
        if self.n_routed_experts and self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} must be a multiple of "
                             f"n_group {self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group {self.topk_group} > n_group {self.n_group}")

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | Mapping[str, Any], *,
                source: str | Path | None = None) -> ModelConfig:
        """Build from a config.json path, a model folder, or the parsed dict (``source``: its file).
        Unknown keys are ignored; absent fields take defaults, logged once per file and key."""
        if isinstance(path_or_dict, Mapping):
            raw = dict(path_or_dict)
            src = str(source) if source is not None else "config.json (dict)"
        else:
            p = Path(path_or_dict)
            if p.is_dir():
                p = p / "config.json"
            if not p.exists():
                raise FileNotFoundError(f"no config.json at {p}")
            raw = json.loads(p.read_text())
            src = str(source) if source is not None else str(p)
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        # transformers >= 5 saves rope settings as `rope_parameters` (rope_theta inside it).
        rope = raw.get("rope_parameters")
        if isinstance(rope, Mapping):
            if kwargs.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
                kwargs["rope_scaling"] = {("type" if k == "rope_type" else k): v
                                          for k, v in rope.items() if k != "rope_theta"}
            if "rope_theta" in rope and "rope_theta" not in raw:
                kwargs["rope_theta"] = rope["rope_theta"]
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        missing = [k for k in REQUIRED_CONFIG_KEYS
                   if k not in kwargs or kwargs[k] is None and k not in _NULLABLE_KEYS]
        if missing:
            raise ValueError(f"{src}: missing or null key(s) {', '.join(map(repr, missing))}: the "
                             "DeepSeek-V3 architecture needs them (no default is guessed, it would "
                             "change the outputs); required keys: "
                             f"{', '.join(REQUIRED_CONFIG_KEYS)}")
        given = set(kwargs) | ({"rope_scaling"} if isinstance(rope, Mapping) else set())
        for f in fields(cls):
            if f.name in given or f.name in _UNLOGGED_KEYS or (src, f.name) in _logged_defaults:
                continue
            _logged_defaults.add((src, f.name))
            log.warning("%s has no %r: using the default %r", src, f.name, f.default)
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"{src}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = dict(d["rope_scaling"])
        if d["quantization_config"] is None:
            del d["quantization_config"]
        d["model_type"] = "deepseek_v3"
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        return d

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one latent KV row: kv_lora_rank (ckv) + qk_rope_head_dim (kpe) = 576."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mscale(self) -> float:
        rs = self.rope_scaling or {}
        if rs.get("type", rs.get("rope_type")) != "yarn":
            return 1.0
        return yarn_mscale(float(rs.get("factor", 1.0)), float(rs.get("mscale_all_dim", 0.0)))

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(qk_head_dim) * mscale**2`` (0.1352338 for DeepSeek-V3: YaRN factor 40)."""
        return self.qk_head_dim**-0.5 * self.mscale**2

    def is_moe_layer(self, layer_id: int) -> bool:
        """Layers from ``first_k_dense_replace`` on are MoE (every ``moe_layer_freq``-th)."""
        return (self.n_routed_experts > 0 and layer_id >= self.first_k_dense_replace
                and layer_id % self.moe_layer_freq == 0)


_KV_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
              "float32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class CacheConfig:
    """Paged latent KV cache. ``kv_dtype``: "auto" (the model's dtype) or one of ``_KV_DTYPES``;
    ``k_scale`` / ``v_scale``: FP8 scales (real = stored * scale) for every layer."""

    page_size: int = 64
    kv_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kv_dtype != "auto" and self.kv_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r}: supported 'auto', "
                             + ", ".join(map(repr, _KV_DTYPES)))
        if self.page_size < 1:
            raise ValueError(f"page_size {self.page_size}: must be >= 1")
        for name in ("k_scale", "v_scale"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} = {v}: must be a positive finite float")

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Resolve ``"auto"`` to the model's dtype."""
        return model_dtype if self.kv_dtype == "auto" else _KV_DTYPES[self.kv_dtype]

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"


@dataclass(frozen=True)
class SpecConfig:
    """EAGLE / NEXTN speculative decoding with DeepSeek's MTP layer as the draft model. ``version``
    "v1": ragged DRAFT_EXTEND over the accepted rows; "v2": DRAFT_EXTEND_V2 over
    ``num_draft_tokens`` rows (fixed shape, no host sync). ``algorithm`` "NONE" turns it off."""

    algorithm: str = "EAGLE"
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    version: str = "v2"

    def __post_init__(self) -> None:
        algo = self.algorithm.upper()
        if algo not in ("EAGLE", "NEXTN", "NONE"):
            raise ValueError(f"algorithm {self.algorithm!r}: supported EAGLE, NEXTN, NONE")
        object.__setattr__(self, "algorithm", "EAGLE" if algo == "NEXTN" else algo)
        if self.version not in ("v1", "v2"):
            raise ValueError(f"version {self.version!r}: supported 'v1', 'v2'")
        if self.topk != 1:
            raise ValueError(f"topk {self.topk}: only topk 1 (a chain of drafts) is supported")
        if self.num_steps < 1:
            raise ValueError(f"num_steps {self.num_steps}: must be >= 1")
        if self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"num_draft_tokens {self.num_draft_tokens} with topk 1 must be "
                             f"num_steps + 1 = {self.num_steps + 1}")

    @property
    def enabled(self) -> bool:
        return self.algorithm != "NONE"

    @classmethod
    def off(cls) -> SpecConfig:
        return cls(algorithm="NONE")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism. ``backend``: "auto" (nccl on GPUs, gloo on CPU), "nccl" or "gloo";
    ``timeout_s``: collective timeout (None: ``mla_spec.distributed``'s default per backend)."""

    tp_size: int = 1
    backend: str = "auto"
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size {self.tp_size}: must be >= 1")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"backend {self.backend!r}: supported auto, nccl, gloo")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s {self.timeout_s}: must be > 0 (or None for the default)")
