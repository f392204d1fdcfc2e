"""The two training phases of ``scripts/train_tiny.py`` and the model pieces they use.

Phase 1 trains the target and the MTP layer together until the served accuracy reaches the
middle band; phase 2 trains the MTP layer alone (target frozen) until the served accept length
does. Both call ``run.evaluate`` (``train_tiny_eval.Evaluator``) to score the model as shipped.

Load balancing (DeepSeek-V3 §2.1.2): forward hooks count each router's expert loads; after
every step ``e_score_correction_bias[e] += speed * sign(mean_load - load[e])``. The bias only
changes which experts are chosen, never the gate weights, and gets no gradient.
``tc`` is the trainer's ``TrainConfig``.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from train_tiny_eval import Evaluator, band_distance

from mla_spec.models.moe import MoEGate

__all__ = ["LoadBalancer", "Run", "init_weights", "lr_at", "mtp_losses", "mtp_top1", "phase1",
           "phase2", "restore", "sample_batch", "snapshot", "split_decay"]


def init_weights(mod: torch.nn.Module, std: float, n_layers: int) -> None:
    with torch.no_grad():
        for name, p in mod.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / math.sqrt(2 * n_layers))
            else:
                p.normal_(0.0, std)
        for b_name, b in mod.named_buffers():
            if b_name.endswith("e_score_correction_bias"):
                b.zero_()


class LoadBalancer:
    """Counts expert loads through forward hooks; ``update()`` applies the bias rule."""

    def __init__(self, modules, speed: float) -> None:
        self.gates = [m for mod in modules for m in mod.modules() if isinstance(m, MoEGate)]
        self.counts = [None] * len(self.gates)
        self.speed, self.active = speed, True
        self._hooks = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]

    def _hook(self, i: int):
        def hook(module, args, out):
            if self.active:
                c = torch.bincount(out[1].flatten(), minlength=module.weight.shape[0]).float()
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

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def mtp_losses(model, mtp, x, h) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP CE(t+2) and the chained draft's CE(t+3) given the target's hidden ``h``."""
    V = model.cfg.vocab_size
    m1 = mtp.forward_train(x[:, 1:], h[:, :-1])  # column p predicts x[p + 2]
    l1 = F.cross_entropy(mtp.compute_logits(m1[:, :-1]).reshape(-1, V), x[:, 2:].reshape(-1))
    pos2 = torch.arange(1, x.shape[1] - 1, device=x.device)
    m2 = mtp.forward_train(x[:, 2:], m1[:, :-1], positions=pos2)  # column p predicts x[p + 3]
    l2 = F.cross_entropy(mtp.compute_logits(m2[:, :-1]).reshape(-1, V), x[:, 3:].reshape(-1))
    return l1, l2


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


def optimizer(params_decay, params_other, lr: float, wd: float, device) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [{"params": params_decay, "weight_decay": wd},
         {"params": params_other, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def split_decay(mods) -> tuple[list, list]:
    ps = list({id(p): p for m in mods for p in m.parameters()}.values())
    return [p for p in ps if p.dim() >= 2], [p for p in ps if p.dim() < 2]


def snapshot(*mods) -> list[dict]:
    return [{k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()} for m in mods]


def restore(mods, snap) -> None:
    for m, s in zip(mods, snap):
        m.load_state_dict(s)


def sample_batch(blocks, batch: int, seq_len: int, rng: random.Random, bos: int) -> torch.Tensor:
    """``[batch, seq_len]`` windows: bos, then whole problems back to back (cut at the end)."""
    rows = []
    for _ in range(batch):
        ids = [bos]
        while len(ids) < seq_len:
            ids.extend(blocks[rng.randrange(len(blocks))])
        rows.append(ids[:seq_len])
    return torch.tensor(rows, dtype=torch.int64)


def lr_at(step: int, horizon: int, tc) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = min(1.0, (step - tc.warmup) / max(1, horizon - tc.warmup))
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class Run:
    """What both phases share (``tc``: the trainer's ``TrainConfig``)."""

    tc: object
    model: torch.nn.Module
    mtp: torch.nn.Module
    blocks: list
    bos: int
    device: torch.device
    rng: random.Random
    evaluate: Evaluator
    t_start: float
    history: list

    def deadline(self, share: float) -> float:
        return math.inf if self.tc.time_budget_min <= 0 else (
            self.t_start + 60 * self.tc.time_budget_min * share)

    def batch(self) -> torch.Tensor:
        return sample_batch(self.blocks, self.tc.batch, self.tc.seq_len, self.rng,
                            self.bos).to(self.device)

    def autocast(self):
        return torch.autocast(self.device.type, torch.bfloat16,
                              enabled=self.device.type == "cuda")


def phase1(run: Run) -> tuple[dict, list]:
    """Joint training until the accuracy reaches the middle band (or time / steps run out).

    Returns the chosen evaluation row and the snapshot of (model, mtp) it scored.
    """
    tc, model, mtp = run.tc, run.model, run.mtp
    balancer = LoadBalancer([model, mtp], tc.bias_update_speed)
    decay, other = split_decay([model, mtp])
    opt = optimizer(decay, other, tc.lr, tc.weight_decay, run.device)
    params = decay + other
    horizon, every = tc.steps, max(1, tc.eval_every)
    first_eval = min(40, tc.steps) - 1  # early: compiles the serving kernels, times an eval
    deadline, late_deadline = run.deadline(tc.phase1_share), run.deadline(tc.phase1_max_share)
    best_acc = 0.0
    snaps: dict[int, list] = {}
    t10 = time.perf_counter()
    bar = tqdm(total=horizon, desc="phase 1 (joint)", unit="step", mininterval=10)
    row, step = None, -1
    try:
        for step in range(tc.steps):
            lr = lr_at(step, horizon, tc)
            for g in opt.param_groups:
                g["lr"] = lr
            x = run.batch()
            with run.autocast():
                h = model.forward_train(x)
                V = model.cfg.vocab_size
                main = F.cross_entropy(model.compute_logits(h[:, :-1]).reshape(-1, V),
                                       x[:, 1:].reshape(-1))
                l1, l2 = mtp_losses(model, mtp, x, h)
                loss = main + tc.mtp_lambda * (l1 + tc.mtp_chain_weight * l2)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            imbalance = balancer.update()
            bar.update(1)
            if step == 10:
                t10 = time.perf_counter()
            if step % 50 == 0:
                parts = {"main": main.item(), "mtp1": l1.item(), "mtp2": l2.item()}
                run.history.append({"phase": 1, "step": step, **parts, "lr": lr,
                                    "load_imbalance": imbalance})
                bar.set_postfix(loss=f"{parts['main']:.3f}", mtp1=f"{parts['mtp1']:.3f}")
            over = step >= horizon - 1 or time.perf_counter() > deadline
            if over and best_acc < tc.acc_min and time.perf_counter() < late_deadline:
                over = False  # below the band at the planned end: go on at the final rate
            last = over or step == tc.steps - 1
            if step != first_eval and (step + 1) % every and not last:
                continue
            balancer.active = False
            row = run.evaluate(model, mtp, step + 1, 1, lr=lr)
            balancer.active = True
            best_acc = max(best_acc, row["accuracy"])
            snaps[row["index"]] = snapshot(model, mtp)
            nearest = min((r for r in run.evaluate.rows if r["index"] in snaps),
                          key=lambda r: (band_distance(r["accuracy"], None, tc), -r["index"]))
            for k in [k for k in snaps if k < row["index"] - 1 and k != nearest["index"]]:
                del snaps[k]  # kept: the last two and the accuracy nearest the middle band
            if row["accuracy"] >= 0.6:
                every = max(10, tc.eval_every // 2)
            planning = step < horizon - 1 and time.perf_counter() < deadline
            if step > 10 and planning and tc.time_budget_min > 0:  # re-plan the cosine
                horizon = _fit(run, step, horizon, every, t10, deadline)
                bar.total = horizon
            if row["accuracy"] >= tc.acc_mid_min or last:
                break
    finally:
        bar.close()
        balancer.remove()
        run.history.append({"phase": 1, "steps": step + 1, "cosine_horizon": horizon})
    rows1 = [r for r in run.evaluate.rows if r["phase"] == 1]
    chosen = rows1[-1]
    if len(rows1) > 1 and chosen["accuracy"] > tc.acc_max:  # jumped past: maybe one back
        prev = rows1[-2]
        if band_distance(prev["accuracy"], None, tc) < band_distance(chosen["accuracy"], None, tc):
            chosen = prev
    if chosen["accuracy"] < tc.acc_mid_min:  # out of time below the band: the best accuracy
        chosen = min(rows1, key=lambda r: (band_distance(r["accuracy"], None, tc), -r["index"]))
    if chosen["index"] not in snaps:
        chosen = rows1[-1]
    print(f"phase 1: {step + 1} steps; taking evaluation {chosen['index']} (step "
          f"{chosen['step']}, accuracy {chosen['accuracy']:.3f})", flush=True)
    return chosen, snaps[chosen["index"]]


def _fit(run: Run, step: int, horizon: int, every: int, t10: float, deadline: float) -> int:
    """Phase-1 steps that fit before the deadline with evaluations every ``every`` steps, from
    the measured step time and the measured cost of an evaluation (the first one also compiled
    the serving kernels: half of it counts until a second one is timed)."""
    rows = [r for r in run.evaluate.rows if r["phase"] == 1]
    per_step = (time.perf_counter() - t10 - sum(r["seconds"] for r in rows)) / (step - 10)
    warm = [r["seconds"] for r in rows[1:]] or [rows[0]["seconds"] / 2]
    eval_s = sum(warm) / len(warm)
    left = deadline - time.perf_counter()
    fit = step + 1 + int(left / (per_step + eval_s / every))
    fit = max(step + 2, min(run.tc.steps, fit))
    if abs(fit - horizon) > 0.02 * horizon:
        print(f"{per_step * 1e3:.1f} ms/step, evaluation {eval_s:.1f} s every {every} steps: "
              f"phase 1 planned to {fit} steps (cosine horizon; was {horizon})", flush=True)
    return fit


def phase2(run: Run, start: dict) -> None:
    """Train the MTP layer alone (target frozen) until the accept length is in the middle band."""
    tc, model, mtp = run.tc, run.model, run.mtp
    accept = start["accept"] or 0.0
    if tc.accept_mid_min <= accept <= tc.accept_mid_max:
        return
    if accept > tc.accept_mid_max:  # a worse draft: start it again and stop on the way up
        torch.manual_seed(tc.seed + 1)
        init_weights(mtp, tc.init_std, model.cfg.num_hidden_layers + 1)
        print(f"phase 2: accept length {accept:.3f} above the band: MTP layer re-initialized",
              flush=True)
    else:
        print(f"phase 2: accept length {accept:.3f} below the band: training the MTP layer on",
              flush=True)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()  # no dropout anywhere; eval() only keeps the target's routing counts out
    balancer = LoadBalancer([mtp], tc.bias_update_speed)
    decay, other = split_decay([mtp])
    opt = optimizer(decay, other, tc.mtp_lr, tc.weight_decay, run.device)
    lr, every = tc.mtp_lr, max(1, tc.mtp_eval_every)
    deadline = run.deadline(1.0)
    prev = (snapshot(mtp), copy.deepcopy(opt.state_dict()), 0)
    steps = min(tc.mtp_steps, tc.steps)
    bar = tqdm(total=steps, desc="phase 2 (MTP)", unit="step", mininterval=10)
    try:
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (step + 1) / 10)
            x = run.batch()
            with run.autocast():
                # grad stays enabled (the frozen target builds no graph): under no_grad the
                # model would take its inference kernels, which do not train
                h = model.forward_train(x).detach()
                l1, l2 = mtp_losses(model, mtp, x, h)
                loss = l1 + tc.mtp_chain_weight * l2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(decay + other, tc.grad_clip)
            opt.step()
            balancer.update()
            bar.update(1)
            if step % 50 == 0:
                run.history.append({"phase": 2, "step": step, "mtp1": l1.item(),
                                    "mtp2": l2.item(), "lr": lr})
            last = step == steps - 1 or time.perf_counter() > deadline
            if (step + 1) % every and not last:
                continue
            balancer.active = False
            row = run.evaluate(model, mtp, step + 1, 2, lr=lr)
            balancer.active = True
            if tc.accept_mid_min <= (row["accept"] or 0.0) <= tc.accept_mid_max or last:
                break
            if (row["accept"] or 0.0) > tc.accept_mid_max:  # jumped past: back, slower
                restore([mtp], prev[0])
                opt.load_state_dict(prev[1])
                lr, every = lr / 4, max(2, every // 2)
                print(f"phase 2: past the band at step {step + 1}; back to step {prev[2]} at "
                      f"learning rate {lr:.2e}", flush=True)
            else:
                prev = (snapshot(mtp), copy.deepcopy(opt.state_dict()), step + 1)
    finally:
        bar.close()
        balancer.remove()
