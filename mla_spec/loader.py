"""Load DeepSeek-V3 checkpoints (NVIDIA's NVFP4 ModelOpt layout, or BF16) onto a TP rank.

A folder holds ``config.json``, optionally ``hf_quant_config.json``, and ``model.safetensors`` or
indexed shards named as the target's ``state_dict()``; the MTP layer is ``model.layers.{L}.*``
(its embedding / head copies skipped); FP8 KV scales go to ``kv_scales``. A rank reads its shard
along each module's ``tp_shard_dims``. Any problem raises :class:`CheckpointError` naming tensor
and file (``check_finite``: NaN / inf too, one sync per tensor).
"""

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from mla_spec.config import ModelConfig
from mla_spec.models.quant_config import QuantConfig
from mla_spec.quant.fp8 import require_finite
from mla_spec.quant.nvfp4 import check_nvfp4_scales

__all__ = ["CheckpointError", "CheckpointFiles", "LoadedCheckpoint", "load_checkpoint",
           "load_weights", "read_configs"]

_KV_SCALE_RE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:.*\.)?([kv])_scale")


class CheckpointError(ValueError):
    """A checkpoint does not match the model (message names the tensor and the file)."""


class CheckpointFiles:
    """Tensor name -> file map of a checkpoint folder, with lazily opened safetensors handles."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint folder {self.path} does not exist")
        self._handles: dict[str, object] = {}
        index = self.path / "model.safetensors.index.json"
        self.weight_map: dict[str, str] = {}
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
            for fname in sorted(set(wm.values())):
                if not (self.path / fname).exists():
                    first = next(k for k, v in wm.items() if v == fname)
                    raise CheckpointError(f"{index} maps {first!r} (and others) to {fname}, "
                                          "which does not exist")
            self.weight_map = dict(wm)
            for fname in sorted(set(wm.values())):  # every listed tensor must be in its file
                have = set(self._open(fname).keys())
                for name in (k for k, v in wm.items() if v == fname):
                    if name not in have:
                        raise CheckpointError(f"tensor {name!r}: the index says {fname} but "
                                              "that file lacks it")
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.path}")
            for fname in files:
                for name in self._open(fname).keys():
                    if name in self.weight_map:
                        raise CheckpointError(f"tensor {name!r} is in both "
                                              f"{self.weight_map[name]} and {fname}")
                    self.weight_map[name] = fname

    def _open(self, fname: str):
        if fname not in self._handles:
            fpath = self.path / fname
            try:
                self._handles[fname] = safe_open(str(fpath), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{fpath}: cannot read safetensors file (truncated or "
                                      f"corrupt?): {e}") from e
        return self._handles[fname]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def __iter__(self) -> Iterator[str]:
        return iter(self.weight_map)

    def file_of(self, name: str) -> str:
        return self.weight_map[name]

    def get_slice(self, name: str):
        return self._open(self.weight_map[name]).get_slice(name)

    def read(self, name: str, shard_dim: int | None = None, rank: int = 0, size: int = 1
             ) -> torch.Tensor:
        """The tensor (or rank's contiguous 1/size along ``shard_dim``)."""
        fname = self.weight_map[name]
        try:
            if shard_dim is None or size == 1:
                return self._open(fname).get_tensor(name)
            sl = self.get_slice(name)
            n = sl.get_shape()[shard_dim] // size
            idx = [slice(None)] * len(sl.get_shape())
            idx[shard_dim] = slice(rank * n, (rank + 1) * n)
            return sl[tuple(idx)]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"tensor {name!r} in {self.path / fname}: cannot read ({e}); "
                                  "truncated file?") from e


def read_configs(path: str | Path) -> tuple[ModelConfig, QuantConfig | None]:
    """``ModelConfig`` from config.json and the NVFP4 ``QuantConfig`` (None when not quantized)."""
    p = Path(path)
    cj = p / "config.json"
    if not cj.exists():
        raise CheckpointError(f"no config.json in {p}")
    try:
        raw = json.loads(cj.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cj}: not valid JSON ({e})") from e
    try:
        cfg = ModelConfig.from_hf(raw, source=cj)
        return cfg, QuantConfig.from_folder(p, mtp_layer_id=cfg.num_hidden_layers)
    except CheckpointError:
        raise
    except ValueError as e:  # the message names the file
        raise CheckpointError(str(e)) from e


def _check_values(name: str, src: torch.Tensor, t: torch.Tensor, where: Path,
                  check_finite: bool) -> None:
    """Refuse NaN / inf and bad NVFP4 scales: global scales as read (``src``, on the CPU), the
    ``check_finite`` scans on the loaded ``t`` (on its device)."""
    leaf = name.rsplit(".", 1)[-1]
    global_scale = leaf in ("weight_scale_2", "input_scale")
    try:
        if global_scale:
            check_nvfp4_scales(**{leaf: src})
        elif not check_finite:
            return
        elif leaf == "weight_scale" and t.dtype == torch.float8_e4m3fn:
            check_nvfp4_scales(weight_scale=t)
        else:
            require_finite(t, leaf)
    except ValueError as e:
        hint = "" if global_scale else "; check_finite=False skips this scan"
        raise CheckpointError(f"tensor {name!r} in {where}: {e} (a corrupt or badly exported "
                              f"checkpoint{hint})") from e


def _expected(module: torch.nn.Module, rename) -> dict[str, tuple[str, torch.Tensor, int | None]]:
    """``{checkpoint name: (module-local name, tensor, shard dim)}`` for persistent state."""
    out = {}
    for mname, mod in module.named_modules():
        dims = getattr(mod, "tp_shard_dims", {})
        local = list(mod._parameters.items()) + [(k, v) for k, v in mod._buffers.items()
                                                 if k not in mod._non_persistent_buffers_set]
        for pname, t in local:
            if t is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            out[rename(full)] = (full, t, dims.get(pname))
    return out


def _check_and_read(files: CheckpointFiles, name: str, t: torch.Tensor, dim: int | None,
                    rank: int, size: int) -> torch.Tensor:
    fname = files.path / files.file_of(name)
    sl = files.get_slice(name)
    shape, sdtype, want = tuple(sl.get_shape()), sl.get_dtype(), list(t.shape)
    if dim is not None:
        want[dim] *= size
    exact = t.dtype in (torch.uint8, torch.float8_e4m3fn)
    ok_dtype = {torch.uint8: ("U8",), torch.float8_e4m3fn: ("F8_E4M3",)}.get(
        t.dtype, ("BF16", "F16", "F32", "F64"))
    if sdtype not in ok_dtype:
        hint = ""
        if sdtype == "U8" and not exact:
            hint = " (stored as NVFP4, but the quantization config says this module is BF16)"
        elif exact and sdtype in ("BF16", "F16", "F32"):
            hint = " (stored unquantized, but the quantization config says NVFP4)"
        raise CheckpointError(f"tensor {name!r} in {fname}: dtype {sdtype}, expected one of "
                              f"{ok_dtype}{hint}")
    scalar = t.dim() == 0 and shape in ((), (1,))
    if not scalar and shape != tuple(want):
        raise CheckpointError(f"tensor {name!r} in {fname}: shape {list(shape)}, expected {want}"
                              + (f" (= {list(t.shape)} per rank x tp_size {size} on dim {dim})"
                                 if dim is not None and size > 1 else ""))
    out = files.read(name, dim, rank, size)
    return out.reshape(t.shape) if scalar else out


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` returns for one rank."""

    model: torch.nn.Module
    mtp: torch.nn.Module | None
    cfg: ModelConfig
    quant_cfg: QuantConfig | None
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)
    path: Path | None = None


def load_weights(model, files: CheckpointFiles, *, mtp=None, tp_rank: int = 0, tp_size: int = 1,
                 progress: bool | None = None, check_finite: bool = True
                 ) -> dict[int, tuple[float, float]]:
    """Copy this rank's shard of every tensor into ``model`` (and ``mtp``); return the FP8 KV
    scales ``{layer: (k_scale, v_scale)}``. Raises :class:`CheckpointError`."""
    cfg = model.cfg
    n = cfg.num_hidden_layers
    mp = f"model.layers.{n}."
    expected = _expected(model, lambda s: s)
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    if mtp is not None:
        rn = lambda s: mp + (s[len("decoder."):] if s.startswith("decoder.") else s)  # noqa: E731
        expected.update(_expected(mtp, rn))
    skipped = {mp + "embed_tokens.weight", mp + "shared_head.head.weight"}
    layer_re = re.compile(r"model\.layers\.(\d+)\.")
    kv_raw: dict[int, dict[str, float]] = {}
    unexpected = []
    for name in files:
        if name in expected or name in skipped or name.endswith("rotary_emb.inv_freq"):
            continue
        m = _KV_SCALE_RE.fullmatch(name)
        if m:
            v = float(files.read(name).float().reshape(-1)[0])
            if not (v > 0 and math.isfinite(v)):
                raise CheckpointError(f"tensor {name!r} in {files.path / files.file_of(name)}: "
                                      f"FP8 KV scale {v}: must be positive and finite")
            kv_raw.setdefault(int(m.group(1)), {})[m.group(2)] = v
            continue
        lm = layer_re.match(name)
        if lm and (int(lm.group(1)) > n or (int(lm.group(1)) == n and mtp is None)):
            continue  # MTP layers this model does not build
        unexpected.append(name)
    if unexpected:
        name = unexpected[0]
        raise CheckpointError(f"unexpected tensor {name!r} in {files.path / files.file_of(name)}"
                              + (f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    missing = [k for k in expected if k not in files]
    if missing:
        raise CheckpointError(f"tensor {missing[0]!r} is missing from the checkpoint {files.path}"
                              + (f" (+{len(missing) - 1} more, e.g. {missing[1:4]})"
                                 if len(missing) > 1 else ""))
    items = sorted(expected.items())
    bar = tqdm(items, desc=f"loading weights (rank {tp_rank})", unit="tensor",
               disable=progress is False, delay=2.0, leave=False)
    with torch.no_grad():
        for name, (_, t, dim) in bar:
            src = _check_and_read(files, name, t, dim, tp_rank, tp_size)
            t.copy_(src.to(t.dtype) if src.dtype != t.dtype else src)
            _check_values(name, src, t, files.path / files.file_of(name), check_finite)
    return {layer: (d.get("k", d.get("v", 1.0)), d.get("v", d.get("k", 1.0)))
            for layer, d in sorted(kv_raw.items())}


def load_checkpoint(path: str | Path, *, tp_rank: int = 0, tp_size: int = 1,
                    dtype: torch.dtype | None = None, device=None, load_mtp: bool = True,
                    progress: bool | None = None, check_finite: bool = True) -> LoadedCheckpoint:
    """Build the target model (and MTP layer) for one TP rank and load its shard. ``dtype``
    defaults to bf16 on CUDA, fp32 on CPU; ``check_finite`` also scans for NaN / inf."""
    from mla_spec.models.deepseek_v3 import DeepseekV3ForCausalLM
    from mla_spec.models.mtp import DeepseekV3MTP
    cfg, qcfg = read_configs(path)
    files = CheckpointFiles(path)
    device = torch.device(device or "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = DeepseekV3ForCausalLM(cfg, qcfg, tp_rank, tp_size, dtype, device)
    mtp = None
    if load_mtp and cfg.num_nextn_predict_layers > 0:
        mtp = DeepseekV3MTP(cfg, qcfg, tp_rank, tp_size, dtype, device,
                            embed_tokens=model.embed_tokens, lm_head=model.lm_head)
    kv_scales = load_weights(model, files, mtp=mtp, tp_rank=tp_rank, tp_size=tp_size,
                             progress=progress, check_finite=check_finite)
    model.kv_scales = kv_scales
    model.eval()
    if mtp is not None:
        mtp.eval()
    return LoadedCheckpoint(model, mtp, cfg, qcfg, kv_scales, Path(path))
