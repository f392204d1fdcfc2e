"""``mla-spec``: the command line (argparse lives here only).

    mla-spec demo [--tp 4] [--spec v2] [--kv-dtype fp8_e4m3] [--num-questions 50] [--json]
    mla-spec generate --model PATH --prompt "Question: ..." [--max-new-tokens 64] [--stop ...]
    mla-spec memory-plan [--tp 4] [--gpu H200] [--kv-dtype fp8_e4m3]

``demo`` serves few-shot questions through the embedded tiny DeepSeek-V3 model at TP 4 with MTP
speculation (v2) over an FP8 KV cache and prints accuracy, accept length, tokens/s and time per
forward mode. Exit codes: 1 if a request ended in error, 2 for refused flags, 130 after Ctrl-C.
At TP > 1 a rank that dies or hangs for --timeout-s ends the run with one line naming it.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

__all__ = ["main", "build_parser", "DEMO_MODEL"]

DEMO_MODEL = Path(__file__).parent / "data" / "tiny-dsv3-fp4"
_KV = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3")


def _attention_backend(spec: str) -> str:
    from mla_spec.attention import get_backend_class
    try:
        if spec != "auto":
            get_backend_class(spec)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def _add_engine_flags(p: argparse.ArgumentParser, *, tp: int, spec: str, kv: str) -> None:
    p.add_argument("--tp", type=int, default=tp, help=f"tensor-parallel ranks (default {tp})")
    p.add_argument("--attention-backend", default="auto", type=_attention_backend,
                   help="auto | torch | triton | flashinfer | trtllm | module.path:ClassName "
                        "(an MLABackend subclass, imported and registered)")
    p.add_argument("--kv-dtype", default=kv, choices=_KV, help=f"KV cache dtype (default {kv})")
    p.add_argument("--spec", default=spec, choices=("off", "v1", "v2"),
                   help=f"MTP speculative decoding (default {spec})")
    p.add_argument("--num-steps", type=int, default=3, help="draft steps (default 3)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="tokens per verify (topk 1: num_steps + 1, the default)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate per prompt, >= 1 (generate: 64; demo: the eval's)")
    p.add_argument("--no-cuda-graph", action="store_true", help="run every forward eagerly")
    p.add_argument("--max-context-len", type=int, default=2048,
                   help="KV positions per request: prompt + max new tokens + a step (default "
                        "2048)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="TP > 1: seconds without progress on any rank before the hung rank is "
                        "named and the run ends (default 30; first step of each kind: "
                        "max(300, 10x))")
    p.add_argument("--no-check-finite", action="store_true",
                   help="skip the NaN / inf scan of the checkpoint at load")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant forwards: at TP 1 speculation gives plain greedy's "
                        "tokens exactly, on the GPU too (slower)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mla-spec", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n")[-1])
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="few-shot questions through the embedded model",
                       epilog=__doc__.split("\n\n")[-1])
    _add_engine_flags(d, tp=4, spec="v2", kv="fp8_e4m3")
    d.add_argument("--model", default=None, help="checkpoint folder (default: embedded model)")
    d.add_argument("--num-questions", type=int, default=50)
    d.add_argument("--k-shots", type=int, default=2)
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    g = sub.add_parser("generate", help="generate from prompts")
    _add_engine_flags(g, tp=1, spec="v2", kv="auto")
    g.add_argument("--model", required=True, help="checkpoint folder")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--json", action="store_true")
    m = sub.add_parser("memory-plan", help="DeepSeek-V3-0324-FP4 memory per GPU")
    m.add_argument("--tp", type=int, default=4)
    m.add_argument("--gpu", default="H200", choices=("H200", "B200"))
    m.add_argument("--kv-dtype", default="fp8_e4m3", choices=_KV)
    m.add_argument("--json", action="store_true")
    return ap


def _spec_config(args, ap):
    from mla_spec.config import SpecConfig
    if args.spec == "off":
        return SpecConfig.off()
    ndt = args.num_steps + 1 if args.num_draft_tokens is None else args.num_draft_tokens
    try:
        return SpecConfig(num_steps=args.num_steps, num_draft_tokens=ndt, version=args.spec)
    except ValueError as e:
        ap.error(f"--num-steps {args.num_steps} --num-draft-tokens {ndt}: {e}")


def _check_numbers(args, ap) -> None:
    """Refuse counts and stop strings that cannot mean anything (before anything starts)."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.max_context_len < 2:
        ap.error(f"--max-context-len {args.max_context_len}: must be >= 2")
    if args.timeout_s is not None and not args.timeout_s > 0:
        ap.error(f"--timeout-s {args.timeout_s}: must be > 0 seconds")
    if getattr(args, "num_questions", 1) < 1:
        ap.error(f"--num-questions {args.num_questions}: must be >= 1")
    if getattr(args, "k_shots", 0) < 0:
        ap.error(f"--k-shots {args.k_shots}: must be >= 0")
    if any(s == "" for s in getattr(args, "stop", None) or ()):
        ap.error("--stop '': an empty stop string would end every prompt at once; "
                 "give non-empty stop strings")


def _device(args, ap) -> torch.device:
    if args.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device not in ("cpu", "cuda"):
        ap.error(f"--device {args.device!r}: use cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible here; use --device cpu")
    return torch.device(args.device)


def _check(args, ap, model: Path, spec) -> torch.device:
    """Refuse impossible combinations before any process starts."""
    from mla_spec.config import ModelConfig
    dev = _device(args, ap)
    if not (model / "config.json").exists():
        ap.error(f"--model {model}: no config.json there (a DeepSeek-V3 checkpoint folder)")
    try:
        cfg = ModelConfig.from_hf(model)
    except ValueError as e:  # a missing key, unreadable JSON
        ap.error(f"--model {model}: {e}")
    if args.tp < 1 or cfg.num_attention_heads % args.tp:
        ok = [t for t in range(1, cfg.num_attention_heads + 1) if cfg.num_attention_heads % t == 0]
        ap.error(f"--tp {args.tp}: must divide the {cfg.num_attention_heads} attention heads; "
                 f"use one of {ok}")
    if dev.type == "cuda" and args.tp > torch.cuda.device_count():
        ap.error(f"--tp {args.tp} on cuda needs {args.tp} GPUs, {torch.cuda.device_count()} "
                 "visible; lower --tp or use --device cpu (gloo ranks)")
    if spec.enabled and cfg.num_nextn_predict_layers < 1:
        ap.error("--spec: the checkpoint has no MTP layer (num_nextn_predict_layers 0); "
                 "use --spec off")
    if args.page_size < 1:
        ap.error(f"--page-size {args.page_size}: must be >= 1")
    if args.attention_backend == "trtllm" and args.page_size not in (32, 64):
        ap.error(f"--attention-backend trtllm needs --page-size 32 or 64 (got {args.page_size})")
    if args.attention_backend != "auto":
        from mla_spec.attention import backends_for_device
        reasons = backends_for_device(dev)
        why = reasons.get(args.attention_backend)
        if why is not None:
            able = [n for n, r in reasons.items() if r is None]
            ap.error(f"--attention-backend {args.attention_backend} cannot run on {dev}: {why}; "
                     f"backends that can: {', '.join(['auto', *able])}")
    return dev


def _engine(args, model: Path, spec, dev):
    from mla_spec.config import CacheConfig
    from mla_spec.engine import Engine
    # A command-line run is disposable: if a rank dies and rank 0 stays blocked in the GPU
    # (NCCL cannot abort a communicator that captured CUDA graphs hold), exit 15 s later.
    os.environ.setdefault("MLA_SPEC_HARD_EXIT_S", "15")
    return Engine(model, tp_size=args.tp, spec=spec,
                  cache=CacheConfig(page_size=args.page_size, kv_dtype=args.kv_dtype),
                  attention_backend=args.attention_backend, device=dev,
                  cuda_graph=False if args.no_cuda_graph or dev.type == "cpu" else None,
                  max_context_len=args.max_context_len, timeout_s=args.timeout_s,
                  check_finite=not args.no_check_finite, deterministic=args.deterministic)


def random_demo_checkpoint(path: str | Path) -> Path:
    """A random tiny checkpoint (NVFP4 layout) with the task's tokenizer: the demo's stand-in
    until the embedded model is installed. Its answers are noise; the pipeline is the real one."""
    from mla_spec.checkpoint_writer import random_state_dict, save_checkpoint, tiny_config
    from mla_spec.eval import build_tokenizer, format_qa, train_problems
    tok = build_tokenizer([format_qa(p) for p in train_problems(300)], vocab_size=256)
    cfg = tiny_config(vocab_size=256)
    path = save_checkpoint(random_state_dict(cfg, seed=0), cfg, path, quantize=True)
    tok.save(str(Path(path) / "tokenizer.json"))
    return Path(path)


def demo_report(engine, report) -> dict:
    """The demo's report: eval results plus engine metrics (what ``--json`` prints)."""
    m = engine.metrics
    return {
        "model": str(engine.model_path) if getattr(engine, "model_path", None) else None,
        "tp_size": engine.tp_size, "spec": engine.spec.version if engine.spec.enabled else "off",
        "kv_dtype": engine.cache.kv_dtype, "num_questions": report.num_questions,
        "accuracy": report.accuracy, "invalid": report.invalid,
        "avg_accept_length": m.avg_accept_length, "output_tokens": m.generated_tokens,
        "tokens_per_s": m.tokens_per_s, "wall_seconds": m.wall_seconds,
        "modes": m.mode_table(),
    }


def format_demo_report(rep: dict) -> str:
    from mla_spec.metrics import format_mode_table
    acc = rep["avg_accept_length"]
    lines = [
        f"model {rep['model']}  tp {rep['tp_size']}  spec {rep['spec']}  kv {rep['kv_dtype']}",
        f"accuracy            {rep['accuracy']:.3f}  ({rep['num_questions']} questions, "
        f"{rep['invalid']:.1%} invalid)",
        f"avg accept length   {acc:.3f}" if acc is not None else
        f"avg accept length   - ({'spec off' if rep['spec'] == 'off' else 'no round ran'})",
        f"output tokens       {rep['output_tokens']}",
        f"tokens/s            {rep['tokens_per_s']:.1f}",
        "",
        format_mode_table(rep["modes"]),
    ]
    return "\n".join(lines + _error_lines(rep.get("errors") or [], rep["num_questions"]))


def _error_lines(errors: list[dict], n: int) -> list[str]:
    return [f"{len(errors)} of {n} requests ended in error; request {e['request']}: "
            f"[{e['finished_reason']}] {e['error']}"
            + (" (the prompts grow with --k-shots)" if "prompt" in e["error"] else "")
            for e in errors[:1]]


def _demo(args, ap) -> int:
    from mla_spec.eval import heldout_problems, run_eval
    _check_numbers(args, ap)
    spec = _spec_config(args, ap)
    tmp = None
    model = Path(args.model) if args.model else DEMO_MODEL
    if args.model is None and not (DEMO_MODEL / "config.json").exists():
        tmp = tempfile.TemporaryDirectory(prefix="mla_spec_demo_")
        model = random_demo_checkpoint(tmp.name)
        print(f"(embedded model not installed: using a random checkpoint at {model})",
              file=sys.stderr)
    dev = _check(args, ap, model, spec)
    kw = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    errors: list[dict] = []
    with _engine(args, model, spec, dev) as engine:
        def gen(prompts, max_new_tokens, stop):
            res = engine.generate(prompts, max_new_tokens, stop, progress=not args.json)
            errors.extend(_errors(res))
            return res

        report = run_eval(gen, heldout_problems(args.num_questions), args.k_shots, **kw)
        rep = dict(demo_report(engine, report), errors=errors)
    print(json.dumps(rep, indent=2) if args.json else format_demo_report(rep))
    if tmp is not None:
        tmp.cleanup()
    return 1 if errors else 0


def _errors(results) -> list[dict]:
    """Each failed request's error, its advice in flag names (the engine's are parameters)."""
    flags = lambda t: t.replace("max_new_tokens", "--max-new-tokens").replace(  # noqa: E731
        "max_context_len", "--max-context-len")
    return [{"request": i, "finished_reason": r.finished_reason, "error": flags(r.error)}
            for i, r in enumerate(results) if r.error is not None]


def _generate(args, ap) -> int:
    _check_numbers(args, ap)
    spec = _spec_config(args, ap)
    model = Path(args.model)
    dev = _check(args, ap, model, spec)
    with _engine(args, model, spec, dev) as engine:
        if engine.tokenizer is None:
            ap.error(f"--model {model}: no tokenizer.json there, so text prompts cannot be encoded")
        max_new = 64 if args.max_new_tokens is None else args.max_new_tokens
        res = engine.generate(args.prompt, max_new, args.stop)
        summary = engine.metrics.summary()
    if args.json:
        errs = {e["request"]: e["error"] for e in _errors(res)}
        print(json.dumps({"results": [{"text": r.text, "output_ids": r.output_ids,
                                       "finished_reason": r.finished_reason, "error": errs.get(i),
                                       "accept_lengths": r.accept_lengths}
                                      for i, r in enumerate(res)],
                          "metrics": summary}, indent=2))
    else:
        for p, r in zip(args.prompt, res):
            print(f"--- {p!r}\n{r.text}  [{r.finished_reason}, {len(r.output_ids)} tokens]")
        for e in _errors(res):
            print(f"error (prompt {e['request']}): {e['error']}", file=sys.stderr)
        acc = summary["avg_accept_length"]
        print(f"tokens/s {summary['tokens_per_s']:.1f}"
              + (f"  avg accept length {acc:.3f}" if acc else ""))
    return 1 if _errors(res) else 0


def _memory_plan(args, ap) -> int:
    from dataclasses import asdict

    from mla_spec.memory_plan import memory_plan
    if args.kv_dtype == "auto":
        args.kv_dtype = "fp8_e4m3"
    try:
        plan = memory_plan(tp=args.tp, gpu=args.gpu, kv_dtype=args.kv_dtype)
    except ValueError as e:
        ap.error(str(e))
    if args.json:
        d = asdict(plan)
        d.update(weights_total=plan.weights_total, kv_budget_bytes=plan.kv_budget_bytes,
                 max_tokens=plan.max_tokens)
        print(json.dumps(d, indent=2))
    else:
        print(plan.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    from mla_spec.loader import CheckpointError
    from mla_spec.runtime.workers import RankFailedError
    ap = build_parser()
    args = ap.parse_args(argv)
    run = {"demo": _demo, "generate": _generate}.get(args.command, _memory_plan)
    try:
        return run(args, ap)
    except KeyboardInterrupt:
        print("mla-spec: interrupted", file=sys.stderr)
        return 130
    except (RankFailedError, CheckpointError) as e:
        print(f"mla-spec: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
