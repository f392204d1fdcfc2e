"""A *projection* (not a measurement) of DeepSeek-V3 tokens/s per user from per-layer timings.

A target forward is 3 dense + 58 MoE layer times (``benchmarks/bench_layer.py``, one GPU at TP 4
shapes) + the lm_head shard + 2 all-reduces a layer and one logits all-gather (a link of
``benchmarks/collectives.py``). An MTP cycle is TARGET_VERIFY + DRAFT_EXTEND_V2 + ``num_steps - 1``
draft DECODEs and yields ``accept_length`` tokens (bonus included). The method:
``docs/bench_layer.md``, "Projection method".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from collectives import (
    NVLINK4_H200,
    Link,
    LinkSpec,
    MeasuredLink,
    allgather_us,
    allreduce_us,
    load_measured_link,
)

__all__ = [
    "projection_lines", "LinkSpec", "MeasuredLink", "load_measured_link", "ModelShape",
    "ForwardTimes", "Projection", "NVLINK4_H200", "SGLANG_CI_BARS", "allreduce_us",
    "allgather_us", "target_forward_us", "mtp_forward_us", "project_no_mtp", "project_mtp",
    "b200_scaled", "projection_report",
]

#: SGLang's CI bs-1 speed bars (tok/s per user; ``test_bs_1_speed`` on 4 B200s, end to end).
SGLANG_CI_BARS = {"no_mtp": 75.0, "mtp": 150.0}

#: HBM bandwidth (TB/s) from the data sheets: H200 SXM and B200.
H200_HBM_TB_S = 4.8
B200_HBM_TB_S = 8.0


@dataclass(frozen=True)
class ModelShape:
    """What the projection multiplies by (DeepSeek-V3 at TP 4 by default)."""

    num_dense_layers: int = 3
    num_moe_layers: int = 58
    hidden_size: int = 7168
    vocab_size: int = 129280
    tp_size: int = 4
    act_bytes: int = 2  # bf16 activations in the all-reduces
    logit_bytes: int = 2  # bf16 logits in the all-gather
    allreduces_per_layer: int = 2

    @property
    def num_layers(self) -> int:
        return self.num_dense_layers + self.num_moe_layers


@dataclass(frozen=True)
class ForwardTimes:
    """Measured device times (us) of one GPU's pieces at one (bs, q_len, context), without
    collectives: one decoder layer of each kind, final norm + lm_head shard for the sampled rows,
    one MTP forward without the lm_head."""

    moe_layer_us: float
    dense_layer_us: float
    lm_head_us: float
    mtp_layer_us: float = 0.0


@dataclass(frozen=True)
class Projection:
    """One projected operating point. ``step_us`` is a decode step or a whole MTP cycle."""

    label: str
    step_us: float
    tokens_per_step: float
    breakdown: dict

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step * 1e6 / self.step_us

    @property
    def comm_fraction(self) -> float:
        """Share of the step spent in (estimated) collectives."""
        return self.breakdown.get("collectives", 0.0) / self.step_us


def _collectives_us(rows: int, logit_rows: int, num_layers: int, shape: ModelShape,
                    link: Link) -> float:
    ar = allreduce_us(rows * shape.hidden_size * shape.act_bytes, shape.tp_size, link)
    ag = allgather_us(logit_rows * shape.vocab_size * shape.logit_bytes, shape.tp_size, link)
    return num_layers * shape.allreduces_per_layer * ar + ag


def target_forward_us(t: ForwardTimes, rows: int, logit_rows: int,
                      shape: ModelShape = ModelShape(),
                      link: Link = NVLINK4_H200) -> dict[str, float]:
    """One target forward: ``{"layers", "lm_head", "collectives", "total"}`` (us); ``rows`` =
    bs * q_len (all-reduce size), ``logit_rows`` the rows whose logits are gathered."""
    layers = shape.num_dense_layers * t.dense_layer_us + shape.num_moe_layers * t.moe_layer_us
    comm = _collectives_us(rows, logit_rows, shape.num_layers, shape, link)
    return {"layers": layers, "lm_head": t.lm_head_us, "collectives": comm,
            "total": layers + t.lm_head_us + comm}


def mtp_forward_us(mtp_layer_us: float, lm_head_us: float, rows: int, logit_rows: int,
                   shape: ModelShape = ModelShape(),
                   link: Link = NVLINK4_H200) -> dict[str, float]:
    """One forward of the MTP draft layer (+ shared lm_head): same keys as the target's."""
    comm = _collectives_us(rows, logit_rows, 1, shape, link)
    return {"layers": mtp_layer_us, "lm_head": lm_head_us, "collectives": comm,
            "total": mtp_layer_us + lm_head_us + comm}


def _sum(*parts: dict[str, float]) -> dict[str, float]:
    keys = ("layers", "lm_head", "collectives", "total")
    return {k: sum(p[k] for p in parts) for k in keys}


def project_no_mtp(decode: ForwardTimes, bs: int = 1, shape: ModelShape = ModelShape(),
                   link: Link = NVLINK4_H200, overhead_us: float = 0.0) -> Projection:
    """Plain decoding: one target forward per token (``decode`` timed at q_len 1, batch ``bs``)."""
    f = target_forward_us(decode, bs, bs, shape, link)
    f["overhead"] = overhead_us
    f["total"] += overhead_us
    return Projection(f"no MTP, bs {bs}", f["total"], 1.0, f)


def project_mtp(decode: ForwardTimes, verify: ForwardTimes, accept_length: float,
                num_steps: int = 3, bs: int = 1, shape: ModelShape = ModelShape(),
                link: Link = NVLINK4_H200, overhead_us: float = 0.0) -> Projection:
    """MTP speculative decoding (spec v2, topk 1): ``accept_length`` tokens (bonus included) per
    cycle. ``decode``: times at q_len 1 (a DECODE draft step); ``verify``: at q_len ``num_steps +
    1`` (TARGET_VERIFY, the MTP layer in DRAFT_EXTEND_V2)."""
    ndt = num_steps + 1
    if num_steps < 1 or not 1.0 <= accept_length <= ndt:
        raise ValueError(f"accept_length {accept_length} must be in 1..{ndt} "
                         f"(num_steps {num_steps} >= 1)")
    tv = target_forward_us(verify, bs * ndt, bs * ndt, shape, link)
    de = mtp_forward_us(verify.mtp_layer_us, decode.lm_head_us, bs * ndt, bs, shape, link)
    dd = mtp_forward_us(decode.mtp_layer_us, decode.lm_head_us, bs, bs, shape, link)
    steps = [tv, de] + [dd] * (num_steps - 1)
    f = _sum(*steps)
    f.update(verify=tv["total"], draft_extend=de["total"],
             draft_decode=dd["total"] * (num_steps - 1), overhead=overhead_us)
    f["total"] += overhead_us
    return Projection(f"MTP {num_steps} steps, accept {accept_length:g}, bs {bs}", f["total"],
                      float(accept_length), f)


def b200_scaled(t: ForwardTimes, factor: float = H200_HBM_TB_S / B200_HBM_TB_S) -> ForwardTimes:
    """Every time times ``factor`` (default the HBM bandwidth ratio 4.8/8.0): what the same
    kernels would need on a B200 if every piece were memory-bound (crude)."""
    return replace(t, moe_layer_us=t.moe_layer_us * factor,
                   dense_layer_us=t.dense_layer_us * factor,
                   lm_head_us=t.lm_head_us * factor, mtp_layer_us=t.mtp_layer_us * factor)


def projection_lines(decode: ForwardTimes, verify: ForwardTimes | None,
                     accept_lengths=(2.04, 2.5, 3.0), num_steps: int = 3, bs: int = 1,
                     shape: ModelShape = ModelShape(), link: Link = NVLINK4_H200,
                     latency_range=(5.0, 10.0)) -> dict[str, dict]:
    """The projection as data: ``{"no_mtp" | "mtp_accept_<a>": {accept_length, tok_s,
    tok_s_range, step_ms, collectives_pct, b200_scaled_tok_s}}`` (tokens/s per user; the range
    at ``latency_range``'s link latencies, a single point for a ``MeasuredLink``), the format of
    ``mla_spec/data/bench_layer_h200.json``."""
    lo, hi = (link, link) if link.measured else (replace(link, latency_us=v)
                                                 for v in latency_range)

    def line(acc, fn):
        p, plo, phi, b2 = fn(link), fn(hi), fn(lo), fn(link, scaled=True)
        return dict(accept_length=acc, tok_s=round(p.tokens_per_s, 1),
                    tok_s_range=[round(plo.tokens_per_s, 1), round(phi.tokens_per_s, 1)],
                    step_ms=round(p.step_us / 1e3, 2),
                    collectives_pct=round(100 * p.comm_fraction, 1),
                    b200_scaled_tok_s=round(b2.tokens_per_s, 1))

    def no_mtp(lk, scaled=False):
        return project_no_mtp(b200_scaled(decode) if scaled else decode, bs, shape, lk)

    out = {"no_mtp": line(1.0, no_mtp)}
    if verify is not None:
        for acc in accept_lengths:
            def mtp(lk, scaled=False, acc=acc):
                d, v = (b200_scaled(decode), b200_scaled(verify)) if scaled else (decode, verify)
                return project_mtp(d, v, acc, num_steps, bs, shape, lk)
            out[f"mtp_accept_{acc:g}"] = line(float(acc), mtp)
    return out


def projection_report(decode: ForwardTimes, verify: ForwardTimes | None,
                      accept_lengths=(2.04, 2.5, 3.0), num_steps: int = 3, bs: int = 1,
                      shape: ModelShape = ModelShape(), link: Link = NVLINK4_H200,
                      latency_range=(5.0, 10.0)) -> list[str]:
    """Human-readable lines of :func:`projection_lines`, next to SGLang's CI bars."""
    rng = "" if link.measured else f" (range {latency_range[0]:g}-{latency_range[1]:g} us)"
    lines = [f"PROJECTION (not a measurement): DeepSeek-V3, {shape.num_dense_layers} dense + "
             f"{shape.num_moe_layers} MoE layers + lm_head, TP {shape.tp_size}, bs {bs}; "
             f"collectives {link.describe()}{rng}"]
    data = projection_lines(decode, verify, accept_lengths, num_steps, bs, shape, link,
                            latency_range)
    ratios = []
    for key, v in data.items():
        mtp = key != "no_mtp"
        name = f"MTP {num_steps} steps, accept {v['accept_length']:g}" if mtp else "no MTP"
        bar = SGLANG_CI_BARS["mtp" if mtp else "no_mtp"]
        ratios.append(v["tok_s"] / bar)
        lines.append(
            f"  {name:<26} {v['tok_s']:7.1f} tok/s/user [{v['tok_s_range'][0]:.1f}-"
            f"{v['tok_s_range'][1]:.1f}]  step {v['step_ms']:6.2f} ms (collectives "
            f"{v['collectives_pct']:4.1f}%)  SGLang bar {bar:g} on 4xB200: "
            f"{100 * v['tok_s'] / bar:5.1f}%  | B200-bandwidth-scaled "
            f"{v['b200_scaled_tok_s']:.1f}")
    verdict = ("at or above the B200 bars" if min(ratios) >= 1 else
               "below the B200 bars" if max(ratios) < 1 else "around the B200 bars")
    lines.append(
        f"  How close: {verdict} ({', '.join(f'{100 * r:.0f}%' for r in ratios)}). The bars are "
        "end-to-end on 4 B200s (8 TB/s HBM vs the H200's 4.8, FP4 tensor cores, NVLink 5, "
        "trtllm-gen MLA); on the H200 NVFP4 weights are decoded in software (W4A16), and every "
        "forward pays ~123 collective latencies. The projection leaves out host overhead, "
        "sampling and scheduling, so a real server lands below it. The B200-scaled column only "
        "rescales the layer times by 4.8/8.0 (memory-bound assumption).")
    return lines
