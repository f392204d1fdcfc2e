"""One real-size DeepSeek-V3 layer on one GPU at TP-4 shard shapes: decode / verify latency.

What runs (one GPU holds what a TP-4 rank holds; the all-reduces are left out here and
*estimated* in ``benchmarks/projection.py``):

- **target MoE layer** (``DeepseekV3DecoderLayer``): hidden 7168, 32 of 128 heads, q_lora 1536,
  kv_lora 512, 256 routed experts with intermediate 2048 / 4 = 512, top-8, 1 shared expert;
  the KV cache filled to ``ctx`` tokens per request with random rows (pages in random order);
- **dense MLP** of layers 0-2 (intermediate 18432 / 4 = 4608), timed on its own;
- **MTP layer** (``DeepseekV3MTP``: enorm, hnorm, eh_proj, an MoE decoder layer; BF16 weights,
  as in NVIDIA's FP4 checkpoints), with its own one-layer KV pool;
- **lm_head** shard (vocab 129280 / 4, bf16) after the final norm, for the projection.

Two stacks on the same shapes, in the same run:

- ``ours``: experts, shared expert and dense MLP in NVFP4 (random bytes in ModelOpt's layout,
  Triton W4A16 kernels ``fused_moe_nvfp4`` / ``nvfp4_gemm``), attention projections BF16
  (our BF16 GEMV at 1-2 tokens, cuBLAS above), MLA over an FP8 (e4m3) KV cache with our
  Triton backend;
- ``base``: what a Hopper user would otherwise pick: every weight BF16 (cuBLAS for every
  linear; routed experts through ``torch._grouped_mm``, torch's grouped GEMM), FlashInfer MLA
  over a BF16 KV cache. Fused norms, RoPE and router are shared by both stacks.

Modes: DECODE (q 1) and TARGET_VERIFY (q 4) for the target layer, DRAFT_EXTEND_V2 (q 4) and
DECODE for the MTP layer, at batch 1, 8, 32, 128 and context 1k, 8k, 32k. Each piece (whole
layer, attention block, attention kernel alone, MoE, dense MLP, the two RMSNorms) is captured in
its own CUDA graph (static inputs, eager warm-up first) and timed with
``triton.testing.do_bench`` (median, L2 flushed between calls). The run stops starting new
configurations once ``--budget-s`` is spent. At the end it prints the tokens/s *projection*.

Run: ``python benchmarks/bench_layer.py [--quick]`` (H200), ``--cpu-smoke`` (tiny, CPU, no graphs;
the Triton kernels' torch twins run). Results also go to ``$OUT/bench_layer.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import projection as proj  # noqa: E402  (benchmarks/projection.py)

from mla_spec.attention import create_backend  # noqa: E402
from mla_spec.config import ModelConfig  # noqa: E402
from mla_spec.forward_batch import ForwardBatch  # noqa: E402
from mla_spec.forward_mode import ForwardMode  # noqa: E402
from mla_spec.kernels import options  # noqa: E402
from mla_spec.kernels.nvfp4 import fused_moe_nvfp4  # noqa: E402
from mla_spec.kv_cache import MLATokenToKVPool  # noqa: E402
from mla_spec.models.deepseek_v3 import DeepseekV3DecoderLayer  # noqa: E402
from mla_spec.models.moe import (  # noqa: E402
    DenseMLP,
    MoEGate,
    shared_fusion_pays,
)
from mla_spec.models.moe_grouped import grouped_experts_forward  # noqa: E402
from mla_spec.models.mtp import DeepseekV3MTP  # noqa: E402
from mla_spec.models.norm import RMSNorm  # noqa: E402
from mla_spec.models.quant_config import QuantConfig  # noqa: E402
from mla_spec.quant.nvfp4 import NVFP4Tensor  # noqa: E402

TP = 4
NDT = 4  # num_draft_tokens (3 MTP steps, topk 1)
YARN = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
        "beta_slow": 1, "original_max_position_embeddings": 4096}
SMOKE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
             num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, n_group=4,
             topk_group=2, num_experts_per_tok=4, q_lora_rank=64, qk_nope_head_dim=32,
             v_head_dim=32, vocab_size=512)
# NVIDIA's DeepSeek FP4 checkpoints keep attention, lm_head (and the MTP layer) in BF16.
OURS_QUANT = QuantConfig(exclude_modules=("model.layers.*.self_attn*", "lm_head"),
                         kv_cache_quant_algo="FP8")


# ---- weights ------------------------------------------------------------------------------
def _random_nvfp4(lead: tuple, n: int, k: int, device) -> NVFP4Tensor:
    """Random codes, block scales in [0.5, 1], global scale 0.01: weights of rms ~0.02."""
    w = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=device)
    s = torch.empty(*lead, n, k // 16, device=device).uniform_(0.5, 1.0).to(torch.float8_e4m3fn)
    return NVFP4Tensor(w, s, torch.full(lead, 0.01, device=device))


@torch.no_grad()
def _randomize_(module: nn.Module) -> None:
    """Norm weights 1, matrices N(0, 0.02), NVFP4 buffers random in ModelOpt's layout."""
    for p in module.parameters():
        p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)
    for name, b in module.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if b is None or leaf in ("inv_freq",):
            continue
        if b.dtype == torch.uint8:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=b.device))
        elif b.dtype == torch.float8_e4m3fn:
            b.copy_(torch.empty(b.shape, device=b.device).uniform_(0.5, 1.0))
        elif leaf == "weight_scale_2":
            b.fill_(0.01)
        elif leaf == "input_scale":
            b.fill_(1.0)
        elif leaf == "e_score_correction_bias":
            b.normal_(0.0, 0.01)


class BenchMoE(nn.Module):
    """The model's router and shared expert; routed experts stacked for one fused call.

    ``shared_row`` (NVFP4 only): the stacked tensors hold one more expert, run in the fused
    launch as the shared expert (weight 1.0 for every token), as ``DeepseekV3MoE`` does with
    ``FUSE_SHARED_EXPERTS`` (where ``shared_fusion_pays``); the separate shared MLP is then
    skipped.
    """

    def __init__(self, moe: nn.Module, w13, w2, shared_row: bool = False) -> None:
        super().__init__()
        self.gate, self.shared_experts = moe.gate, moe.shared_experts
        self.w13, self.w2 = w13, w2  # NVFP4Tensor (ours) or bf16 [E, 2I, K] / [E, K, I]
        self.shared_row = shared_row  # the stacked tensors' last expert is the shared one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        fused = False
        if isinstance(self.w13, NVFP4Tensor):  # as DeepseekV3MoE: the router appends the column
            fused = self.shared_row and shared_fusion_pays(x.shape[0])
            topk_weights, topk_ids = self.gate(
                x, shared_id=self.w13.weight.shape[0] - 1 if fused else None,
                ids_dtype=torch.int32)
            out = fused_moe_nvfp4(x, topk_ids, topk_weights, self.w13, self.w2)
        else:
            topk_weights, topk_ids = self.gate(x)
            out = grouped_experts_forward(x, topk_weights, topk_ids, self.w13, self.w2)
        if self.shared_experts is not None and not fused:
            out = out + self.shared_experts(x)
        return out.view(shape)  # NOTE: the TP all-reduce is in the projection, not here


class Side:
    """One stack (ours or base): MoE layer, dense MLP, MTP, their KV pools and backends."""

    def __init__(self, name, cfg, *, nvfp4, bf16_experts, embed, lm_head, kv_dtype, attn,
                 r2t, num_pages, page_size, dtype, device, shared_fusion=True):
        self.name = name
        moe_cfg = replace(cfg, first_k_dense_replace=0)
        q = OURS_QUANT if nvfp4 else None
        e, inter, hid = cfg.n_routed_experts, cfg.moe_intermediate_size // TP, cfg.hidden_size
        self.layer = DeepseekV3DecoderLayer(moe_cfg, 0, quant_cfg=q, tp_size=TP, dtype=dtype,
                                            device=device)
        fuse = nvfp4 and shared_fusion and cfg.n_shared_experts == 1
        experts = ((_random_nvfp4((e + fuse,), 2 * inter, hid, device),
                    _random_nvfp4((e + fuse,), hid, inter, device)) if nvfp4 else bf16_experts)
        self.layer.mlp = BenchMoE(self.layer.mlp, *experts, shared_row=fuse)
        _randomize_(self.layer)
        self.dense = DenseMLP(hid, cfg.intermediate_size, prefix="model.layers.0.mlp",
                              quantized=q.is_quantized if q else None, tp_size=TP, dtype=dtype,
                              device=device)
        _randomize_(self.dense)
        self.mtp = DeepseekV3MTP(moe_cfg, tp_size=TP, dtype=dtype, device=device,
                                 embed_tokens=embed, lm_head=lm_head)
        self.mtp.decoder.mlp = BenchMoE(self.mtp.decoder.mlp, *bf16_experts)  # MTP is BF16
        _randomize_(self.mtp)
        h_local = cfg.num_attention_heads // TP
        self.pools, self.backends = {}, {}
        for part in ("target", "mtp"):
            pool = MLATokenToKVPool(1, num_pages, page_size, kv_dtype, device)
            for i in range(0, num_pages, 2048):  # random rows, chunked to bound the temp
                chunk = pool.kv_buffer[0][i:i + 2048]
                chunk.copy_(torch.randn(chunk.shape, dtype=torch.bfloat16, device=device))
            self.pools[part] = pool
            self.backends[part] = create_backend(
                attn, num_heads=h_local, softmax_scale=cfg.softmax_scale, kv_pool=pool,
                req_to_token=r2t, device=device)


def bf16_experts(cfg, dtype, device):
    e, inter, hid = cfg.n_routed_experts, cfg.moe_intermediate_size // TP, cfg.hidden_size
    w13 = torch.randn(e, 2 * inter, hid, dtype=dtype, device=device).mul_(0.02)
    return w13, torch.randn(e, hid, inter, dtype=dtype, device=device).mul_(0.02)


# ---- batches ------------------------------------------------------------------------------
def fill_req_to_token(max_bs: int, max_len: int, page_size: int, device) -> tuple:
    """``req_to_token [max_bs, max_len]``: request b owns its own pages, in random order."""
    per = -(-max_len // page_size)
    perm = torch.randperm(max_bs * per, device=device).view(max_bs, per)
    pos = torch.arange(max_len, device=device)
    r2t = (perm[:, pos // page_size] * page_size + pos % page_size).to(torch.int32)
    return r2t, max_bs * per


def make_batch(mode: ForwardMode, bs: int, ctx: int, r2t, pool, backend, device):
    """A batch of ``bs`` requests with ``ctx`` cached tokens each, wired to pool and backend."""
    q = 1 if mode.is_decode() else NDT
    kw = dict(device=device, req_pool_indices=list(range(bs)),
              out_cache_loc=r2t[:bs, ctx:ctx + q].reshape(-1).long())
    if mode.is_decode():
        b = ForwardBatch.decode([ctx + 1] * bs, **kw)
    elif mode.is_target_verify():
        b = ForwardBatch.target_verify([ctx] * bs, NDT, **kw)
    else:
        b = ForwardBatch.draft_extend_v2([ctx] * bs, NDT, [1 + i % NDT for i in range(bs)], **kw)
    b.token_to_kv_pool, b.attn_backend = pool, backend
    return b


# ---- timing -------------------------------------------------------------------------------
class Timer:
    """Median us of ``fn``: a CUDA graph replayed by ``do_bench`` on GPU, wall clock on CPU."""

    def __init__(self, device, rep_ms: float, graphs: bool = True):
        self.device, self.rep_ms, self.graphs = device, rep_ms, graphs
        self.notes: list[str] = []

    @torch.no_grad()
    def __call__(self, fn, label: str) -> tuple[float, bool]:
        if self.device.type != "cuda":
            fn()  # warm-up, then one timed call: the CPU path only checks that it runs
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6, False
        import triton.testing

        torch.cuda.synchronize()
        side = torch.cuda.Stream()  # warm up (JIT, autotune, allocator) off the capture stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        run, graphed, g = fn, False, None
        if self.graphs:
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                torch.cuda.synchronize()
                run, graphed = g.replay, True
            except Exception as e:  # a host sync or allocation the capture refuses
                torch.cuda.synchronize()
                self.notes.append(f"{label}: graph capture failed, timed eagerly "
                                  f"({type(e).__name__}: {str(e)[:120]})")
        ms = triton.testing.do_bench(run, warmup=max(5, self.rep_ms // 4), rep=self.rep_ms,
                                     return_mode="median")
        del g
        return ms * 1e3, graphed


class _Shims:
    """Process-local patches for a single-GPU run of TP-4 shards (undone on exit).

    - ``tp_all_reduce`` -> identity: there is one GPU; the projection estimates the collectives.
    - ``--cpu-smoke``: ``TRITON_INTERPRET=0`` so the torch twins run (the interpreter is slow).
    """

    def __init__(self, device, smoke: bool):
        self.device, self.smoke, self.saved, self.notes = device, smoke, [], []

    def _set(self, obj, name, value):
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self):
        for mod in [m for k, m in sys.modules.items() if k.startswith("mla_spec")]:
            if hasattr(mod, "tp_all_reduce"):
                self._set(mod, "tp_all_reduce", lambda x, size=None: x)
        self.env = os.environ.get("TRITON_INTERPRET")
        if self.smoke:
            os.environ["TRITON_INTERPRET"] = "0"
        return self

    def __exit__(self, *exc):
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)
        if self.smoke:
            if self.env is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = self.env
        return False


# ---- the grid -------------------------------------------------------------------------------
TARGET_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
MTP_MODES = (ForwardMode.DRAFT_EXTEND_V2, ForwardMode.DECODE)


def _time_into(rec, key, side_name, timer, fn, prepare=None):
    label = f"{side_name} {key[1]} {key[0]}/{key[2]} bs {key[3]} ctx {key[4]}"
    # base = cuBLAS for every BF16 weight: our BF16 GEMV (attention projections) is ours only
    saved, options.BF16_GEMV = options.BF16_GEMV, side_name != "base" and options.BF16_GEMV
    try:
        if prepare is not None:
            prepare()  # plan right before capture: FlashInfer keeps one plan per wrapper
        rec.setdefault(key, {})[side_name] = timer(fn, label)
        out = fn()  # sanity: random weights must still give finite activations
        outs = out if isinstance(out, tuple) else (out,)
        if not all(bool(torch.isfinite(o.float()).all()) for o in outs):
            timer.notes.append(f"{label}: non-finite output")
    except Exception as e:  # keep the run going; the table shows nan
        timer.notes.append(f"{label}: failed ({type(e).__name__}: {str(e)[:160]})")
        rec.setdefault(key, {})[side_name] = (math.nan, False)
    finally:
        options.BF16_GEMV = saved


def _target_pieces(s: Side, b, x, qn, qp, with_mlp: bool) -> dict:
    be, ln1, ln2 = s.backends["target"], s.layer.input_layernorm, s.layer.post_attention_layernorm
    pieces = {"layer": lambda: s.layer(b.positions, x, b),
              "attn": lambda: s.layer.self_attn(b.positions, x, b),
              "attn_kernel": lambda: be.forward(qn, qp, 0, b)}
    if with_mlp:  # these do not depend on the context: timed at the first one only
        pieces.update(moe=lambda: s.layer.mlp(x), dense=lambda: s.dense(x),
                      norms=lambda: (ln1(x), ln2(x)))
    return pieces


def measure(rec, sides, bs, ctx, first_ctx, env, timer):
    """Time every piece of one (bs, ctx) point for both sides into ``rec``."""
    cfg, dev, dt, r2t = env["cfg"], env["device"], env["dtype"], env["r2t"]
    hid, h_loc = cfg.hidden_size, cfg.num_attention_heads // TP
    for mode in TARGET_MODES:
        n = bs * (1 if mode.is_decode() else NDT)
        x = torch.randn(n, hid, dtype=dt, device=dev)
        qn = torch.randn(n, h_loc, cfg.kv_lora_rank, dtype=dt, device=dev)
        qp = torch.randn(n, h_loc, cfg.qk_rope_head_dim, dtype=dt, device=dev)
        for s in sides:
            be = s.backends["target"]
            b = make_batch(mode, bs, ctx, r2t, s.pools["target"], be, dev)
            for part, fn in _target_pieces(s, b, x, qn, qp, first_ctx).items():
                c = ctx if part in ("layer", "attn", "attn_kernel") else None
                _time_into(rec, ("target", mode.name, part, bs, c), s.name, timer, fn,
                           lambda be=be, b=b: be.plan(b))
        if first_ctx:  # final norm + lm_head shard: bf16 on both sides, timed once
            lm, norm, key = env["lm_head"], env["final_norm"], ("lm_head", mode.name, "lm_head",
                                                                bs, None)
            _time_into(rec, key, "ours", timer, lambda x=x, lm=lm, norm=norm: lm(norm(x)))
            rec[key]["base"] = rec[key]["ours"]
    for mode in MTP_MODES:
        n = bs * (1 if mode.is_decode() else NDT)
        x = torch.randn(n, hid, dtype=dt, device=dev)
        ids = torch.randint(0, cfg.vocab_size, (n,), device=dev)
        for s in sides:
            be = s.backends["mtp"]
            b = make_batch(mode, bs, ctx, r2t, s.pools["mtp"], be, dev)
            _time_into(rec, ("mtp", mode.name, "mtp", bs, ctx), s.name, timer,
                       lambda s=s, b=b, x=x, ids=ids: s.mtp(ids, b.positions, x, b),
                       lambda be=be, b=b: be.plan(b))


def rows_from(rec) -> list[dict]:
    rows = []
    for (layer, mode, part, bs, ctx), v in rec.items():
        (o, og), (b, bg) = v.get("ours", (math.nan, False)), v.get("base", (math.nan, False))
        rows.append(dict(layer=layer, mode=mode, part=part, bs=bs, ctx=ctx, ours_us=o,
                         base_us=b, ratio=b / o if o > 0 else math.nan, ours_graph=og,
                         base_graph=bg))
    return rows


def tables(rows, cuda: bool) -> str:
    star = lambda t, g: f"{t:9.1f}{'*' if cuda and not g and t == t else ' '}"
    out = []
    for title, keep in (("Whole layer (target: MoE decoder layer; mtp: the MTP layer)",
                         lambda r: r["part"] in ("layer", "mtp")),
                        ("Breakdown (attn = MLA block incl. projections; attn_kernel = the "
                         "attention kernel alone)", lambda r: r["part"] not in ("layer", "mtp"))):
        out += [f"\n{title}; ratio = base / ours (> 1: ours faster)",
                "| layer | mode | part | bs | ctx | ours us | base us | ratio |",
                "|---|---|---|---|---|---|---|---|"]
        for r in [r for r in rows if keep(r)]:
            ctx = "-" if r["ctx"] is None else r["ctx"]
            out.append(f"| {r['layer']} | {r['mode']} | {r['part']} | {r['bs']} | {ctx} | "
                       f"{star(r['ours_us'], r['ours_graph'])} | "
                       f"{star(r['base_us'], r['base_graph'])} | {r['ratio']:5.2f} |")
    if cuda and any(not r[f"{k}_graph"] and r[f"{k}_us"] == r[f"{k}_us"]
                    for r in rows for k in ("ours", "base")):
        out.append("(* = timed eagerly: the CUDA-graph capture failed; see notes)")
    return "\n".join(out)


STACKS = {"ours": "NVFP4 W4A16 experts/shared/dense + Triton MLA on FP8 KV",
          "base": "BF16 cuBLAS / torch._grouped_mm + FlashInfer MLA on BF16 KV"}


def _projection_model(link) -> dict:
    """What the projection assumes (the shipped ``mla_spec/data/bench_layer_h200.json`` keeps it
    next to the numbers, ``viz.layer`` reads SGLang CI's bars from it)."""
    shape = proj.ModelShape()
    return {"layers": f"{shape.num_dense_layers} dense + {shape.num_moe_layers} MoE + lm_head "
                      "shard", "tp": shape.tp_size, "link": link.describe(),
            "mtp": "spec v2, 3 steps, topk 1, 4 draft tokens",
            "sglang_ci_bars_tok_s": dict(proj.SGLANG_CI_BARS),
            "sglang_ci_bars_hardware": "4x B200, end to end (SGLang CI)"}


def forward_times(rec, side: str, bs: int, ctx: int):
    """(decode, verify) ``ForwardTimes`` for the projection, or None if a piece is missing.

    The dense layer is not run whole: its time is the MoE layer's minus the MoE plus the dense
    MLP (same attention and norms).
    """
    def get(layer, mode, part, c):
        return rec.get((layer, mode, part, bs, c), {}).get(side, (math.nan,))[0]

    out = []
    for mode, mtp_mode in ((ForwardMode.DECODE, ForwardMode.DECODE),
                           (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)):
        m = mode.name
        layer = get("target", m, "layer", ctx)
        dense = max(layer - get("target", m, "moe", None), 0.0) + get("target", m, "dense", None)
        t = proj.ForwardTimes(layer, dense, get("lm_head", m, "lm_head", None),
                              get("mtp", mtp_mode.name, "mtp", ctx))
        if not all(math.isfinite(v) and v > 0 for v in vars(t).values()):
            return None
        out.append(t)
    return tuple(out)


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, no graphs")
    p.add_argument("--quick", action="store_true", help="bs 1,32 x ctx 1k,8k")
    p.add_argument("--bs", default=None, help="comma list (default 1,8,32,128)")
    p.add_argument("--ctx", default=None, help="comma list (default 1024,8192,32768)")
    p.add_argument("--proj-ctx", type=int, default=None, help="context of the projection "
                   "(default: the first --ctx; SGLang CI's bs-1 test runs ~1-2k tokens)")
    p.add_argument("--accept", default="2.04,2.5,3.0", help="MTP accept lengths to project")
    p.add_argument("--link-gbps", type=float, default=450.0, help="NVLink GB/s/direction")
    p.add_argument("--link-latency-us", type=float, default=8.0, help="per collective")
    p.add_argument("--allreduce-json", default=None, help="benchmarks/bench_allreduce.py's JSON: "
                   "project with the measured collectives (CUDA-graph times) instead of the "
                   "estimate")
    p.add_argument("--ours-attn", default=None, help="default triton (GPU) / torch (CPU)")
    p.add_argument("--base-attn", default=None, help="default flashinfer (GPU) / torch (CPU)")
    p.add_argument("--page-size", type=int, default=None, help="default 64 (16 on CPU)")
    p.add_argument("--rep-ms", type=int, default=40, help="do_bench time per piece")
    p.add_argument("--budget-s", type=float, default=180.0,
                   help="start no new (bs, ctx) point after this many seconds")
    p.add_argument("--no-graphs", action="store_true", help="time eagerly")
    p.add_argument("--no-shared-fusion", action="store_true",
                   help="ours runs the shared expert as its own NVFP4 MLP, not in the MoE launch")
    p.add_argument("--torch-router", action="store_true",
                   help="both stacks route with torch ops instead of the fused Triton router")
    return p.parse_args(argv)


def _ints(s, default):
    return [int(v) for v in s.split(",")] if s else default


def _build(args, cfg, device, dtype, bs_list, ctx_list, notes):
    page = args.page_size or (16 if args.cpu_smoke else 64)
    r2t, num_pages = fill_req_to_token(max(bs_list), max(ctx_list) + NDT, page, device)
    hid, vocab_l = cfg.hidden_size, cfg.vocab_size // TP
    embed = nn.Embedding(cfg.vocab_size, hid, dtype=dtype, device=device)
    lm_head = nn.Linear(hid, vocab_l, bias=False, dtype=dtype, device=device)
    _randomize_(embed)
    _randomize_(lm_head)
    experts = bf16_experts(cfg, dtype, device)
    env = dict(cfg=cfg, device=device, dtype=dtype, r2t=r2t, lm_head=lm_head,
               final_norm=RMSNorm(hid, cfg.rms_norm_eps, dtype=dtype, device=device))
    gpu = device.type == "cuda"
    sides = []
    for name, nvfp4, kv_dtype, attn in (
            ("ours", True, torch.float8_e4m3fn, args.ours_attn or ("triton" if gpu else "torch")),
            ("base", False, torch.bfloat16, args.base_attn or ("flashinfer" if gpu else "torch"))):
        kw = dict(nvfp4=nvfp4, bf16_experts=experts, embed=embed, lm_head=lm_head,
                  kv_dtype=kv_dtype, r2t=r2t, num_pages=num_pages, page_size=page,
                  dtype=dtype, device=device, shared_fusion=not args.no_shared_fusion)
        try:
            sides.append(Side(name, cfg, attn=attn, **kw))
        except Exception as e:  # e.g. FlashInfer not importable: say so, keep the run going
            alt = "triton" if gpu else "torch"
            notes.append(f"{name}: attention backend {attn!r} unavailable ({e}); using {alt!r}")
            sides.append(Side(name, cfg, attn=alt, **kw))
    return sides, env


def _versions(device) -> dict:
    v = {"torch": torch.__version__, "device": "cpu"}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        v["device"] = torch.cuda.get_device_name(device)
        try:
            import flashinfer
            v["flashinfer"] = flashinfer.__version__
        except Exception:
            pass
    return v


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_layer needs a CUDA GPU; run with --cpu-smoke on CPU")
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16  # CPU bf16 kernels are very slow
    cfg = ModelConfig(num_hidden_layers=1, rope_scaling=YARN, **(SMOKE if smoke else {}))
    quick = args.quick or smoke
    bs_list = _ints(args.bs, [2] if smoke else [1, 32] if quick else [1, 8, 32, 128])
    ctx_list = _ints(args.ctx, [8] if smoke else [1024, 8192] if quick else [1024, 8192, 32768])
    proj_ctx = args.proj_ctx or ctx_list[0]
    torch.manual_seed(0)
    notes: list[str] = []
    timer = Timer(device, args.rep_ms, graphs=not args.no_graphs)
    rec: dict = {}
    with _Shims(device, smoke) as shims, torch.no_grad():
        notes += shims.notes
        sides, env = _build(args, cfg, device, dtype, bs_list, ctx_list, notes)
        if args.torch_router:  # the router is shared by both stacks, like the norms
            for side in sides:
                for mod in (side.layer, side.mtp):
                    for m in mod.modules():
                        if isinstance(m, MoEGate):
                            m.fused_router = False
            notes.append("--torch-router: both stacks route with torch ops")
        print(f"[{time.perf_counter() - t0:6.1f} s] built: ours "
              f"{type(sides[0].backends['target']).__name__} / base "
              f"{type(sides[1].backends['target']).__name__}", flush=True)
        for i, ctx in enumerate(ctx_list):
            for bs in bs_list:
                if time.perf_counter() - t0 > args.budget_s:
                    notes.append(f"bs {bs} ctx {ctx}: skipped (--budget-s {args.budget_s:g})")
                    continue
                measure(rec, sides, bs, ctx, i == 0, env, timer)
                print(f"[{time.perf_counter() - t0:6.1f} s] bs {bs} ctx {ctx} done", flush=True)
    notes += timer.notes
    rows = rows_from(rec)
    vers = _versions(device)
    head = (f"bench_layer on {vers['device']} (torch {vers['torch']}, triton "
            f"{vers.get('triton', '-')}, flashinfer {vers.get('flashinfer', '-')}): DeepSeek-V3 "
            f"layer at TP {TP} shard shapes, {'wall clock, no graphs' if smoke else 'CUDA graphs'}"
            f", median us. ours = NVFP4 W4A16 + Triton MLA on FP8 KV; base = BF16 cuBLAS / "
            f"grouped GEMM + FlashInfer MLA on BF16 KV")
    text = head + "\n" + tables(rows, device.type == "cuda")
    print(text)
    proj_lines: list[str] = []
    link = proj.LinkSpec("NVLink 4 (H200, estimate)", args.link_gbps, args.link_latency_us)
    if args.allreduce_json:
        measured = proj.load_measured_link(args.allreduce_json)
        if measured.tp_size == TP:
            link = measured
        else:
            notes.append(f"--allreduce-json measured at TP {measured.tp_size}, the projection "
                         f"is TP {TP}: collectives estimated instead")
    comm = "measured" if link.measured else "estimated"
    proj_lines.append(f"collectives: {comm} ({link.describe()})")
    accepts = tuple(float(a) for a in args.accept.split(","))
    projection = {"collectives": comm, "link": link.describe()}
    pbs = 1 if 1 in bs_list else bs_list[0]
    for side in ("ours", "base"):
        ft = forward_times(rec, side, pbs, proj_ctx)
        if ft is None:
            proj_lines.append(f"PROJECTION {side}: missing bs-{pbs} ctx-{proj_ctx} pieces")
            continue
        lines = proj.projection_report(*ft, accept_lengths=accepts, bs=pbs, link=link)
        proj_lines += [f"[{side}: measured layer times at bs {pbs}, ctx {proj_ctx}]"] + lines
        projection[side] = {"bs": pbs, "ctx": proj_ctx, "lines": proj.projection_lines(
            *ft, accept_lengths=accepts, bs=pbs, link=link)}
    print("\n".join(proj_lines))
    for n in notes:
        print("NOTE:", n)
    print(f"total {time.perf_counter() - t0:.1f} s")
    result = dict(
        date=time.strftime("%Y-%m-%d"), device=vers.get("device"), versions=vers,
        command=" ".join(["python benchmarks/bench_layer.py",
                          *(argv if argv is not None else sys.argv[1:])]),
        source="$OUT/bench_layer.json of benchmarks/bench_layer.py",
        units="median microseconds per call, each piece in its own CUDA graph (ours_graph / "
              "base_graph False: timed eagerly)",
        stacks=STACKS, projection_model=_projection_model(link), projection=projection,
        rows=[{**r, "ours_us": round(r["ours_us"], 1), "base_us": round(r["base_us"], 1)}
              for r in rows],
        notes=notes)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench_layer.json").write_text(json.dumps(result, indent=1, default=str))
        (Path(out) / "bench_layer.md").write_text(
            text + "\n\n```\n" + "\n".join(proj_lines + [f"NOTE: {n}" for n in notes]) + "\n```\n")
    return result


if __name__ == "__main__":
    main()
