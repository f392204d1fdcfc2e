"""Serving-path evaluation, band selection and the model card for ``scripts/train_tiny.py``.

:class:`Evaluator` scores the model as it would ship: it calibrates the FP8 KV scales
(``calibrate_kv_scales``), writes the NVFP4 checkpoint (``save_checkpoint``), serves the
held-out questions through ``Engine`` (TP 1, FP8 KV, MTP speculation v2 with the default 3
steps / topk 1 / 4 draft tokens, greedy, no CUDA graphs) with ``run_eval`` and records a row
``(phase, step, accuracy, accept length, ...)``. It keeps the folder of the best row so far
(:func:`best_row`: inside both bands first, then nearest the middle bands), and
:func:`write_outputs` copies exactly those scored bits to the output folder with
``training_config.json`` and a model card. ``tc`` is the trainer's ``TrainConfig``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mla_spec.checkpoint_writer import calibrate_kv_scales, export_state_dict, save_checkpoint
from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.eval import heldout_problems, run_eval

__all__ = ["Evaluator", "band_distance", "best_row", "in_band", "model_card", "write_outputs"]


# ---- bands ---------------------------------------------------------------------------------
def in_band(acc: float, accept: float | None, tc, mid: bool = False) -> bool:
    lo_a, hi_a = (tc.acc_mid_min, tc.acc_mid_max) if mid else (tc.acc_min, tc.acc_max)
    lo_l, hi_l = (tc.accept_mid_min, tc.accept_mid_max) if mid else (tc.accept_min, tc.accept_max)
    return accept is not None and lo_a <= acc <= hi_a and lo_l <= accept <= hi_l


def band_distance(acc: float, accept: float | None, tc) -> float:
    """0 inside both middle bands; else the gaps, each over its band's width (lower is better)."""
    def gap(x, lo, hi):
        return max(0.0, lo - x, x - hi)
    da = gap(acc, tc.acc_mid_min, tc.acc_mid_max) / (tc.acc_max - tc.acc_min)
    dl = 1.0 if accept is None else gap(accept, tc.accept_mid_min, tc.accept_mid_max) / (
        tc.accept_max - tc.accept_min)
    return da + dl


def best_row(rows: list[dict], tc) -> dict | None:
    """The row to export: inside both bands first, then the smallest band distance, then later."""
    ok = [r for r in rows if r.get("dir")]
    if not ok:
        return None
    return min(ok, key=lambda r: (not in_band(r["accuracy"], r["accept"], tc),
                                  band_distance(r["accuracy"], r["accept"], tc), -r["index"]))


# ---- evaluation through the serving path ----------------------------------------------------
class Evaluator:
    """Write the checkpoint as shipped, serve the held-out questions, keep the best folder."""

    def __init__(self, tc, cfg, tok, calib: torch.Tensor, device, work: Path) -> None:
        self.tc, self.cfg, self.tok, self.calib, self.device = tc, cfg, tok, calib, device
        self.work, self.rows, self.questions = work, [], heldout_problems(tc.eval_questions)
        self.t_eval = 0.0

    def export(self, model, mtp, path: Path) -> dict[int, tuple[float, float]]:
        scales = calibrate_kv_scales(model, mtp, self.calib)
        sd = {k: v.detach().float().cpu() for k, v in export_state_dict(model, mtp).items()}
        save_checkpoint(sd, self.cfg, path, quantize=True, dtype=torch.bfloat16,
                        kv_cache_quant_algo="FP8", kv_scales=scales)
        self.tok.save(str(path / "tokenizer.json"))
        return scales

    def serve(self, path: Path, k_shots: int, n: int | None = None):
        from mla_spec.engine import Engine

        qs = self.questions[:n] if n else self.questions
        eng = Engine(path, tp_size=1, spec=SpecConfig(), cache=CacheConfig(kv_dtype="fp8_e4m3"),
                     attention_backend=self.tc.attention_backend, device=self.device,
                     max_reqs=len(qs), max_context_len=512, cuda_graph=False)
        try:
            return run_eval(eng, qs, k_shots,
                            name=f"fp4 w / fp8 kv / tp1 / spec v2 / {k_shots}-shot")
        finally:
            eng.shutdown()

    def __call__(self, model, mtp, step: int, phase: int, **info) -> dict:
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        mtp.eval()
        path = self.work / f"eval{len(self.rows):03d}"
        scales = self.export(model, mtp, path)
        rep = self.serve(path, self.tc.eval_k_shots)
        model.train(was_training)
        mtp.train(was_training)
        row = dict(index=len(self.rows), phase=phase, step=step, accuracy=rep.accuracy,
                   accept=rep.avg_accept_length, invalid=rep.invalid, dir=str(path),
                   kv_scale_range=[min(s for s, _ in scales.values()),
                                   max(s for s, _ in scales.values())],
                   kv_scales={str(k): v[0] for k, v in scales.items()},
                   seconds=round(time.perf_counter() - t0, 1), **info)
        self.rows.append(row)
        self._prune()
        self.t_eval += time.perf_counter() - t0
        acc_s = "-" if row["accept"] is None else f"{row['accept']:.3f}"
        flag = "mid" if in_band(rep.accuracy, row["accept"], self.tc, True) else (
            "band" if in_band(rep.accuracy, row["accept"], self.tc) else "")
        tqdm.write(f"| {phase} | {step:6d} | {rep.accuracy:.3f} | {acc_s:>6} | "
                   f"{row['seconds']:5.1f} s | {flag:4} |")
        return row

    def _prune(self) -> None:
        """Keep the folders of the best row and of the last two (phase 1 may step back)."""
        keep = {id(best_row(self.rows, self.tc))} | {id(r) for r in self.rows[-2:]}
        for r in self.rows:
            if id(r) not in keep and r.get("dir"):
                shutil.rmtree(r["dir"], ignore_errors=True)
                r["dir"] = None


# ---- export ----------------------------------------------------------------------------------
def write_outputs(run, out: Path, summary: dict) -> dict | None:
    """Copy the chosen evaluated checkpoint to ``out``; write training_config.json and README.

    ``summary`` gains ``exported`` (the chosen row) and ``evaluations`` (every row)."""
    rows = run.evaluate.rows
    best = best_row(rows, run.tc)
    out.mkdir(parents=True, exist_ok=True)
    if best is None:  # nothing was evaluated: write the model as it is (unscored)
        run.evaluate.export(run.model, run.mtp, out)
    else:
        for old in list(out.glob("model*.safetensors")) + list(out.glob("*.index.json")):
            old.unlink()
        for f in Path(best["dir"]).iterdir():
            shutil.copyfile(f, out / f.name)
    public = lambda r: {k: v for k, v in r.items() if k != "dir"}  # noqa: E731
    summary.update(exported=best and public(best), evaluations=[public(r) for r in rows])
    (out / "training_config.json").write_text(json.dumps(summary, indent=2))
    (out / "README.md").write_text(model_card(summary, run.tc))
    return best


def model_card(s: dict, tc) -> str:
    best, mc = s.get("exported"), s["model_config"]
    lines = [
        "# tiny-dsv3-fp4: a small DeepSeek-V3-architecture model in NVIDIA's FP4 layout", "",
        "Trained from scratch by `scripts/train_tiny.py` on `mla_spec.eval.gsm_synth` word "
        "problems (2-4 operations on numbers up to 999, distractor sentences, varied wording, "
        "GSM8K's `#### N` answers). It is not a language model. Its served scores are held in "
        f"bands on purpose (accuracy {tc.acc_min}-{tc.acc_max}, accept length "
        f"{tc.accept_min}-{tc.accept_max} of 4) so that accuracy and accept-length checks see "
        "bugs.", "",
        "## Architecture and layout", "",
        f"{mc['num_hidden_layers']} layers (layer 0 dense, the rest MoE: "
        f"{mc['n_routed_experts']} routed experts top-{mc['num_experts_per_tok']} + "
        f"{mc['n_shared_experts']} shared, noaux_tc) + 1 MTP layer; hidden {mc['hidden_size']}, "
        f"vocabulary {mc['vocab_size']} ({s['tokenizer_tokens']} used, word level, digits one "
        f"by one); MLA with {mc['num_attention_heads']} heads, q_lora {mc['q_lora_rank']}, "
        f"kv_lora {mc['kv_lora_rank']}, rope {mc['qk_rope_head_dim']}; {s['params'] / 1e6:.2f} M "
        "parameters. NVFP4 (ModelOpt layout, `hf_quant_config.json`): dense MLP and experts of "
        "the target layers; BF16: attention, router, embeddings, `lm_head`, the MTP layer.", "",
        "FP8 KV cache scales: per layer `amax / 448` of the cached latent `[ckv | rope(k_pe)]` "
        f"over {tc.calib_windows} training windows of {tc.seq_len} tokens, stored as "
        "`model.layers.{i}.self_attn.k_scale` / `v_scale` (fp32 scalars; the MTP layer at "
        f"i = {mc['num_hidden_layers']})"
        + (f": {', '.join(f'{k}: {v:.5f}' for k, v in best['kv_scales'].items())}." if best
           else "."), "",
        "## Training", "",
        f"Phase 1, target and MTP layer jointly: {s['phase1_steps']} steps of {tc.batch} x "
        f"{tc.seq_len} tokens, AdamW lr {tc.lr} (warmup {tc.warmup}, cosine), loss CE + "
        f"{tc.mtp_lambda} x (MTP CE(t+2) + {tc.mtp_chain_weight} x chained CE(t+3)). Phase 2, the "
        f"MTP layer alone on the frozen target (lr {tc.mtp_lr}): {s['phase2_steps']} steps"
        f"{' (re-initialized first)' if s.get('mtp_reinit') else ''}. "
        f"{s['train_seconds']:.0f} s on {s['gpu'] or s['device']}, torch {s['torch']}, "
        f"{s['date']}.", "",
        "## Scores measured while training", "",
        f"Served as shipped at TP 1 (NVFP4, FP8 KV, MTP spec v2 3 steps / topk 1 / 4 draft "
        f"tokens, greedy, {tc.eval_k_shots}-shot prompts), {tc.eval_questions} held-out "
        "questions, every evaluation (`training_config.json` has them all):", "",
        "| phase | step | accuracy | avg accept length |", "|---|---:|---:|---:|",
    ]
    for r in s["evaluations"]:
        mark = " (exported)" if best and r["index"] == best["index"] else ""
        acc = "-" if r["accept"] is None else f"{r['accept']:.3f}"
        lines.append(f"| {r['phase']} | {r['step']}{mark} | {r['accuracy']:.3f} | {acc} |")
    for k, v in (s.get("final_checks") or {}).items():
        lines += ["", f"Exported checkpoint, {k}: accuracy {v['accuracy']:.3f}, accept length "
                      f"{v['accept']}."]
    lines += ["", f"Command: `{s['command']}`", ""]
    return "\n".join(lines)
