"""Write small DeepSeek-V3 checkpoints in NVIDIA's FP4 layout (or plain BF16 / FP32).

``nvidia/DeepSeek-V3-0324-FP4`` in miniature: dense MLPs and experts NVFP4, the rest BF16.
:func:`random_state_dict` makes random weights that keep activations O(1) through depth.
"""

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mla_spec.config import ModelConfig
from mla_spec.models.quant_config import QuantConfig

__all__ = ["calibrate_kv_scales", "tiny_config", "random_state_dict", "export_state_dict",
           "save_checkpoint", "default_exclude_modules", "LINEAR_RE"]

# The weight of every linear layer (quantization candidates).
LINEAR_RE = re.compile(r"(.*\.mlp(\.experts\.\d+|\.shared_experts)?\.(gate|up|down)_proj"
                       r"|.*\.self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj"
                       r"|o_proj)|.*\.eh_proj|lm_head)\.weight")


def tiny_config(**overrides: Any) -> ModelConfig:
    """A DeepSeek-V3-shaped config for CPU tests (TP 1, 2, 4 with NVFP4): 3 layers (1 dense,
    2 MoE) + 1 MTP layer, 4 heads, 8 experts in 4 groups, YaRN RoPE."""
    base: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=3, num_nextn_predict_layers=1, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=64, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=512, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        torch_dtype="bfloat16",
    )
    base.update(overrides)
    return ModelConfig(**base)


def _init_tensor(name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight") or re.search(r"(enorm|hnorm)\.weight$", name):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("e_score_correction_bias"):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=g)
    fan_in = shape[-1]
    return torch.randn(shape, generator=g) / fan_in**0.5


def export_state_dict(model, mtp=None) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors of a TP-1 target model and its MTP layer (at
    ``model.layers.{num_hidden_layers}.*``, with copies of the shared embedding and head)."""
    if getattr(model, "tp_size", 1) != 1:
        raise ValueError("export_state_dict needs the TP-1 model (tensors are not gathered)")
    out = dict(model.state_dict())
    if model.cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    if mtp is not None:
        p = f"model.layers.{model.cfg.num_hidden_layers}."
        for k, v in mtp.state_dict().items():
            out[p + (k[len("decoder."):] if k.startswith("decoder.") else k)] = v
        out[p + "embed_tokens.weight"] = model.embed_tokens.weight
        out[p + "shared_head.head.weight"] = model.lm_head.weight
    return out


def random_state_dict(cfg: ModelConfig, seed: int = 0, *, mtp: bool = True
                      ) -> dict[str, torch.Tensor]:
    """Full (TP 1) fp32 state dict with checkpoint names and O(1)-scale random weights."""
    from mla_spec.models.deepseek_v3 import DeepseekV3ForCausalLM
    from mla_spec.models.mtp import DeepseekV3MTP
    with torch.device("meta"):  # names and shapes only
        model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32)
        mtp_mod = DeepseekV3MTP(cfg, dtype=torch.float32) if cfg.num_nextn_predict_layers else None
    names = export_state_dict(model, mtp_mod if mtp else None)
    g = torch.Generator().manual_seed(seed)
    sd = {n: _init_tensor(n, t.shape, g) for n, t in sorted(names.items())}
    if mtp and mtp_mod is not None:  # the MTP layer's copies equal the target's tensors
        p = f"model.layers.{cfg.num_hidden_layers}."
        sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"]
        if "lm_head.weight" in sd:
            sd[p + "shared_head.head.weight"] = sd["lm_head.weight"]
    return sd


def default_exclude_modules(cfg: ModelConfig) -> list[str]:
    """BF16 modules of NVIDIA's DeepSeek FP4 checkpoints: attention, router, lm_head, MTP."""
    return ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate",
            f"model.layers.{cfg.num_hidden_layers}*"]


def _quantize_all(sd: Mapping[str, torch.Tensor], qcfg: QuantConfig, dtype: torch.dtype
                  ) -> dict[str, torch.Tensor]:
    from mla_spec.models.linear import quantize_weight
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = LINEAR_RE.fullmatch(name)
        if m and qcfg.is_quantized(m.group(1)):
            for suffix, q in quantize_weight(t).items():
                out[f"{m.group(1)}.{suffix}"] = q
        elif name.endswith("e_score_correction_bias") or t.dim() == 0:
            out[name] = t.float()
        elif t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn,):
            out[name] = t.to(dtype)
        else:
            out[name] = t
    return out


def _write_shards(tensors: dict[str, torch.Tensor], path: Path, shards: int) -> None:
    names = sorted(tensors)
    tensors = {k: tensors[k].detach().cpu().contiguous().clone() for k in names}
    if shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    shards = min(shards, len(names))
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i * per:(i + 1) * per]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


@torch.no_grad()
def calibrate_kv_scales(model, mtp, input_ids: torch.Tensor) -> dict[int, tuple[float, float]]:
    """Per-layer FP8 KV scales ``amax / 448`` of the cached ``[ckv | k_pe]`` rows over
    ``forward_train(input_ids)`` (target and MTP); ``{layer: (k_scale, v_scale)}``, equal."""
    from mla_spec.quant.fp8 import FP8_E4M3_MAX
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"calibrate_kv_scales needs input_ids [B, T] with B, T >= 1, got "
                         f"{tuple(input_ids.shape)}")
    n = model.cfg.num_hidden_layers
    attns = {i: layer.self_attn for i, layer in enumerate(model.layers)}
    if mtp is not None:
        attns[n] = mtp.decoder.self_attn
    amax = dict.fromkeys(attns, 0.0)
    hooks = []

    def record(layer: int, pick):
        def hook(module, args, out):
            amax[layer] = max(amax[layer], float(pick(out).detach().abs().max()))
        return hook

    for layer, attn in attns.items():  # both are called as modules inside forward_train
        hooks.append(attn.kv_a_layernorm.register_forward_hook(record(layer, lambda o: o)))
        hooks.append(attn.rotary_emb.register_forward_hook(record(layer, lambda o: o[1])))
    try:
        h = model.forward_train(input_ids)
        if mtp is not None and input_ids.shape[1] >= 3:
            m1 = mtp.forward_train(input_ids[:, 1:], h[:, :-1])
            pos2 = torch.arange(1, input_ids.shape[1] - 1, device=input_ids.device)
            mtp.forward_train(input_ids[:, 2:], m1[:, :-1], positions=pos2)
    finally:
        for hk in hooks:
            hk.remove()
    for layer, a in sorted(amax.items()):
        if not (a > 0 and a == a and a != float("inf")):
            raise ValueError(f"layer {layer}: KV amax {a} over the calibration text; cannot "
                             "make an FP8 scale (was the layer run?)")
    return {layer: (a / FP8_E4M3_MAX, a / FP8_E4M3_MAX) for layer, a in sorted(amax.items())}


def save_checkpoint(state_dict_like, cfg: ModelConfig, path: str | Path, quantize: bool = True,
                    shards: int = 1, *, mtp=None, dtype: torch.dtype = torch.bfloat16,
                    exclude_modules: list[str] | None = None,
                    kv_cache_quant_algo: str | None = "FP8",
                    kv_scales: Mapping[int, tuple[float, float]] | None = None) -> Path:
    """Write a checkpoint folder; return its path. ``state_dict_like``: a TP-1 ``{name: tensor}``
    or a ``DeepseekV3ForCausalLM``; ``quantize``: NVFP4 except ``exclude_modules``; ``shards`` > 1
    writes an index; ``kv_scales`` as from :func:`calibrate_kv_scales`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = (dict(state_dict_like) if isinstance(state_dict_like, Mapping)
          else export_state_dict(state_dict_like, mtp))
    if quantize:
        qcfg = QuantConfig(quant_algo="NVFP4", group_size=16,
                           exclude_modules=tuple(exclude_modules or default_exclude_modules(cfg)),
                           kv_cache_quant_algo=kv_cache_quant_algo,
                           producer={"name": "modelopt", "version": "0.29.0"},
                           mtp_layer_id=cfg.num_hidden_layers)
        tensors = _quantize_all(sd, qcfg, dtype)
        (path / "hf_quant_config.json").write_text(json.dumps(qcfg.to_hf_quant_config(), indent=2))
    else:
        tensors = _quantize_all(sd, QuantConfig(exclude_modules=("*",)), dtype)
        (path / "hf_quant_config.json").unlink(missing_ok=True)  # a stale one
    for layer, (ks, vs) in (kv_scales or {}).items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(float(ks))
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(float(vs))
    d = cfg.to_dict()
    d["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(d, indent=2))
    for old in list(path.glob("model*.safetensors")) + list(path.glob("*.index.json")):
        old.unlink()
    _write_shards(tensors, path, shards)
    return path
