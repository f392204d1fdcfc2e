"""Which linears of a checkpoint are NVFP4: ModelOpt's quantization config, both formats.

Read from ``hf_quant_config.json`` (nested ``quantization``) or ``config.json``'s flat
``quantization_config``. Exclusions are globs over whole module names; excluded linears and the
MTP layer stay BF16. Anything but NVFP4 weights with an FP8 or no KV quantization raises
``ValueError`` naming the value and the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["QuantConfig", "SUPPORTED_QUANT_ALGOS", "SUPPORTED_KV_CACHE_QUANT_ALGOS"]

SUPPORTED_QUANT_ALGOS = ("NVFP4",)
#: ``kv_cache_quant_algo`` values (case-insensitive); None (absent or null) means no KV quantization
SUPPORTED_KV_CACHE_QUANT_ALGOS = ("FP8",)


def _glob_to_regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", ".*"))


@dataclass(frozen=True)
class QuantConfig:
    """NVFP4 weight quantization with BF16 exclusions; ``kv_cache_quant_algo`` "FP8" (any case)
    or None; ``mtp_layer_id`` the checkpoint index of the MTP layer (always BF16)."""

    quant_algo: str = "NVFP4"
    group_size: int = 16
    exclude_modules: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = None
    producer: Mapping[str, Any] = field(default_factory=dict, compare=False)
    mtp_layer_id: int | None = None

    def __post_init__(self) -> None:
        if self.quant_algo not in SUPPORTED_QUANT_ALGOS:
            raise ValueError(f"quant_algo {self.quant_algo!r}: supported "
                             f"{', '.join(map(repr, SUPPORTED_QUANT_ALGOS))} (a checkpoint "
                             "without a quantization config loads as BF16)")
        kv = self.kv_cache_quant_algo
        if kv is not None and (not isinstance(kv, str)
                               or kv.upper() not in SUPPORTED_KV_CACHE_QUANT_ALGOS):
            raise ValueError(f"kv_cache_quant_algo {kv!r}: supported "
                             f"{', '.join(map(repr, SUPPORTED_KV_CACHE_QUANT_ALGOS))} (an e4m3 "
                             "KV cache) or null (none)")
        if self.group_size != 16:
            raise ValueError(f"group_size {self.group_size}: NVFP4 uses 16")
        object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))
        object.__setattr__(self, "_regexes",
                           tuple(_glob_to_regex(p) for p in self.exclude_modules))

    @classmethod
    def from_hf_quant_config(cls, d: Mapping[str, Any], **kw) -> QuantConfig:
        """From the nested ``hf_quant_config.json`` dict."""
        if "quantization" not in d:
            raise ValueError("hf_quant_config.json has no 'quantization' section")
        q = d["quantization"]
        return cls(quant_algo=q.get("quant_algo"), group_size=int(q.get("group_size", 16)),
                   exclude_modules=tuple(q.get("exclude_modules") or ()),
                   kv_cache_quant_algo=q.get("kv_cache_quant_algo") or None,
                   producer=dict(d.get("producer") or {}), **kw)

    @classmethod
    def from_quantization_config(cls, q: Mapping[str, Any], **kw) -> QuantConfig:
        """From the flat ``quantization_config`` of config.json."""
        algo = q.get("quant_algo")
        group = q.get("group_size")
        for g in (q.get("config_groups") or {}).values():
            w = g.get("weights") or {}
            algo = algo or ("NVFP4" if w.get("num_bits") == 4 else None)
            group = group or w.get("group_size")
        kv = q.get("kv_cache_quant_algo")
        scheme = q.get("kv_cache_scheme")
        if kv is None and scheme:
            if not (scheme.get("type") == "float" and scheme.get("num_bits") == 8):
                raise ValueError(f"kv_cache_scheme {dict(scheme)!r}: supported "
                                 "{'type': 'float', 'num_bits': 8} (an FP8 e4m3 KV cache)")
            kv = "FP8"
        return cls(quant_algo=algo, group_size=int(group or 16),
                   exclude_modules=tuple(q.get("ignore") or q.get("exclude_modules") or ()),
                   kv_cache_quant_algo=kv, producer=dict(q.get("producer") or {}), **kw)

    @classmethod
    def from_folder(cls, path: str | Path, mtp_layer_id: int | None = None
                    ) -> QuantConfig | None:
        """Read a checkpoint folder; None when it is not quantized."""
        p = Path(path)
        hq = p / "hf_quant_config.json"
        if hq.exists():
            try:
                d = json.loads(hq.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{hq}: not valid JSON ({e})") from e
            try:
                return cls.from_hf_quant_config(d, mtp_layer_id=mtp_layer_id)
            except ValueError as e:
                raise ValueError(f"{hq}: {e}") from e
        cj = p / "config.json"
        if cj.exists():
            q = json.loads(cj.read_text()).get("quantization_config")
            if q:
                if q.get("quant_method") not in (None, "modelopt"):
                    raise ValueError(f"{cj}: quantization_config.quant_method "
                                     f"{q.get('quant_method')!r}: supported 'modelopt' (NVFP4)")
                try:
                    return cls.from_quantization_config(q, mtp_layer_id=mtp_layer_id)
                except ValueError as e:
                    raise ValueError(f"{cj}: quantization_config: {e}") from e
        return None

    def is_excluded(self, prefix: str) -> bool:
        """Whether module ``prefix`` (e.g. ``model.layers.3.self_attn.q_b_proj``) stays BF16."""
        return any(r.fullmatch(prefix) for r in self._regexes)

    def is_quantized(self, prefix: str) -> bool:
        """Whether the linear named ``prefix`` is stored as NVFP4."""
        mtp = self.mtp_layer_id
        if mtp is not None and prefix.startswith(f"model.layers.{mtp}."):
            return False
        return not self.is_excluded(prefix)

    @property
    def kv_cache_fp8(self) -> bool:
        return (self.kv_cache_quant_algo or "").upper() == "FP8"

    def to_hf_quant_config(self) -> dict[str, Any]:
        return {"producer": dict(self.producer) or {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": self.quant_algo,
                                 "kv_cache_quant_algo": self.kv_cache_quant_algo,
                                 "group_size": self.group_size,
                                 "exclude_modules": list(self.exclude_modules)}}
