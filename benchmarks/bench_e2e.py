"""End-to-end tokens/s: spec off vs MTP spec v1 vs v2, at batch 1 and 32 (CPU or GPU).

    python benchmarks/bench_e2e.py [--device cuda] [--tp 1] [--max-new-tokens 64]

The model is the embedded tiny DeepSeek-V3 (``mla_spec/data/tiny-dsv3-fp4``), or a random tiny
checkpoint when it is not installed (then the draft is random and accept lengths are ~1, so
speculation can only cost time). Each configuration generates from the same few-shot prompts
(greedy); the table lists the wall time of a generation (median of ``--repeats`` timed
generations, and their range), the prefill step's share of it (median), output tokens/s
(``decode``: prefill steps left out), the average accept length, and the ratio to spec off at
the same batch size (the peer here is plain greedy decoding in the same run). With ``$OUT`` set,
the table is also written there as JSON and markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from compile_stats import kernel_binaries, kernel_keys, new_compiles

from mla_spec.cli import DEMO_MODEL, random_demo_checkpoint
from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.engine import Engine
from mla_spec.eval import build_prompts, heldout_problems


def run(model: Path, spec: SpecConfig, bs: int, args) -> dict:
    dev = torch.device(args.device)
    backend = args.attention_backend or ("triton" if dev.type == "cuda" else "torch")
    kv = args.kv_dtype
    eng = Engine(model, tp_size=args.tp, spec=spec, attention_backend=backend, device=dev,
                 cache=CacheConfig(page_size=64 if dev.type == "cuda" else 16, kv_dtype=kv),
                 max_reqs=max(bs + 1, 8), max_context_len=2048,
                 cuda_graph=None if dev.type == "cuda" else False)
    prompts = build_prompts(heldout_problems(bs), k_shots=2)
    with eng:
        eng.generate(prompts, max_new_tokens=8)  # warm-up at this batch size (JIT, graphs)
        before, keys_before = kernel_binaries(), kernel_keys()
        walls, decode, prefill = [], [], []
        for _ in range(args.repeats):  # the median of the repeats (short runs are noisy)
            eng.metrics.reset()
            t0 = time.perf_counter()
            res = eng.generate(prompts, max_new_tokens=args.max_new_tokens)
            walls.append(time.perf_counter() - t0)
            dec = [s for s in eng.metrics.steps if s.kind != "prefill"]  # decode steps, rounds
            prefill.append(sum(s.seconds for s in eng.metrics.steps if s.kind == "prefill"))
            decode.append(sum(s.new_tokens for s in dec) / max(sum(s.seconds for s in dec), 1e-9))
        wall, dec_tps = sorted(walls)[len(walls) // 2], sorted(decode)[len(decode) // 2]
        pre = sorted(prefill)[len(prefill) // 2]
        grew = new_compiles(before)
        keys_after = kernel_keys() if grew else {}
        for name in grew:  # what the new binaries were specialized for (why they compiled)
            for key in sorted(keys_after.get(name, set()) - keys_before.get(name, set())):
                print(f"  new binary of {name}: {key[:700]}", flush=True)
            for key in sorted(keys_before.get(name, set()))[:2]:
                print(f"  (earlier binary: {key[:700]})", flush=True)
    n = sum(len(r.output_ids) for r in res)
    graphs = eng.runner.graphs
    return {"spec": spec.version if spec.enabled else "off", "bs": bs, "tokens": n,
            "seconds": wall, "tokens_per_s": n / wall, "decode_tokens_per_s": dec_tps,
            "prefill_ms": 1e3 * pre, "wall_ms_min_max": [1e3 * min(walls), 1e3 * max(walls)],
            "avg_accept": eng.avg_accept_length,
            "graphs": None if graphs is None else (graphs.disabled_reason or "on"),
            "new_compiles": sum(grew.values()), "compiled": sorted(grew),
            "outputs": [r.output_ids for r in res]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed generations (median)")
    ap.add_argument("--kv-dtype", default="fp8_e4m3")
    ap.add_argument("--attention-backend", default=None)
    args = ap.parse_args()
    tmp = None
    model = DEMO_MODEL
    if not (model / "config.json").exists():
        tmp = tempfile.TemporaryDirectory()
        model = random_demo_checkpoint(tmp.name)
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        for spec in (SpecConfig.off(), SpecConfig(version="v1"), SpecConfig(version="v2")):
            rows.append(run(model, spec, bs, args))
            r = rows[-1]
            print(f"done: spec {r['spec']} bs {bs}: {r['tokens_per_s']:.1f} tok/s, "
                  f"{r['new_compiles']} Triton compiles in the timed run {r['compiled']}",
                  flush=True)
    base = {r["bs"]: r for r in rows if r["spec"] == "off"}
    head = ("| device | tp | bs | spec | tokens | ms (min-max) | prefill ms | tok/s | avg accept "
            "| vs off | decode tok/s | decode vs off | same tokens | graphs | compiles |\n"
            + "|---" * 15 + "|")
    lines = [head]
    for r in rows:
        b = base[r["bs"]]
        acc = "-" if r["avg_accept"] is None else f"{r['avg_accept']:.2f}"
        lines.append(
            f"| {args.device} | {args.tp} | {r['bs']} | {r['spec']} | {r['tokens']} | "
            f"{1e3 * r['seconds']:.1f} ({r['wall_ms_min_max'][0]:.1f}-"
            f"{r['wall_ms_min_max'][1]:.1f}) | {r['prefill_ms']:.1f} | "
            f"{r['tokens_per_s']:.1f} | {acc} | "
            f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x | {r['decode_tokens_per_s']:.1f} | "
            f"{r['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x | "
            f"{r['outputs'] == b['outputs']} | "
            f"{r['graphs']} | {r['new_compiles']} |")
    table = "\n".join(lines)
    print(f"model: {model}\n{table}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "bench_e2e.md").write_text(table + "\n")
        Path(out, "bench_e2e.json").write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "outputs"} for r in rows], indent=2))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
