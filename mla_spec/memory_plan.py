"""Memory plan for serving DeepSeek-V3 FP4 with this package: weights per GPU, KV bytes, tokens.

Parameters are counted from the config and stored as ``mla_spec.models`` stores them (NVFP4
MLPs and experts, the rest bf16, split over TP where the model splits). The latent KV cache is
replicated: tokens = ``(mem_fraction * gpu_memory - weights) / kv_bytes_per_token``.
"""

from dataclasses import dataclass

from mla_spec.config import ModelConfig

__all__ = ["GPU_MEMORY_BYTES", "MemoryPlan", "param_counts", "memory_plan"]

# Total device memory as nvidia-smi reports it (MiB * 2**20).
GPU_MEMORY_BYTES = {"H200": 143771 * 2**20, "B200": 183359 * 2**20}
_KV_BYTES = {"fp8_e4m3": 1, "bfloat16": 2, "bf16": 2, "float16": 2, "auto": 2, "float32": 4}
_NVFP4_BYTES = 0.5 + 1 / 16  # packed E2M1 + one e4m3 scale per 16 weights


def _attn(cfg: ModelConfig) -> tuple[int, int]:
    """(replicated, head-split) parameters of one MLA layer."""
    h, H = cfg.hidden_size, cfg.num_attention_heads
    rep = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    split = H * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
    split += H * cfg.v_head_dim * h
    if cfg.q_lora_rank:
        rep += h * cfg.q_lora_rank + cfg.q_lora_rank
        split += cfg.q_lora_rank * H * cfg.qk_head_dim
    else:
        split += h * H * cfg.qk_head_dim
    return rep, split


def param_counts(cfg: ModelConfig | None = None) -> dict[str, int]:
    """Parameters by kind (whole model, no TP); ``mtp_layer`` as stored (with its embedding and
    head copies), ``mtp_unique`` without them."""
    cfg = cfg or ModelConfig()
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(L))
    dense_layers = L - moe_layers
    rep, split = _attn(cfg)
    expert = 3 * h * cfg.moe_intermediate_size
    c = {"attention": L * (rep + split), "dense_mlp": dense_layers * 3 * h * cfg.intermediate_size,
         "routed_experts": moe_layers * cfg.n_routed_experts * expert,
         "shared_experts": moe_layers * cfg.n_shared_experts * expert,
         "router": moe_layers * cfg.n_routed_experts * (h + 1), "norms": L * 2 * h + h,
         "embed_tokens": cfg.vocab_size * h,
         "lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * h}
    c["target_total"] = sum(c.values())
    mtp_layer = rep + split + 2 * h + cfg.n_routed_experts * (expert + h + 1)
    mtp_layer += cfg.n_shared_experts * expert + 2 * h * h + 3 * h
    c["mtp_unique"] = mtp_layer * cfg.num_nextn_predict_layers
    c["mtp_layer"] = c["mtp_unique"] + cfg.num_nextn_predict_layers * 2 * cfg.vocab_size * h
    return c


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU bytes by kind, KV bytes per token, and how many tokens fit."""

    gpu: str
    tp: int
    kv_dtype: str
    gpu_bytes: int
    mem_fraction: float
    weight_bytes: dict
    kv_bytes_per_token: int
    params: dict

    @property
    def _draft_kv(self) -> int:
        return self.params["_draft_kv"]

    @property
    def weights_total(self) -> float:
        return sum(self.weight_bytes.values())

    @property
    def kv_budget_bytes(self) -> float:
        return self.mem_fraction * self.gpu_bytes - self.weights_total

    @property
    def max_tokens(self) -> int:
        return max(0, int(self.kv_budget_bytes // self.kv_bytes_per_token))

    def table(self) -> str:
        """A printable table (GB = 1e9 bytes), as ``mla-spec memory-plan`` prints it."""
        w = max(len(k) for k in self.weight_bytes) + 2
        lines = [f"DeepSeek-V3 FP4 memory plan: {self.gpu} x TP{self.tp}, KV {self.kv_dtype}, "
                 f"mem_fraction {self.mem_fraction}",
                 f"params: target {self.params['target_total'] / 1e9:.2f} B + MTP "
                 f"{self.params['mtp_layer'] / 1e9:.2f} B", f"{'kind':<{w}}{'GB per GPU':>12}"]
        lines += [f"{k:<{w}}{v / 1e9:>12.3f}" for k, v in self.weight_bytes.items()]
        lines += [f"{'weights total':<{w}}{self.weights_total / 1e9:>12.3f}",
                  f"{'GPU memory':<{w}}{self.gpu_bytes / 1e9:>12.3f}",
                  f"{'KV budget':<{w}}{self.kv_budget_bytes / 1e9:>12.3f}",
                  f"KV bytes per token: {self.kv_bytes_per_token} (target "
                  f"{self.kv_bytes_per_token - self._draft_kv} + MTP draft {self._draft_kv})",
                  f"tokens that fit per GPU: {self.max_tokens:,}"]
        return "\n".join(lines)


def memory_plan(cfg: ModelConfig | None = None, tp: int = 4, gpu: str = "H200",
                kv_dtype: str = "fp8_e4m3", mem_fraction: float = 0.88,
                gpu_bytes: int | None = None) -> MemoryPlan:
    """Plan one GPU of a TP group."""
    cfg = cfg or ModelConfig()
    if gpu not in GPU_MEMORY_BYTES and gpu_bytes is None:
        raise ValueError(f"gpu {gpu!r}: supported {', '.join(GPU_MEMORY_BYTES)}")
    if kv_dtype not in _KV_BYTES:
        raise ValueError(f"kv_dtype {kv_dtype!r}: supported {', '.join(_KV_BYTES)}")
    if tp < 1 or cfg.num_attention_heads % tp:
        raise ValueError(f"tp {tp}: must divide num_attention_heads {cfg.num_attention_heads}")
    c = dict(param_counts(cfg))
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    rep, split = _attn(cfg)
    expert = 3 * h * cfg.moe_intermediate_size
    mtp_attn = rep + split / tp
    mtp_moe = (cfg.n_routed_experts + cfg.n_shared_experts) * expert / tp
    mtp_rest = cfg.n_routed_experts * (h + 1) * 2 + (2 * h * h + 5 * h)
    vocab_split = tp if cfg.vocab_size % tp == 0 else 1  # mla_spec.models.vocab_parallel
    wb = {
        "attention (bf16)": L * (rep + split / tp) * 2,
        "dense MLP (nvfp4)": c["dense_mlp"] / tp * _NVFP4_BYTES,
        "routed experts (nvfp4)": c["routed_experts"] / tp * _NVFP4_BYTES,
        "shared experts (nvfp4)": c["shared_experts"] / tp * _NVFP4_BYTES,
        "router (fp32)": c["router"] * 4,
        "norms (bf16)": c["norms"] * 2,
        "embed_tokens (bf16)": c["embed_tokens"] * 2 / vocab_split,
        "lm_head (bf16)": c["lm_head"] * 2 / vocab_split,
        "MTP layer (bf16)": cfg.num_nextn_predict_layers * (mtp_attn + mtp_moe) * 2 + mtp_rest * 2
        if cfg.num_nextn_predict_layers else 0,
    }
    row = cfg.kv_cache_dim * _KV_BYTES[kv_dtype]
    draft = row * cfg.num_nextn_predict_layers
    c["_draft_kv"] = draft
    return MemoryPlan(gpu, tp, kv_dtype, gpu_bytes or GPU_MEMORY_BYTES[gpu], mem_fraction, wb,
                      L * row + draft, c)
