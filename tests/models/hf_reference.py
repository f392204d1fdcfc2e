"""transformers' DeepseekV3ForCausalLM from our config and checkpoint-named state dict, and its
greedy generation: the independent reference of the model tests and the accuracy test."""

from __future__ import annotations

from pathlib import Path

import torch


def build_hf_model(cfg, sd):
    """transformers' ``DeepseekV3ForCausalLM`` (fp32, eager) with our state dict loaded.

    transformers stores experts stacked: ``experts.gate_up_proj [E, 2I, h]`` (gate rows first)
    and ``experts.down_proj [E, h, I]``; the MTP layer is not part of its model.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    d = {k: v for k, v in cfg.to_dict().items()
         if k not in ("architectures", "model_type", "torch_dtype")}
    hcfg = DeepseekV3Config(**d)
    hcfg._attn_implementation = "eager"
    hf = DeepseekV3ForCausalLM(hcfg).float().eval()
    n, E = cfg.num_hidden_layers, cfg.n_routed_experts
    hsd = {k: v for k, v in sd.items()
           if not k.startswith(f"model.layers.{n}.") and ".mlp.experts." not in k}
    for L in range(cfg.first_k_dense_replace, n):
        p = f"model.layers.{L}.mlp.experts"
        hsd[p + ".gate_up_proj"] = torch.stack([
            torch.cat([sd[f"{p}.{e}.gate_proj.weight"], sd[f"{p}.{e}.up_proj.weight"]])
            for e in range(E)])
        hsd[p + ".down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(E)])
    hf.load_state_dict(hsd, strict=True)
    return hf


@torch.no_grad()
def hf_argmax(path, seqs: list[list[int]]) -> list[list[int]]:
    """transformers' greedy next token after every prefix of each sequence (teacher forcing, fp32)
    on a plain (BF16) checkpoint folder: ``out[i][j]`` follows ``seqs[i][: j + 1]``. A served
    continuation is transformers' greedy generation iff each of its tokens is the argmax here."""
    from safetensors.torch import load_file

    from mla_spec.config import ModelConfig

    sd = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        sd.update({k: v.float() for k, v in load_file(str(f)).items()
                   if not k.endswith(("k_scale", "v_scale"))})
    hf = build_hf_model(ModelConfig.from_hf(path), sd)
    width = max(len(s) for s in seqs)  # right padding: causal rows never see it
    out = hf(torch.tensor([s + [0] * (width - len(s)) for s in seqs])).logits.argmax(-1)
    return [out[i, : len(s)].tolist() for i, s in enumerate(seqs)]
