"""Accuracy, accept length and latency of the embedded model across serving configurations.

A configuration, keyed ``fp4/fp8/tp1/v2``: weights (``fp4`` the shipped NVFP4 checkpoint, ``bf16``
its dequantized twin) x KV cache (``bf16`` | ``fp8``) x TP (1 | 4) x speculation (``off`` | ``v1``
| ``v2``: MTP, 3 steps, topk 1, 4 draft tokens). ``pad`` ("end" | "start", v1 at TP 1 only, key
``.../v1/pad-start``) runs v1's ragged DRAFT_EXTEND padded to ``max_q`` rows through the trtllm
backend's torch stand-in kernel. ``run_config`` serves the few-shot questions through the
``Engine``; its ``EvalReport.extra`` holds the configuration, mode table and step timings.

    python -m mla_spec.eval.sweep --questions 500 --config fp4/fp8/tp1/v2 fp4/fp8/tp4/v2 \
        --out eval_cpu.json                     # (GPU or CPU; no --config: the 24-config grid)

``dequantize_checkpoint`` writes the BF16 twin of an NVFP4 checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mla_spec.config import CacheConfig, ModelConfig, SpecConfig
from mla_spec.data import EMBEDDED_MODEL
from mla_spec.eval.gsm_synth import Problem, heldout_problems
from mla_spec.eval.harness import DEFAULT_MAX_NEW_TOKENS, run_eval
from mla_spec.eval.report import EvalReport, format_table

__all__ = ["EMBEDDED_MODEL", "EvalConfig", "config_grid", "dequantize_checkpoint", "run_config",
           "run_sweep"]

@dataclass(frozen=True)
class EvalConfig:
    """One serving configuration of the embedded model."""

    weights: str = "fp4"  # "fp4" | "bf16" (dequantized)
    kv: str = "fp8"  # "bf16" | "fp8"
    tp: int = 1
    spec: str = "v2"  # "off" | "v1" | "v2"
    pad: str | None = None  # v1's draft extend through the fixed-q_len path: "end" | "start"

    @classmethod
    def from_key(cls, key: str) -> EvalConfig:
        """``"fp4/fp8/tp4/v2"`` or ``"fp4/fp8/tp1/v1/pad-start"`` -> the configuration."""
        parts = key.split("/")
        if len(parts) not in (4, 5) or not parts[2].startswith("tp") or (
                len(parts) == 5 and not parts[4].startswith("pad-")):
            raise ValueError(f"config {key!r}: expected WEIGHTS/KV/tpN/SPEC[/pad-ALIGN], e.g. "
                             "fp4/fp8/tp1/v2 or fp4/fp8/tp1/v1/pad-start")
        pad = parts[4][4:] if len(parts) == 5 else None
        return cls(parts[0], parts[1], int(parts[2][2:]), parts[3], pad)

    @property
    def key(self) -> str:
        pad = "" if self.pad is None else f"/pad-{self.pad}"
        return f"{self.weights}/{self.kv}/tp{self.tp}/{self.spec}{pad}"

    def __post_init__(self) -> None:
        if self.weights not in ("fp4", "bf16"):
            raise ValueError(f"weights {self.weights!r}: supported 'fp4', 'bf16'")
        if self.kv not in ("bf16", "fp8"):
            raise ValueError(f"kv {self.kv!r}: supported 'bf16', 'fp8'")
        if self.spec not in ("off", "v1", "v2"):
            raise ValueError(f"spec {self.spec!r}: supported 'off', 'v1', 'v2'")
        if self.pad is not None and (self.pad not in ("end", "start") or self.spec != "v1"
                                     or self.tp != 1):
            raise ValueError(f"pad {self.pad!r} with spec {self.spec} at tp {self.tp}: pad is "
                             "'end' or 'start', for spec v1 at tp 1")

    @property
    def name(self) -> str:
        pad = "" if self.pad is None else f" / pad {self.pad}"
        return f"{self.weights} w / {self.kv} kv / tp{self.tp} / spec {self.spec}{pad}"

    def spec_config(self) -> SpecConfig:
        if self.spec == "off":
            return SpecConfig.off()
        return SpecConfig(num_steps=3, topk=1, num_draft_tokens=4, version=self.spec)

    def cache_config(self, page_size: int = 16) -> CacheConfig:
        return CacheConfig(page_size=32 if self.pad else page_size,  # trtllm: pages of 32 / 64
                           kv_dtype="fp8_e4m3" if self.kv == "fp8" else "bfloat16")


class _FixedQDraftExtend:
    """The draft's attention with v1's ragged DRAFT_EXTEND on the fixed-q_len path (the trtllm
    backend, its torch stand-in kernel, padded with ``align``); every other mode on ``base``."""

    def __init__(self, base, align: str) -> None:
        from mla_spec.attention.trtllm_mla import TRTLLMMLABackend, reference_trtllm_kernel
        self.base = base
        self.fixed = TRTLLMMLABackend(base.num_heads, base.softmax_scale, base.kv_pool,
                                      base.req_to_token, base.device,
                                      kernel=reference_trtllm_kernel, align=align)

    def _pick(self, batch):
        return self.fixed if batch.forward_mode.is_draft_extend() else self.base

    def plan(self, batch):
        return self._pick(batch).plan(batch)

    def forward(self, q_nope, q_pe, layer_id, batch, *, out=None):
        return self._pick(batch).forward(q_nope, q_pe, layer_id, batch, out=out)


def config_grid(tps=(1, 4)) -> list[EvalConfig]:
    """Every weights x kv x tp x spec combination (24 with ``tps=(1, 4)``)."""
    return [EvalConfig(w, kv, tp, s) for w in ("fp4", "bf16") for kv in ("bf16", "fp8")
            for tp in tps for s in ("off", "v1", "v2")]


def dequantize_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write the BF16 twin of an NVFP4 checkpoint folder (same config, tokenizer, names)."""
    from safetensors.torch import load_file

    from mla_spec.checkpoint_writer import save_checkpoint
    from mla_spec.quant.nvfp4 import dequantize_nvfp4
    src, dst = Path(src), Path(dst)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.weight_scale" in tensors:
            t = dequantize_nvfp4(t, tensors[f"{base}.weight_scale"],
                                 tensors[f"{base}.weight_scale_2"].float(), torch.bfloat16)
        out[name] = t
    cfg = ModelConfig.from_hf(src)
    save_checkpoint(out, cfg, dst, quantize=False, dtype=torch.bfloat16)
    for extra in ("tokenizer.json", "training_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    return dst


def run_config(cfg: EvalConfig, questions: list[Problem], *,
               model_path: str | Path = EMBEDDED_MODEL, bf16_path: str | Path | None = None,
               k_shots: int = 1, device: str | None = None, attention_backend: str = "auto",
               max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, engine_kw: dict | None = None
               ) -> EvalReport:
    """Serve ``questions`` with one configuration; ``extra`` holds config, modes, step times."""
    from mla_spec.engine import Engine
    path = model_path if cfg.weights == "fp4" else bf16_path
    if path is None:
        raise ValueError("bf16 weights need bf16_path (see dequantize_checkpoint)")
    # generous collective timeout: CPU ranks on a busy 2-core box take a while to start
    kw = dict(max_reqs=max(len(questions), 1), max_context_len=512, timeout_s=180.0)
    kw.update(engine_kw or {})
    if kw.get("cuda_graph") is False and (device or "cuda").startswith("cpu"):
        kw.pop("cuda_graph")
    eng = Engine(path, tp_size=cfg.tp, spec=cfg.spec_config(), cache=cfg.cache_config(),
                 attention_backend=attention_backend, device=device, **kw)
    try:
        if cfg.pad is not None:
            backends = eng.runner.backends
            backends["draft"] = _FixedQDraftExtend(backends["draft"], cfg.pad)
        rep = run_eval(eng, questions, k_shots, max_new_tokens=max_new_tokens, name=cfg.name)
        m = eng.metrics
        steps = [{"kind": s.kind, "batch_size": s.batch_size, "ms": s.seconds * 1e3,
                  "new_tokens": s.new_tokens} for s in m.steps]
        extra = {"config": asdict(cfg), "modes": m.mode_table(), "steps": steps,
                 "device": str(eng.runner.device), "k_shots": k_shots}
    finally:
        eng.shutdown()
    return EvalReport(**{**asdict(rep), "extra": extra})


def run_sweep(configs: list[EvalConfig], questions: list[Problem], on_report=None,
              **kw) -> list[EvalReport]:
    """``run_config`` for each configuration; ``on_report(reports)`` after each one."""
    reports = []
    for c in configs:
        reports.append(run_config(c, questions, **kw))
        print(format_table(reports[-1:]).splitlines()[-1], flush=True)
        if on_report is not None:
            on_report(reports)
    return reports


def main(argv=None) -> None:
    import datetime
    import sys
    import tempfile
    ap = argparse.ArgumentParser(description="accuracy / accept length / latency sweep")
    ap.add_argument("--model", type=Path, default=EMBEDDED_MODEL)
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--k-shots", type=int, default=2)
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="the grid's TP sizes")
    ap.add_argument("--config", nargs="+", help="keys (fp4/fp8/tp1/v2 ...) instead of the grid")
    ap.add_argument("--device")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    ap.add_argument("--threads", type=int, help="torch intra-op threads")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--section", default="sweep", help="the key of --out to write into: its "
                    "reports of other configurations and the file's other keys are kept")
    ap.add_argument("--no-cuda-graph", action="store_true")
    a = ap.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    qs = heldout_problems(a.questions)
    configs = ([EvalConfig.from_key(k) for k in a.config] if a.config
               else config_grid(tuple(a.tp)))
    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "questions": a.questions, "k_shots": a.k_shots,
            "max_new_tokens": a.max_new_tokens, "attention_backend": a.attention_backend,
            "cuda_graph": torch.cuda.is_available() and not a.no_cuda_graph,
            "threads": torch.get_num_threads(), "date": datetime.date.today().isoformat(),
            "command": "python -m mla_spec.eval.sweep "
                       + " ".join(sys.argv[1:] if argv is None else argv)}
    doc = json.loads(a.out.read_text()) if a.out is not None and a.out.exists() else {}
    kept = [r for r in doc.get(a.section, {}).get("reports", [])
            if r["name"] not in {c.name for c in configs}]
    commands = [*doc.get(a.section, {}).get("meta", {}).get("commands", []), meta["command"]]

    def save(reports):  # after each configuration (predictions and accept lengths, no texts)
        if a.out is not None:
            rows = [{**r.to_dict(details=True), "completions": []} for r in reports]
            doc[a.section] = {"meta": {**meta, "commands": commands}, "reports": kept + rows}
            a.out.write_text(json.dumps(doc))

    engine_kw = {"cuda_graph": False} if a.no_cuda_graph else None
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = (dequantize_checkpoint(a.model, Path(tmp) / "bf16")
                if any(c.weights == "bf16" for c in configs) else None)
        reports = run_sweep(configs, qs, on_report=save, model_path=a.model, bf16_path=bf16,
                            k_shots=a.k_shots, device=a.device, max_new_tokens=a.max_new_tokens,
                            attention_backend=a.attention_backend, engine_kw=engine_kw)
    print(format_table(reports))


if __name__ == "__main__":
    main()
