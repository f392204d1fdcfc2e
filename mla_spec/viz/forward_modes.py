"""Figures for the forward-mode tour: the speculative loop as a timeline, the predicate truth table,
and what each mode hands the attention kernel for one batch."""

from collections.abc import Sequence

import plotly.graph_objects as go

from mla_spec.forward_batch import ForwardBatch
from mla_spec.forward_mode import ForwardMode

__all__ = ["PREDICATES", "predicate_table", "truth_table_figure", "spec_loop_steps",
           "spec_loop_timeline", "batch_rows", "batch_table_figure"]

#: (method name, keyword arguments) of each predicate in the table
PREDICATES: list[tuple[str, dict]] = [
    ("is_extend", {}), ("is_extend", {"include_draft_extend_v2": True}), ("is_decode", {}),
    ("is_mixed", {}), ("is_idle", {}), ("is_decode_or_idle", {}), ("is_target_verify", {}),
    ("is_draft_extend", {}), ("is_draft_extend", {"include_v2": True}),
    ("is_draft_extend_v2", {}), ("is_extend_or_draft_extend_or_mixed", {}),
    ("is_cuda_graph", {}), ("is_cpu_graph", {}), ("is_split_prefill", {})]


def predicate_table() -> dict[str, dict[str, bool]]:
    """``{"is_extend()": {mode name: value}, ...}`` evaluated from the code, not typed in."""
    label = lambda meth, kw: f"{meth}({', '.join(f'{k}={v}' for k, v in kw.items())})"
    return {label(meth, kw): {m.name: bool(getattr(m, meth)(**kw)) for m in ForwardMode}
            for meth, kw in PREDICATES}


def truth_table_figure() -> go.Figure:
    table = predicate_table()
    modes = [m.name for m in ForwardMode]
    z = [[int(row[m]) for m in modes] for row in table.values()]
    fig = go.Figure(go.Heatmap(
        z=z, x=modes, y=list(table), colorscale=[[0, "#f4f4f4"], [1, "#2a7ab9"]], showscale=False,
        text=[["✓" if v else "" for v in r] for r in z], texttemplate="%{text}", xgap=2, ygap=2))
    fig.update_layout(title="ForwardMode predicates (evaluated from mla_spec.ForwardMode)",
                      xaxis_title="forward mode", yaxis_title="predicate",
                      yaxis_autorange="reversed", height=540, margin=dict(l=260))
    return fig


def spec_loop_steps(num_iterations: int = 2, num_steps: int = 3, version: str = "v2"
                    ) -> list[tuple[str, ForwardMode, str]]:
    """The forwards of MTP speculative decoding, ``(model, mode, note)`` each: target and draft
    EXTEND, then per iteration ``num_steps - 1`` draft DECODEs, a TARGET_VERIFY, a draft extend."""
    ndt = num_steps + 1
    steps = [("target", ForwardMode.EXTEND, "prompt prefill"),
             ("draft", ForwardMode.EXTEND, "draft prefill: tokens shifted left by one")]
    extend = ForwardMode.DRAFT_EXTEND_V2 if version == "v2" else ForwardMode.DRAFT_EXTEND
    rows = f"{ndt} rows, keep row a-1" if version == "v2" else "a rows (ragged)"
    for _ in range(num_iterations):
        steps += [("draft", ForwardMode.DECODE, f"draft step {k + 2}")
                  for k in range(num_steps - 1)]
        steps.append(("target", ForwardMode.TARGET_VERIFY, f"{ndt} rows: verified token + drafts"))
        steps.append(("draft", extend, rows))
    return steps


_COLORS = {ForwardMode.EXTEND: "#7f7f7f", ForwardMode.DECODE: "#2ca02c",
           ForwardMode.TARGET_VERIFY: "#d62728", ForwardMode.DRAFT_EXTEND: "#ff7f0e",
           ForwardMode.DRAFT_EXTEND_V2: "#9467bd"}


def spec_loop_timeline(num_iterations: int = 2, num_steps: int = 3, version: str = "v2",
                       durations: dict[ForwardMode, float] | None = None) -> go.Figure:
    """One bar per forward on a target lane and a draft lane; widths from ``durations`` (ms)."""
    durations = durations or {ForwardMode.EXTEND: 4.0, ForwardMode.DECODE: 0.6,
                              ForwardMode.TARGET_VERIFY: 2.0, ForwardMode.DRAFT_EXTEND: 0.8,
                              ForwardMode.DRAFT_EXTEND_V2: 0.8}
    fig, t, seen = go.Figure(), 0.0, set()
    for model, mode, note in spec_loop_steps(num_iterations, num_steps, version):
        d = durations[mode]
        fig.add_trace(go.Bar(
            x=[d], y=[model], base=[t], orientation="h", name=mode.name,
            marker_color=_COLORS[mode], showlegend=mode not in seen, legendgroup=mode.name,
            hovertext=f"{mode.name}: {note}", hoverinfo="text"))
        seen.add(mode)
        t += d
    fig.update_layout(barmode="overlay", title=f"MTP speculative loop (spec {version}, "
                      f"{num_steps} steps, {num_steps + 1} draft tokens)",
                      xaxis_title="time (ms, illustrative widths)", yaxis_title="model",
                      height=330, legend=dict(orientation="h", y=-0.35, x=0),
                      margin=dict(b=110))
    return fig


def batch_rows(batch: ForwardBatch) -> dict[str, list]:
    """What a mode hands the attention kernel, per request."""
    return {"rows (seq_lens_q)": batch.seq_lens_q_cpu, "seq_lens (SGLang)": batch.seq_lens_cpu,
            "kv_lens (attended)": batch.kv_lens_cpu, "qo_indptr": batch.qo_indptr.tolist(),
            "positions": batch.positions.tolist()}


def batch_table_figure(batches: Sequence[ForwardBatch]) -> go.Figure:
    header = ["mode", "rows per request", "seq_lens", "kv_lens", "qo_indptr"]
    cols = [[b.forward_mode.name for b in batches], [str(b.seq_lens_q_cpu) for b in batches],
            [str(b.seq_lens_cpu) for b in batches], [str(b.kv_lens_cpu) for b in batches],
            [str(b.qo_indptr.tolist()) for b in batches]]
    fig = go.Figure(go.Table(header=dict(values=header), cells=dict(values=cols)))
    fig.update_layout(height=50 + 26 * len(batches), margin=dict(t=10, b=10))
    return fig
