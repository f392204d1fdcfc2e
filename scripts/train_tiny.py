"""Train the embedded tiny DeepSeek-V3-architecture model from scratch, quantize it, ship it.

    python scripts/train_tiny.py --out mla_spec/data/tiny-dsv3-fp4            # GPU: a few minutes
    python scripts/train_tiny.py --steps 20 --batch 8 --eval 16 --out /tmp/x  # CPU smoke test

What it does (everything seeded, so the same command gives the same checkpoint on the same
hardware):

1. Data: ``mla_spec.eval.gsm_synth`` training problems (held-out questions are never drawn),
   formatted like few-shot prompts: ``<bos>Question: ...\\nAnswer: ... #### N\\n\\nQuestion: ...``
   packed into ``seq_len`` windows, so the model learns to answer *and* to start the next
   ``Question`` after ``#### N`` (the stop string of the few-shot harness).
2. Tokenizer: the word-level ``tokenizer.json`` of ``mla_spec.eval.tokenizer`` (digits one by one).
3. Model: the package's own ``DeepseekV3ForCausalLM.forward_train`` and
   ``DeepseekV3MTP.forward_train`` (MLA with q_lora, 1 dense + MoE layers, sigmoid noaux_tc
   routing with shared experts, one MTP layer).
   Loss = CE(next token) + ``mtp_lambda`` * (CE(token t+2 from the MTP layer)
   + ``mtp_chain_weight`` * CE(token t+3 from the MTP layer fed its own output: the chained
   draft of EAGLE spec decoding)). DeepSeek-V3's MTP loss is the first MTP term.
4. Aux-loss-free load balancing (DeepSeek-V3 §2.1.2): after every step each router's
   ``e_score_correction_bias[e] += bias_update_speed * sign(mean_load - load[e])``; the bias only
   changes which experts are chosen, never the gate weights, and gets no gradient.
5. Evaluation at full precision: greedy few-shot decoding of held-out questions (dense
   forward, no KV cache) scored by ``mla_spec.eval.run_eval``.
6. Export: ``mla_spec.checkpoint_writer.save_checkpoint(quantize=True)``: NVFP4 dense MLP and
   experts (ModelOpt layout), BF16 attention / router / lm_head / MTP layer, plus
   ``tokenizer.json``, ``training_config.json`` and a model card.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mla_spec.checkpoint_writer import save_checkpoint  # noqa: E402
from mla_spec.config import ModelConfig  # noqa: E402
from mla_spec.eval import (  # noqa: E402
    build_tokenizer,
    format_qa,
    heldout_problems,
    run_eval,
    train_problems,
)
from mla_spec.models.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402
from mla_spec.models.moe import MoEGate  # noqa: E402
from mla_spec.models.mtp import DeepseekV3MTP  # noqa: E402

MODEL_CONFIG = dict(
    vocab_size=128, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
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
    steps: int = 3000
    batch: int = 64
    seq_len: int = 256
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
    eval_questions: int = 256
    eval_every: int = 1000
    k_shots: int = 2
    time_budget_min: float = 0.0  # > 0: after 30 steps, cut `steps` to fit (recorded)


# ---- data ----------------------------------------------------------------------------------
def make_blocks(tok, n: int, seed: int) -> list[list[int]]:
    """Token ids of ``n`` training problems, each ``"Question: ...#### N\\n\\n"`` (no bos)."""
    texts = [format_qa(p) + "\n\n" for p in train_problems(n, seed=seed)]
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def sample_batch(blocks, batch: int, seq_len: int, rng: random.Random, bos: int) -> torch.Tensor:
    """``[batch, seq_len]`` windows: bos, then whole problems back to back (cut at the end)."""
    rows = []
    for _ in range(batch):
        ids = [bos]
        while len(ids) < seq_len:
            ids.extend(blocks[rng.randrange(len(blocks))])
        rows.append(ids[:seq_len])
    return torch.tensor(rows, dtype=torch.int64)


# ---- model ---------------------------------------------------------------------------------
def build_models(cfg: ModelConfig, device, std: float):
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32, device=device)
    mtp = DeepseekV3MTP(cfg, dtype=torch.float32, device=device,
                        embed_tokens=model.embed_tokens, lm_head=model.lm_head)
    n_resid = 2 * (cfg.num_hidden_layers + 1)
    with torch.no_grad():
        for mod in (model, mtp):
            for name, p in mod.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.normal_(0.0, std / math.sqrt(n_resid))
                else:
                    p.normal_(0.0, std)
            for b_name, b in mod.named_buffers():
                if b_name.endswith("e_score_correction_bias"):
                    b.zero_()
    return model, mtp


class LoadBalancer:
    """Counts expert loads through forward hooks; ``update()`` applies the bias rule."""

    def __init__(self, modules, speed: float) -> None:
        self.gates = [m for mod in modules for m in mod.modules() if isinstance(m, MoEGate)]
        self.counts = [None] * len(self.gates)
        self.speed = speed
        for i, g in enumerate(self.gates):
            g.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, out):
            _, ids = out
            c = torch.bincount(ids.flatten(), minlength=module.weight.shape[0]).float()
            self.counts[i] = c if self.counts[i] is None else self.counts[i] + c
        return hook

    @torch.no_grad()
    def update(self) -> float:
        """Apply the sign rule; return the worst max/mean load ratio of this step."""
        worst = 0.0
        for g, c in zip(self.gates, self.counts):
            if c is None:
                continue
            g.e_score_correction_bias.add_(self.speed * torch.sign(c.mean() - c))
            worst = max(worst, float(c.max() / c.mean().clamp_min(1)))
        self.counts = [None] * len(self.gates)
        return worst


def losses(model, mtp, x: torch.Tensor, tc: TrainConfig) -> tuple[torch.Tensor, dict]:
    """Main CE + lambda * (MTP CE(t+2) + chain_weight * MTP-chain CE(t+3))."""
    h = model.forward_train(x)  # [B, T, hidden]
    V = model.cfg.vocab_size
    logits = model.compute_logits(h[:, :-1])
    main = F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))
    m1 = mtp.forward_train(x[:, 1:], h[:, :-1])  # column p predicts x[p + 2]
    l1 = F.cross_entropy(mtp.compute_logits(m1[:, :-1]).reshape(-1, V), x[:, 2:].reshape(-1))
    T = x.shape[1]
    pos2 = torch.arange(1, T - 1, device=x.device)
    m2 = mtp.forward_train(x[:, 2:], m1[:, :-1], positions=pos2)  # column p predicts x[p + 3]
    l2 = F.cross_entropy(mtp.compute_logits(m2[:, :-1]).reshape(-1, V), x[:, 3:].reshape(-1))
    total = main + tc.mtp_lambda * (l1 + tc.mtp_chain_weight * l2)
    return total, {"main": main.item(), "mtp1": l1.item(), "mtp2": l2.item()}


# ---- evaluation (dense greedy decoding) -----------------------------------------------------
def dense_generate_fn(model, tok, device, stop_token: int):
    """``generate(prompts, max_new_tokens, stop)`` for run_eval, recomputing the full prefix."""

    @torch.no_grad()
    def generate(prompts, max_new_tokens, stop):
        enc = [tok.encode(p).ids for p in prompts]
        outs: list[list[int]] = [[] for _ in prompts]
        by_len: dict[int, list[int]] = {}
        for i, ids in enumerate(enc):
            by_len.setdefault(len(ids), []).append(i)
        for _, idx in sorted(by_len.items()):
            seqs = torch.tensor([enc[i] for i in idx], device=device)
            done = torch.zeros(len(idx), dtype=torch.bool, device=device)
            for _ in range(max_new_tokens):
                with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                    h = model.forward_train(seqs)
                nxt = model.compute_logits(h[:, -1]).argmax(-1)
                seqs = torch.cat([seqs, nxt[:, None]], dim=1)
                done |= nxt == stop_token
                if bool(done.all()):
                    break
            for j, i in enumerate(idx):
                outs[i] = seqs[j, len(enc[i]):].tolist()
        return [{"text": tok.decode(o), "output_ids": o} for o in outs]

    return generate


@torch.no_grad()
def mtp_top1(model, mtp, x: torch.Tensor) -> tuple[float, float]:
    """Teacher-forced top-1 accuracy of the MTP layer on t+2 and of the chain on t+3."""
    h = model.forward_train(x)
    m1 = mtp.forward_train(x[:, 1:], h[:, :-1])
    a1 = (mtp.compute_logits(m1[:, :-1]).argmax(-1) == x[:, 2:]).float().mean().item()
    pos2 = torch.arange(1, x.shape[1] - 1, device=x.device)
    m2 = mtp.forward_train(x[:, 2:], m1[:, :-1], positions=pos2)
    a2 = (mtp.compute_logits(m2[:, :-1]).argmax(-1) == x[:, 3:]).float().mean().item()
    return a1, a2


def evaluate(model, tok, device, tc: TrainConfig, n: int):
    model.eval()
    gen = dense_generate_fn(model, tok, device, tok.token_to_id("Question"))
    rep = run_eval(gen, heldout_problems(n), tc.k_shots, name="dense fp32 (training)")
    model.train()
    return rep


# ---- main ----------------------------------------------------------------------------------
def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train(tc: TrainConfig, out: Path, device: torch.device) -> dict:
    torch.manual_seed(tc.seed)
    rng = random.Random(tc.seed)
    t_start = time.perf_counter()
    tok = build_tokenizer(format_qa(p) + "\n\n" for p in train_problems(20_000, seed=tc.seed))
    cfg = ModelConfig(**MODEL_CONFIG)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab {cfg.vocab_size}")
    blocks = make_blocks(tok, tc.num_train_problems, tc.seed + 1)
    bos = tok.token_to_id("<bos>")
    model, mtp = build_models(cfg, device, tc.init_std)
    balancer = LoadBalancer([model, mtp], tc.bias_update_speed)
    params = {id(p): p for m in (model, mtp) for p in m.parameters()}.values()
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )
    n_params = sum(p.numel() for p in params)
    print(f"params {n_params / 1e6:.2f} M, vocab {tok.get_vocab_size()}, device {device}",
          flush=True)
    history, steps_done = [], 0
    t10 = t_start
    for step in range(tc.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        x = sample_batch(blocks, tc.batch, tc.seq_len, rng, bos).to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss, parts = losses(model, mtp, x, tc)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params), tc.grad_clip)
        opt.step()
        imbalance = balancer.update()
        steps_done = step + 1
        if step % 50 == 0 or step == tc.steps - 1:
            el = time.perf_counter() - t_start
            print(f"step {step:5d} loss {loss.item():.4f} main {parts['main']:.4f} "
                  f"mtp1 {parts['mtp1']:.4f} mtp2 {parts['mtp2']:.4f} "
                  f"max/mean load {imbalance:.2f} lr {lr_at(step, tc):.2e} {el:.0f}s", flush=True)
            history.append({"step": step, **parts, "load_imbalance": imbalance})
        if tc.eval_every and step and step % tc.eval_every == 0:
            rep = evaluate(model, tok, device, tc, min(64, tc.eval_questions))
            print(f"  eval@{step}: accuracy {rep.accuracy:.4f}", flush=True)
        if step == 10:
            t10 = time.perf_counter()
        if step == 40 and tc.time_budget_min > 0:
            per_step = (time.perf_counter() - t10) / 30
            fit = int((tc.time_budget_min * 60 - (time.perf_counter() - t_start)) / per_step) + 41
            if fit < tc.steps:
                tc = replace(tc, steps=fit, time_budget_min=0.0)
                print(f"{per_step * 1e3:.1f} ms/step: training {fit} steps to fit the budget "
                      f"(reproduce with --steps {fit})", flush=True)
        if steps_done >= tc.steps:
            break
    train_s = time.perf_counter() - t_start
    rep = evaluate(model, tok, device, tc, tc.eval_questions)
    xb = sample_batch(blocks, 16, tc.seq_len, random.Random(99), bos).to(device)
    a1, a2 = mtp_top1(model, mtp, xb)
    print(rep.pretty(), flush=True)
    print(f"MTP top-1 (teacher forced): t+2 {a1:.4f}, chain t+3 {a2:.4f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    model.cpu()  # quantize on the CPU (same bits wherever it trained); mtp shares embed/head
    mtp.cpu()
    save_checkpoint(model, cfg, out, quantize=True, mtp=mtp, dtype=torch.bfloat16,
                    kv_cache_quant_algo="FP8")
    tok.save(str(out / "tokenizer.json"))
    summary = {
        "train_config": asdict(tc), "model_config": MODEL_CONFIG, "steps_done": steps_done,
        "params": n_params, "train_seconds": round(train_s, 1), "device": str(device),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "heldout_accuracy_fp32_dense": rep.accuracy, "heldout_questions": rep.num_questions,
        "mtp_top1_t2": a1, "mtp_top1_chain_t3": a2, "history": history,
        "command": " ".join(sys.argv),
    }
    (out / "training_config.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "mla_spec/data/tiny-dsv3-fp4")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for f, default in asdict(TrainConfig()).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(default), default=default)
    a = ap.parse_args(argv)
    tc = TrainConfig(**{f: getattr(a, f) for f in asdict(TrainConfig())})
    if a.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    train(tc, a.out, torch.device(a.device))


if __name__ == "__main__":
    main()
