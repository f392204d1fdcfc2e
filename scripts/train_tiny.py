"""Train the embedded tiny DeepSeek-V3-architecture model, landing its served scores in set bands.

    python scripts/train_tiny.py --out $OUT/tiny-dsv3-fp4                     # one H200, ~8 min
    python scripts/train_tiny.py --steps 20 --batch 8 --seq-len 128 --eval 16 \
        --num-train-problems 20000 --out /tmp/tiny_smoke                     # CPU smoke, ~2 min

The embedded model must be *imperfect* so that accuracy and accept-length checks can see bugs:
served as shipped (NVFP4 weights, FP8 KV cache, MTP speculation v2 with 3 steps / topk 1 / 4 draft
tokens, greedy, the demo's 2-shot prompts), its held-out accuracy must lie in [0.88, 0.97] and
its average accept length in [2.5, 3.4] of 4. The script gets there by measuring, not by
guessing (everything is seeded; how many steps fit the time budget depends on measured times,
and ``training_config.json`` records them with every evaluation):

1. Data: ``mla_spec.eval.gsm_synth`` training problems (held-out questions are never drawn)
   packed into ``<bos>Question: ...#### N\\n\\nQuestion: ...`` windows of ``seq_len`` tokens;
   the word-level tokenizer of ``mla_spec.eval.tokenizer`` (digits one by one).
2. Phase 1, joint training: ``DeepseekV3ForCausalLM.forward_train`` + ``DeepseekV3MTP``.
   Loss = CE(next token) + ``mtp_lambda`` * (CE(t+2) + ``mtp_chain_weight`` * CE(t+3) of the MTP
   layer fed its own output: the chained draft of EAGLE decoding); aux-loss-free balancing
   (after each step ``e_score_correction_bias[e] += speed * sign(mean_load - load[e])``);
   AdamW, warmup then cosine over the steps that fit the time budget.
3. Evaluation through the serving path every ``eval_every`` steps: calibrate the FP8 KV scales,
   quantize and write the checkpoint (``save_checkpoint``), serve ``eval_questions`` held-out
   questions with ``Engine`` + ``run_eval`` in the shipped configuration (TP 1), and print a
   (step, accuracy, accept length) row. Phase 1 ends at the first evaluation whose accuracy
   reaches the middle band (``acc_mid_min``); if it jumped past ``acc_max`` the previous
   evaluation is taken when it is closer to the middle band. The cosine is planned to end at
   ``phase1_share`` of the budget (re-planned at each evaluation from the measured step and
   evaluation times); while the accuracy is still below the band it goes on at the final rate
   up to ``phase1_max_share``.
4. Phase 2, the draft alone (target frozen, so served answers and accuracy stay as they are):
   when the accept length is above the middle band the MTP layer is re-initialized, when below
   it is trained on; it trains by itself (EAGLE-style) with evaluations every
   ``mtp_eval_every`` steps until the accept length is in the middle band. An evaluation that
   jumps past the band restores the previous draft and goes on at a quarter of the rate.
5. Export: the evaluated checkpoint closest to the middle bands (both in band first), exactly
   the bits that were scored, plus ``training_config.json`` (every evaluation row) and a model
   card. Any failure on the way still writes the best checkpoint evaluated so far.

FP8 KV scales: per layer ``amax / 448`` of the cached latent ``[ckv | rope(k_pe)]`` over
calibration windows (``mla_spec.checkpoint_writer.calibrate_kv_scales``), written as
``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (the MTP layer at ``i = num_hidden_layers``);
the loader hands them to the FP8 KV pools.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "scripts"):  # the package, and this script's helper modules
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from train_tiny_eval import Evaluator, in_band, write_outputs  # noqa: E402
from train_tiny_phases import (  # noqa: E402
    Run,
    init_weights,
    mtp_top1,
    phase1,
    phase2,
    restore,
    sample_batch,
    snapshot,
)

from mla_spec.config import ModelConfig  # noqa: E402
from mla_spec.eval import build_tokenizer, format_qa, train_problems  # noqa: E402
from mla_spec.eval.gsm_synth import vocabulary_words  # noqa: E402
from mla_spec.models.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402
from mla_spec.models.mtp import DeepseekV3MTP  # noqa: E402

MODEL_CONFIG = dict(
    vocab_size=192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=4, num_nextn_predict_layers=1, num_attention_heads=4,
    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
    kv_lora_rank=512, q_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
    topk_method="noaux_tc", n_group=4, topk_group=2, num_experts_per_tok=2, moe_layer_freq=1,
    first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid",
    max_position_embeddings=1024, rope_theta=10000.0, rope_scaling=None,
    bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16", tie_word_embeddings=False,
)


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 8000  # phase-1 upper bound; the time budget usually cuts it (recorded)
    batch: int = 128
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup: int = 150
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_lambda: float = 0.3
    mtp_chain_weight: float = 0.5
    bias_update_speed: float = 1e-3
    init_std: float = 0.02
    num_train_problems: int = 200_000
    eval_questions: int = 200
    eval_k_shots: int = 2  # the demo's prompts
    eval_every: int = 100  # phase 1; halved once accuracy passes 0.6
    calib_windows: int = 8
    mtp_lr: float = 2e-3  # phase 2 (a fresh draft has to get there within the budget)
    mtp_steps: int = 600  # phase-2 upper bound (capped at `steps`)
    mtp_eval_every: int = 10
    time_budget_min: float = 7.0  # setup and both phases; 0 = no limit
    phase1_share: float = 0.75  # of the budget, for the cosine plan
    phase1_max_share: float = 0.9  # phase 1 goes on to here while accuracy is below the band
    acc_min: float = 0.88
    acc_max: float = 0.97
    acc_mid_min: float = 0.90
    acc_mid_max: float = 0.95
    accept_min: float = 2.5
    accept_max: float = 3.4
    accept_mid_min: float = 2.7
    accept_mid_max: float = 3.2
    attention_backend: str = "auto"
    resume: str = ""  # a checkpoint folder: its target weights (dequantized), phase 2 only


# ---- data ------------------------------------------------------------------------------------
def make_blocks(tok, n: int, seed: int) -> list[list[int]]:
    """Token ids of ``n`` training problems, each ``"Question: ...#### N\\n\\n"`` (no bos)."""
    texts = [format_qa(p) + "\n\n" for p in train_problems(n, seed=seed)]
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def load_target(model, folder: Path) -> None:
    """Load the target model's weights from a checkpoint folder (NVFP4 weights dequantized)."""
    from safetensors.torch import load_file

    from mla_spec.quant.nvfp4 import dequantize_nvfp4

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    state = model.state_dict()
    for name in state:
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        t = tensors[name]
        if base is not None and f"{base}.weight_scale" in tensors:
            t = dequantize_nvfp4(t, tensors[f"{base}.weight_scale"],
                                 tensors[f"{base}.weight_scale_2"].float(), torch.float32)
        state[name] = t.to(state[name].dtype)
    model.load_state_dict(state)


def train(tc: TrainConfig, out: Path, device: torch.device) -> dict:
    t_start = time.perf_counter()
    torch.manual_seed(tc.seed)
    texts = (format_qa(p) + "\n\n" for p in train_problems(20_000, seed=tc.seed))
    tok = build_tokenizer(texts, words=vocabulary_words())
    cfg = ModelConfig(**MODEL_CONFIG)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab {cfg.vocab_size}")
    blocks = make_blocks(tok, tc.num_train_problems, tc.seed + 1)
    bos = tok.token_to_id("<bos>")
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32, device=device)
    mtp = DeepseekV3MTP(cfg, dtype=torch.float32, device=device,
                        embed_tokens=model.embed_tokens, lm_head=model.lm_head)
    for mod in (model, mtp):
        init_weights(mod, tc.init_std, cfg.num_hidden_layers + 1)
    n_params = sum(p.numel() for p in {id(p): p for m in (model, mtp)
                                       for p in m.parameters()}.values())
    calib = sample_batch(blocks, tc.calib_windows, tc.seq_len, random.Random(99), bos).to(device)
    work = Path(tempfile.mkdtemp(prefix="train_tiny_"))
    run = Run(tc, model, mtp, blocks, bos, device, random.Random(tc.seed),
              Evaluator(tc, cfg, tok, calib, device, work), t_start, [])
    print(f"params {n_params / 1e6:.2f} M, vocabulary {tok.get_vocab_size()} / {cfg.vocab_size}, "
          f"device {device}, {len(blocks)} training problems, setup "
          f"{time.perf_counter() - t_start:.0f} s", flush=True)
    print("| phase | step | accuracy | accept | eval | band |\n|---|---:|---:|---:|---:|---|",
          flush=True)
    summary = {
        "train_config": asdict(tc), "model_config": MODEL_CONFIG, "params": n_params,
        "tokenizer_tokens": tok.get_vocab_size(), "device": str(device),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "command": " ".join(["python", *sys.argv]), "phase1_steps": 0, "phase2_steps": 0,
        "history": run.history,
    }
    error = None
    try:
        if tc.resume:
            load_target(model, Path(tc.resume))
            chosen, snap = run.evaluate(model, mtp, 0, 1, resumed=tc.resume), snapshot(model, mtp)
        else:
            chosen, snap = phase1(run)
        summary["phase1_steps"] = max(r["step"] for r in run.evaluate.rows if r["phase"] == 1)
        restore([model, mtp], snap)
        summary["mtp_reinit"] = (chosen["accept"] or 0) > tc.accept_mid_max
        if not in_band(chosen["accuracy"], chosen["accept"], tc, mid=True):
            phase2(run, chosen)
        summary["phase2_steps"] = max([0] + [r["step"] for r in run.evaluate.rows
                                             if r["phase"] == 2])
        summary["train_seconds"] = time.perf_counter() - t_start
        summary["eval_seconds"] = run.evaluate.t_eval
        xb = sample_batch(blocks, 8, tc.seq_len, random.Random(98), bos).to(device)
        top1 = mtp_top1(model, mtp, xb)  # the state training ended in (maybe not the export)
        summary["mtp_top1_t2_at_end"], summary["mtp_top1_chain_t3_at_end"] = top1
    except BaseException as e:  # noqa: BLE001 - write what we have, then re-raise
        error = e
        summary["error"] = f"{type(e).__name__}: {e}"
        print(f"training stopped: {summary['error']}; writing the best evaluated checkpoint",
              flush=True)
    summary.setdefault("train_seconds", time.perf_counter() - t_start)
    best = write_outputs(run, out, summary)
    if best is not None and error is None:
        checks = {}
        for k in sorted({1, tc.eval_k_shots}):  # the CI test's 1-shot prompts too
            try:
                rep = run.evaluate.serve(out, k)
                checks[f"{k}-shot, {rep.num_questions} questions"] = {
                    "accuracy": rep.accuracy, "accept": rep.avg_accept_length}
            except Exception as e:  # noqa: BLE001 - the checkpoint is written already
                checks[f"{k}-shot"] = {"accuracy": float("nan"), "accept": f"failed: {e}"}
        summary["final_checks"] = checks
        write_outputs(run, out, summary)
    shutil.rmtree(work, ignore_errors=True)
    if best is not None:
        print(f"exported evaluation {best['index']} (phase {best['phase']}, step {best['step']}):"
              f" accuracy {best['accuracy']:.3f}, accept length {best['accept']}, "
              f"{'inside' if in_band(best['accuracy'], best['accept'], tc) else 'OUTSIDE'} the "
              f"bands -> {out}", flush=True)
    if error is not None:
        raise error
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "mla_spec/data/tiny-dsv3-fp4")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for f, default in asdict(TrainConfig()).items():
        names = [f"--{f.replace('_', '-')}"] + (["--eval"] if f == "eval_questions" else [])
        ap.add_argument(*names, dest=f, type=type(default), default=default)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for torch (default 1: on a shared CPU, more threads made "
                         "the serving evaluation ~40x slower)")
    a = ap.parse_args(argv)
    tc = TrainConfig(**{f: getattr(a, f) for f in asdict(TrainConfig())})
    torch.set_num_threads(max(1, a.threads))
    signal.signal(signal.SIGTERM, _terminate)  # a time limit's SIGTERM still writes the best
    train(tc, a.out, torch.device(a.device))


def _terminate(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")


if __name__ == "__main__":
    main()
