"""Notebook 06's views of a :class:`~mla_spec.pipeline.PipelineStepper`, and its widget panel.

``phase_html`` draws what a phase did: per request the rows and KV length of every forward, the
KV pages it holds, its text with the round's draft tokens (accepted ones highlighted) and its
accept lengths; per rank the shapes its heads see; the milliseconds per forward. ``PipelinePanel``
builds a batch from widgets (prompts or held-out questions, TP, spec, steps, KV dtype, backend)
and steps it with one button per phase.
"""

import html
from collections import defaultdict

import torch

from mla_spec.pipeline import PipelineStepper

__all__ = ["phase_html", "show_phase", "build_stepper", "PipelinePanel"]

NOTES = {
    "prefill": "target EXTEND over each prompt, then the MTP layer's EXTEND over the same "
               "positions shifted by one token; its last row gives the first draft token d1",
    "decode": "one target DECODE row a request (speculation off)",
    "draft": "the MTP layer's DECODEs propose d2 .. d_ns from d1; then the verify batch (and "
             "v2's draft-extend batch) is built and planned",
    "verify": "TARGET_VERIFY over [verified token, d1 .. d_ns] of each request; greedy accept "
              "runs on the device",
    "accept": "host only: the accept lengths copied here to show them (v1 needs them on the "
              "host to shape its draft extend; v2 copies them once, after the round)",
    "draft_extend": "the MTP layer ingests the verify's rows (v1: the accepted rows, ragged; "
                    "v2: all rows, keeping row a-1) for the next d1; the tokens are committed",
}
CPU_NOTE = ("Milliseconds on this machine. On a CPU the layers run torch ops (the kernels' "
            "torch twins) of a 7M-parameter model: the numbers show what ran and what weighs "
            "most here, not GPU speed. Recorded on one H200: notebook 00 and docs/bench_e2e.md.")
_CSS = ("<style>.mlp td,.mlp th{padding:2px 8px;border-bottom:1px solid #ddd;vertical-align:top;"
        "text-align:left!important}.mlp .ok{background:#c8f0c8}.mlp .no{color:#b22;text-decoration:"
        "line-through}.mlp .bonus{background:#cfe0ff}.mlp .d{border:1px dashed #888}</style>")


def _table(head, rows) -> str:
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table class='mlp'><tr>{th}</tr>{body}</table>"


def _ranges(pages) -> str:
    runs: list[list[int]] = []
    for p in pages:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _tokens(eng, ids, cls) -> str:
    return "".join(f"<span class='{cls}'>{html.escape(eng.decode_text([t]))}</span>"
                   for t in ids)


def _text(st: PipelineStepper, req, phase: str | None) -> str:
    """The request's text (tail), then this round's drafts: accepted green, rejected struck,
    the bonus token blue; once committed, the round's tokens highlighted in the text."""
    eng, rid = st.engine, req.rid
    d, p, a = st.drafts.get(rid), st.predict.get(rid), st.accept.get(rid)
    out, mark = list(req.output_ids), ""
    if phase == "draft_extend" and a and out[-a:] == p[:a]:
        out, mark = out[:-a], _tokens(eng, p[:a - 1], "ok") + _tokens(eng, p[a - 1:a], "bonus")
    text = html.escape(req.text if req.finished else eng.decode_text(out))[-90:] + mark
    if d and phase in ("draft", "verify"):
        text += " " + _tokens(eng, d, "d")
        if p:
            text += f"<br><small>target argmax per row: {_tokens(eng, p, '')}</small>"
    elif d and a and phase == "accept":
        text += " " + _tokens(eng, d[:a - 1], "ok") + _tokens(eng, d[a - 1:], "no")
        text += " + bonus " + _tokens(eng, p[a - 1:a], "bonus")
    return text


def phase_html(st: PipelineStepper, rec=None) -> str:
    """The phase ``rec`` (default: the last one) as HTML tables."""
    rec = rec if rec is not None else (st.records[-1] if st.records else None)
    eng, phase = st.engine, rec.phase if rec else None
    nxt = "closed" if st.closed else (st.next_phase or "finished")
    of = f" of round {rec.round + 1}" if rec and phase != "prefill" else ""
    head = (f"<b>phase {rec.index}: {phase}{of}</b> ({rec.seconds * 1e3:.1f} ms) · next: "
            f"<b>{nxt}</b>" if rec else f"<b>no phase run yet</b> · next: <b>{nxt}</b>")
    parts = [_CSS, head]
    if phase:
        parts.append(f"<br><i>{NOTES[phase]}</i>")
    groups: dict[tuple, list] = defaultdict(list)  # (model, mode) -> batches, in run order
    for which, b in rec.batches if rec else []:
        groups[(which, b.forward_mode.name)].append(b)
    rows = []
    for req in st.requests:
        state = (f"finished ({req.finished_reason})" if req.finished else
                 "running" if req.req_pool_idx is not None else "waiting")
        cells = []
        for bs in groups.values():
            row = rec.rows.get(req.rid)
            per = [(b.seq_lens_q_cpu[i], b.kv_lens_cpu[i]) for b in bs
                   for i, r in enumerate(b.req_pool_indices.tolist()) if r == row]
            cells.append(" + ".join(str(q) for q, _ in per) + " rows, KV " +
                         "..".join(dict.fromkeys(str(k) for _, k in per)) if per else "-")
        pages = (f"{len(req.pages)} ({len(req.pages) * eng.page_size} slots): "
                 f"{_ranges(req.pages)}" if req.pages else "-")
        rows.append([req.rid, state, *cells, pages, _text(st, req, phase),
                     req.metrics.accept_lengths or "-"])
    mode_cols = [f"{w} {m}" + (f" x{len(b)}" if len(b) > 1 else "") for (w, m), b in groups.items()]
    parts.append(_table(["req", "state", *mode_cols, "KV pages", "text", "accept lengths"], rows))
    if rec and rec.planned:
        parts.append("planned for a later phase: " + ", ".join(
            f"{w} {b.forward_mode.name} ({b.total_q} rows)" for w, b in rec.planned))
    parts.append(_rank_shapes(st, groups))
    if rec and rec.forwards:
        fw = [[f.model, f.mode.name, f.rows, f"{f.seconds * 1e3:.2f}"] for f in rec.forwards]
        parts.append(_table(["model", "mode", "rows", "ms"], fw) + f"<small>{CPU_NOTE}</small>")
    return "<div>" + "<br>".join(parts) + "</div>"


def _rank_shapes(st: PipelineStepper, groups) -> str:
    """Per rank: its heads and the query / output shapes of each forward of the phase."""
    cfg, tp = st.engine.runner.config, st.engine.tp_size
    if not groups or cfg is None:  # (a mock model has no config)
        return ""
    h, width = cfg.num_attention_heads // tp, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    rows = []
    for r in range(tp):
        cells = [f"q [{bs[0].total_q}, {h}, {width}] -> out [{bs[0].total_q}, {h}, "
                 f"{cfg.kv_lora_rank}]" for bs in groups.values()]
        heads = f"{r * h}" if h == 1 else f"{r * h}..{(r + 1) * h - 1}"
        rows.append([r, f"{heads} of {cfg.num_attention_heads}", *cells])
    kv = {k: sum(bs[0].kv_lens_cpu) for k, bs in groups.items()}
    note = ("Every rank reads the same latent KV rows ([ckv | kpe], " f"{width} wide: "
            + ", ".join(f"{m} {n}" for (_, m), n in kv.items()) + " rows) from its own copy of "
            "the cache, for its own heads; the ranks all-reduce after attention and the MLP.")
    return _table(["rank", "heads", *[f"{w} {m}" for w, m in groups]], rows) + note


def show_phase(st: PipelineStepper, rec=None):
    """``phase_html`` as a displayable object."""
    from IPython.display import HTML
    return HTML(phase_html(st, rec))


def default_tp() -> tuple[int, list[int]]:
    """4 ranks on CPU (gloo) or on 4+ GPUs (NCCL); else as many as there are GPUs."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 4
    opts = [t for t in (1, 2, 4) if t <= n]
    return opts[-1], opts


def build_stepper(prompts=None, num_questions: int = 4, tp_size: int | None = None,
                  spec: str = "v2", num_steps: int = 3, kv_dtype: str = "fp8_e4m3",
                  attention_backend: str = "auto", max_new_tokens: int = 24) -> PipelineStepper:
    """A stepper over the embedded model: ``prompts`` (questions, each put after one worked
    example) or the first ``num_questions`` held-out questions."""
    from mla_spec.config import CacheConfig, SpecConfig
    from mla_spec.eval import STOP, build_prompts, heldout_problems
    questions = list(prompts) if prompts else heldout_problems(num_questions)
    sc = SpecConfig.off() if spec == "off" else SpecConfig(
        num_steps=num_steps, num_draft_tokens=num_steps + 1, version=spec)
    return PipelineStepper(build_prompts(questions, k_shots=1), max_new_tokens=max_new_tokens,
                           stop=list(STOP), tp_size=tp_size or default_tp()[0], spec=sc,
                           cache=CacheConfig(page_size=16, kv_dtype=kv_dtype),
                           attention_backend=attention_backend, max_reqs=16,
                           max_context_len=1024)


class PipelinePanel:
    """Widgets that build a batch and step it, one button per phase (only the next one is on).

    Give it a ``stepper`` to drive (its settings show in the widgets), or let it build one.
    Code that steps the same stepper redraws the panel too. ``close`` stops the ranks.
    """

    PHASE_BUTTONS = (("prefill", "prefill"), ("draft", "draft"), ("verify", "verify"),
                     ("accept", "accept"), ("draft extend", "draft_extend"), ("decode", "decode"))

    def __init__(self, stepper: PipelineStepper | None = None):
        import ipywidgets as w

        from mla_spec.viz.attention import dispatch_table
        tp, tps = default_tp()
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        backends = ["auto"] + [n for n, r in dispatch_table(dev).items() if r["device"] == "ok"]
        style = {"description_width": "90px"}
        tb = lambda opts, desc, v=None: w.ToggleButtons(  # noqa: E731
            options=opts, value=v if v is not None else opts[0], description=desc,
            style={**style, "button_width": "auto"})
        self.source = tb(["held-out questions", "my questions"], "prompts")
        self.questions = w.IntSlider(4, min=1, max=8, description="requests", style=style)
        self.text = w.Textarea("Tom has 12 apples and buys 7 more. How many apples does he "
                               "have?", description="questions", placeholder="one a line",
                               style=style, layout=w.Layout(width="640px", display="none"))
        self.tp, self.spec = tb(tps, "TP ranks", tp), tb(["off", "v1", "v2"], "spec", "v2")
        self.steps = w.IntSlider(3, min=1, max=5, description="num_steps", style=style)
        self.ndt = w.Label()
        self.kv = tb(["fp8_e4m3", "bfloat16"], "KV cache")
        self.backend = w.Dropdown(options=backends, description="attention", style=style)
        self.align = tb(["end", "start"], "v1 pad align")
        self.build = w.Button(description="build batch", button_style="primary")
        self.buttons = {p: w.Button(description=label) for label, p in self.PHASE_BUTTONS}
        self.round_button = w.Button(description="one round")
        self.end_button = w.Button(description="run to the end")
        self.close_button = w.Button(description="close", button_style="danger")
        self.status = w.HTML()
        self.status.add_class("mla-pipeline-status")
        self.out = w.Output()
        self.stepper: PipelineStepper | None = None
        self._quiet = False
        self.steps.observe(lambda _: self._label(), names="value")
        self.source.observe(lambda c: setattr(self.text.layout, "display", None if c["new"]
                                              == "my questions" else "none"), names="value")
        self.align.observe(lambda _: self.refresh(), names="value")
        self.build.on_click(lambda _: self._do(self._build, "starting the ranks"))
        for p, b in self.buttons.items():
            b.on_click(lambda _, p=p: self._do(self.stepper.step, p))
        self.round_button.on_click(lambda _: self._do(self.stepper.run_round, "one round", True))
        self.end_button.on_click(lambda _: self._do(self.stepper.run_to_end, "running", True))
        self.close_button.on_click(lambda _: self._do(self.stepper.close, "closing"))
        self.widget = w.VBox([
            w.HBox([self.source, self.questions]), self.text, w.HBox([self.tp, self.spec]),
            w.HBox([self.steps, self.ndt]), w.HBox([self.kv, self.backend]),
            w.HBox([self.align, self.build]), w.HBox(list(self.buttons.values())),
            w.HBox([self.round_button, self.end_button, self.close_button]),
            self.status, self.out])
        self._label()
        if stepper is None:
            self._do(self._build, "starting the ranks")
        else:
            self.attach(stepper)

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)

    def _label(self) -> None:
        self.ndt.value = f"-> {self.steps.value + 1} draft tokens a verify"

    def attach(self, stepper: PipelineStepper) -> None:
        """Drive ``stepper`` (the widgets take its settings)."""
        eng = stepper.engine
        self.stepper = stepper
        self.tp.value = eng.tp_size if eng.tp_size in self.tp.options else self.tp.value
        self.spec.value = eng.spec.version if eng.spec.enabled else "off"
        self.steps.value = eng.spec.num_steps
        self.kv.value = eng.cache.kv_dtype if eng.cache.kv_dtype in self.kv.options else "bfloat16"
        self.backend.value = stepper.attention_backend
        stepper.listeners.append(lambda rec: None if self._quiet else self.refresh())
        self.refresh()

    def _build(self) -> None:
        if self.stepper is not None:
            self.stepper.close()
        mine = self.source.value == "my questions"
        lines = [s.strip() for s in self.text.value.splitlines() if s.strip()]
        self.attach(build_stepper(lines if mine else None, self.questions.value, self.tp.value,
                                  self.spec.value, self.steps.value, self.kv.value,
                                  self.backend.value))

    def _do(self, fn, what: str, quiet: bool = False) -> None:
        for b in (self.build, self.round_button, self.end_button, self.close_button,
                  *self.buttons.values()):
            b.disabled = True
        self.status.value = f"<b>{what} ...</b>"
        self._quiet = quiet
        try:
            fn()
            self.refresh()
        except Exception as e:  # shown in the panel; the notebook goes on
            self.refresh()
            self.status.value += (f"<br><b style='color:#b22'>{type(e).__name__}: "
                                  f"{html.escape(str(e))}</b>")
        finally:
            self._quiet = False

    def refresh(self) -> None:
        """Redraw the buttons, the status line and the last phase."""
        from IPython.display import HTML, display
        st = self.stepper
        nxt = None if st is None else st.next_phase
        for p, b in self.buttons.items():
            b.disabled, b.button_style = p != nxt, "success" if p == nxt else ""
        self.build.disabled = False
        self.round_button.disabled = self.end_button.disabled = nxt is None
        self.close_button.disabled = st is None or st.closed
        if st is None:
            return
        self.status.value = (f"round {st.rounds} · phases run {len(st.records)} · next: "
                             f"<b>{nxt or ('closed' if st.closed else 'finished')}</b>")
        self.out.clear_output(wait=True)
        with self.out:
            display(HTML(phase_html(st)))
            modes = st.engine.metrics.mode_table()
            if modes:
                display(HTML(_CSS + "time per mode, committed steps:" + _table(
                    ["model", "mode", "forwards", "rows", "total ms", "mean ms", "share"],
                    [[m["model"], m["mode"], m["count"], m["rows"], f"{m['total_ms']:.1f}",
                      f"{m['mean_ms']:.2f}", f"{m['share']:.0%}"] for m in modes])))
            if st.engine.spec.version == "v1" and st.engine.spec.enabled and st.accept:
                self._padding(st)

    def _padding(self, st: PipelineStepper) -> None:
        from mla_spec.viz.padding import layout_figure, lost_context
        acc, ndt = list(st.accept.values()), st.engine.spec.num_draft_tokens
        lost = lost_context(acc, ndt, self.align.value)
        print(f"v1's draft-extend rows (accept lengths {acc}) in a fixed [bs, {ndt}] block, "
              f"align={self.align.value!r}: {lost} KV positions of context lost. The engine "
              "pads with 'end' (exact) where a backend needs a fixed q_len (trtllm); 'start' "
              "is SGLang's layout (notebook 02).")
        layout_figure(acc, ndt, self.align.value).show()
