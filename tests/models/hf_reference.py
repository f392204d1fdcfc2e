"""Build transformers' DeepseekV3ForCausalLM from our config and checkpoint-named state dict."""

from __future__ import annotations

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
