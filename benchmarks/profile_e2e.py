"""Where a speculative round's time goes, and where spec and spec off part ways (GPU or CPU).

    python benchmarks/profile_e2e.py [--device cuda] [--batch-sizes 1,32] [--max-new-tokens 64]
        [--specs off,v2] [--deterministic] [--top 18] [--kernels 25] [--no-margins]

Per (spec, batch size), on the embedded model with the FP8 cache and the triton backend (CUDA
graphs on a GPU): decode-only tokens/s (prefill steps left out), ms per step, the GPU ms of its
forwards (CUDA events around each forward: graph replays and eager ones), the host ms left over,
and the host functions that cost most (cProfile over one more generation, ``--top`` rows); on a
GPU also the µs per replay of every captured graph of the batch's bucket, back to back (the
GPU's own time per forward and per whole step), and with ``--kernels`` the top kernels of the
step graphs (torch.profiler).

Then the divergence table: for each batch size and spec, how many sequences differ from spec
off's, the first differing output index, the two tokens, and the top-1 minus top-2 logit margin
of spec off's choice there (a fresh teacher-forced prefill of prompt + common prefix through
``load_model(...).logits``). A margin of a few hundredths means the two runs
rounded differently (different kernels or split counts for the same row); a large margin
would mean a bug.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mla_spec.cli import DEMO_MODEL  # noqa: E402
from mla_spec.config import CacheConfig, SpecConfig  # noqa: E402
from mla_spec.engine import Engine  # noqa: E402
from mla_spec.eval import build_prompts, heldout_problems  # noqa: E402


def make_engine(spec: SpecConfig, bs: int, dev: torch.device, deterministic: bool) -> Engine:
    kw = {"deterministic": True} if deterministic else {}
    return Engine(DEMO_MODEL, spec=spec, device=dev,
                  attention_backend="triton" if dev.type == "cuda" else "torch",
                  cache=CacheConfig(page_size=64 if dev.type == "cuda" else 16,
                                    kv_dtype="fp8_e4m3"),
                  max_reqs=max(bs + 1, 8), max_context_len=2048, **kw)


def profile_one(spec: SpecConfig, bs: int, args, dev) -> dict:
    prompts = build_prompts(heldout_problems(bs), k_shots=2)
    with make_engine(spec, bs, dev, args.deterministic) as eng:
        eng.generate(prompts, max_new_tokens=8)  # warm-up
        eng.metrics.reset()
        res = eng.generate(prompts, max_new_tokens=args.max_new_tokens)
        steps = [s for s in eng.metrics.steps if s.kind != "prefill"]
        secs = sum(s.seconds for s in steps)
        toks = sum(s.new_tokens for s in steps)
        gpu = sum(f.seconds for s in steps for f in s.forwards)
        by_fwd: dict[str, float] = {}
        for s in steps:
            for f in s.forwards:
                k = f"{f.model}:{f.mode.name}{'(g)' if f.graph else ''}"
                by_fwd[k] = by_fwd.get(k, 0.0) + f.seconds
        prof = cProfile.Profile()
        prof.enable()
        eng.generate(prompts, max_new_tokens=args.max_new_tokens)
        prof.disable()
        graphs = graph_times(eng, bs, args.kernels) if dev.type == "cuda" else {}
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    name = spec.version if spec.enabled else "off"
    n = max(len(steps), 1)
    return {"spec": name, "bs": bs, "tok_s": toks / secs if secs else 0.0,
            "step_ms": 1e3 * secs / n, "gpu_ms": 1e3 * gpu / n,
            "host_ms": 1e3 * (secs - gpu) / n, "steps": len(steps),
            "accept": eng.avg_accept_length, "fwd_ms": {k: 1e3 * v / n for k, v in by_fwd.items()},
            "graph_us": graphs,
            "outputs": [r.output_ids for r in res], "prompts": [r.prompt_ids for r in res],
            "profile": s.getvalue()}


@torch.no_grad()
def _replay_us(graph, reps: int = 50) -> float:
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def graph_times(eng, bs: int, kernels: int) -> dict[str, float]:
    """µs per replay of each captured graph of this batch size's bucket, back to back (GPU time,
    no host work between): the per-forward graphs and the whole-step graphs. With ``kernels``,
    the profiler's top kernels inside 20 replays of the step graph."""
    out = {}
    run = eng.runner
    if run.graphs is not None:
        b = run.graphs._bucket(bs)
        for (which, mode, gb), g in run.graphs.graphs.items():
            if gb == b:
                out[f"{which}:{mode.name}"] = _replay_us(g.graph)
    if run.step_graphs is not None:
        b = run.step_graphs._bucket(bs)
        for (kind, gb), g in run.step_graphs.graphs.items():
            if gb == b:
                out[f"step:{kind}"] = _replay_us(g.graph)
                if kernels:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CUDA]) as p:
                        for _ in range(20):
                            g.graph.replay()
                        torch.cuda.synchronize()
                    print(f"-- step graph {kind}, bucket {gb}: kernels of 20 replays")
                    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=kernels))
    return out


def margins(rows: list[dict], dev) -> list[str]:
    from mla_spec.model_api import load_model

    model = load_model(DEMO_MODEL, device=dev)
    off = {r["bs"]: r for r in rows if r["spec"] == "off"}
    lines = ["| bs | spec | differ | first index | off token | spec token | margin "
             "| prefill picks |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = off.get(r["bs"])
        if base is None or r is base:
            continue
        diff = [i for i, (a, b) in enumerate(zip(base["outputs"], r["outputs"])) if a != b]
        if not diff:
            lines.append(f"| {r['bs']} | {r['spec']} | 0 | - | - | - | - | - |")
        for i in diff:
            a, b = base["outputs"][i], r["outputs"][i]
            j = next(k for k in range(min(len(a), len(b)) + 1)
                     if k == min(len(a), len(b)) or a[k] != b[k])
            if j == min(len(a), len(b)):
                lines.append(f"| {r['bs']} | {r['spec']} | seq {i} | {j} | (length) | - | - | - |")
                continue
            ids = torch.tensor([base["prompts"][i] + a[:j]], device=dev)
            logits = model.logits(ids)[0, -1].float()
            top = torch.topk(logits, 2)
            pick = int(top.indices[0])
            margin = float(logits[a[j]] - logits[b[j]])
            lines.append(f"| {r['bs']} | {r['spec']} | seq {i} | {j} | {a[j]} | {b[j]} | "
                         f"{margin:.4f} (top2 gap {float(top.values[0] - top.values[1]):.4f}) | "
                         f"{'off' if pick == a[j] else 'spec' if pick == b[j] else pick} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--specs", default="off,v2")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--kernels", type=int, default=0,
                    help="print the profiler's top N kernels of the step graphs")
    ap.add_argument("--no-margins", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        for name in args.specs.split(","):
            spec = SpecConfig.off() if name == "off" else SpecConfig(version=name)
            r = profile_one(spec, bs, args, dev)
            rows.append(r)
            print(f"\n== spec {r['spec']} bs {bs}: {r['tok_s']:.1f} tok/s decode-only, "
                  f"{r['step_ms']:.3f} ms/step (gpu {r['gpu_ms']:.3f}, host {r['host_ms']:.3f})"
                  f", accept {r['accept']}\n   per step GPU ms by forward: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["fwd_ms"].items()), flush=True)
            print(r["profile"], flush=True)
            print("   graph µs per replay: " + ", ".join(f"{k} {v:.1f}"
                                                    for k, v in r["graph_us"].items()), flush=True)
    off = {r["bs"]: r for r in rows if r["spec"] == "off"}
    print("\n| bs | spec | decode tok/s | vs off | ms/step | GPU ms/step | host ms/step | accept "
          "| same tokens |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = off.get(r["bs"], r)
        print(f"| {r['bs']} | {r['spec']} | {r['tok_s']:.1f} | {r['tok_s'] / b['tok_s']:.2f}x | "
              f"{r['step_ms']:.3f} | {r['gpu_ms']:.3f} | {r['host_ms']:.3f} | "
              f"{r['accept'] or '-'} | {r['outputs'] == b['outputs']} |")
    if not args.no_margins:
        print("\n".join(margins(rows, dev)))


if __name__ == "__main__":
    main()
