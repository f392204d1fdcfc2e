"""Every notebook, run in JupyterLab in a real browser: no errors, every figure drawn, every widget
live, and the interactive ones react.

Each test opens one notebook (a temporary copy; conftest.py starts the server and the browser),
waits for its kernel, clears the outputs and runs JupyterLab's ``notebook:run-all-cells`` command
(Run > Run All Cells), which resolves once every cell ran or one raised. Then, per code cell:

- no error: no ``error`` output and no traceback printed on stderr;
- every plotly output the kernel sent is a ``.js-plotly-plot`` with its ``.main-svg`` drawn at a
  non-zero size (a missing renderer shows "No renderer could be found" instead);
- every widget view is live (a ``.jupyter-widgets`` element, no "Error displaying widget");
- then the notebook's interaction, if ``INTERACTIONS`` names one: a small function that drives the
  page like a user and asserts that what is shown changed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
from lab_server import NOTEBOOKS_DIR, REPO

pytestmark = pytest.mark.browser

NOTEBOOKS = sorted(p.name for p in NOTEBOOKS_DIR.glob("*.ipynb"))
OPEN_TIMEOUT_MS = 120_000  # page load plus kernel start
RUN_TIMEOUT_MS = 300_000  # Run All of one notebook
SETTLE_TIMEOUT_MS = 30_000  # figures and widget views drawing after the last cell

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\w*(Error|Exception)\b.*:", re.M)

_KERNEL_IDLE = """(path) => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!w || !w.context || w.context.path !== path || !w.sessionContext) return false;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle' && w.content.widgets.length > 0;
}"""

_RUN_ALL = """async () => {
  const app = window.jupyterapp;
  await app.commands.execute('notebook:clear-all-cell-outputs');
  window.__runAll = undefined;
  app.commands.execute('notebook:run-all-cells').then(
    ok => { window.__runAll = {ok: ok !== false}; },
    err => { window.__runAll = {ok: false, error: String(err)}; });
}"""

# Per code cell: each plotly / widget-view output of the model beside its element in the page
# (the output area's children follow the model's outputs one to one), and every figure in the
# cell, those inside a widget (an ipywidgets Output) included.
_CELLS = """() => {
  const PLOTLY = 'application/vnd.plotly.v1+json';
  const WIDGET = 'application/vnd.jupyter.widget-view+json';
  const nb = window.jupyterapp.shell.currentWidget;
  const drawn = g => {
    const r = g.getBoundingClientRect();
    return {drawn: !!g.querySelector('.main-svg') && r.width > 0 && r.height > 0,
            traces: (g._fullData || []).length, width: Math.round(r.width),
            height: Math.round(r.height)};
  };
  return nb.content.widgets.map((cell, index) => {
    const m = cell.model;
    if (m.type !== 'code') return null;
    const outs = m.outputs.toJSON();
    const children = Array.from(cell.outputArea.node.children)
      .filter(e => e.classList.contains('jp-OutputArea-child'));
    const rendered = outs.map((o, i) => {
      const data = o.data || {};
      const html = String(data['text/html'] || '').includes('plotly-graph-div');
      const kind = data[PLOTLY] || html ? 'plotly' : data[WIDGET] ? 'widget' : null;
      if (!kind) return null;
      const el = children[i];
      if (!el) return {kind, ok: false, text: 'no element in the page'};
      const text = el.innerText.replace(/\\s+/g, ' ').slice(0, 200);
      if (kind === 'plotly') {  // drawn, with as many traces as the kernel sent
        const g = el.querySelector('.js-plotly-plot');
        const want = data[PLOTLY] ? (Array.isArray(data[PLOTLY].data) ? data[PLOTLY].data.length
                                                                       : 'no list of') : null;
        const d = g ? drawn(g) : {drawn: false};
        const ok = d.drawn && (want === null || d.traces === want);
        return {kind, ok, text: g ? JSON.stringify({...d, sent: want}) + ' ' + text : text};
      }
      const live = !!el.querySelector('.jupyter-widgets') && !text.includes('Error displaying');
      return {kind, ok: live, text};
    }).filter(r => r !== null);
    const t = (m.getMetadata('execution') || {});
    const seconds = t['iopub.execute_input'] && t['shell.execute_reply']
      ? (Date.parse(t['shell.execute_reply']) - Date.parse(t['iopub.execute_input'])) / 1000 : null;
    return {
      index, count: m.executionCount, seconds,
      source: [].concat(m.toJSON().source).join('').split('\\n')[0].slice(0, 100),
      errors: outs.filter(o => o.output_type === 'error')
        .map(o => ({ename: o.ename, evalue: o.evalue, traceback: (o.traceback || []).join('\\n')})),
      stderr: outs.filter(o => o.output_type === 'stream' && o.name === 'stderr')
        .map(o => [].concat(o.text).join('')),
      shownStderr: Array.from(cell.node.querySelectorAll(
        '[data-mime-type="application/vnd.jupyter.stderr"]')).map(e => e.innerText),
      rendered,
      plots: Array.from(cell.node.querySelectorAll('.js-plotly-plot')).map(drawn),
      widgetErrors: Array.from(cell.node.querySelectorAll('.jp-OutputArea-output'))
        .map(e => e.innerText).filter(t => t.includes('Error displaying widget')),
    };
  }).filter(c => c !== null);
}"""

# done drawing: the kernel idle, every figure drawn, every widget view live or showing its error
_SETTLED = ("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"
            " === 'idle' && (" + _CELLS + ")().every(c => c.plots.every(p => p.drawn)"
            " && c.rendered.every(r => r.ok || /Error|No renderer/.test(r.text)))")


def _clean(text: str, lines: int = 6) -> str:
    return "\n      ".join(_ANSI.sub("", text).strip().splitlines()[-lines:])


def cell_problems(cells: list[dict]) -> list[str]:
    """What is wrong in the page, a line (or a short block) per problem; empty when all is well."""
    problems, first_error = [], None
    for c in cells:
        where = f"cell {c['index']} `{c['source']}`"
        for err in c["errors"]:
            tb = _ANSI.sub("", err["traceback"]).splitlines()
            frames = [ln.strip() for ln in tb if ln.lstrip().startswith("Cell In[")]
            value = [ln for ln in _ANSI.sub("", err["evalue"]).splitlines() if ln.strip()] or [""]
            problems.append(f"{where} raised {err['ename']}: {value[0]}"
                            + "".join(f"\n      {ln}" for ln in value[1:3])
                            + (f"\n      at {frames[-1]}" if frames else ""))
            first_error = first_error if first_error is not None else c["index"]
        printed = c["stderr"] + ([] if c["errors"] else c["shownStderr"])
        for text in printed:
            if _TRACEBACK.search(_ANSI.sub("", text)):
                problems.append(f"{where} printed an error on stderr:\n      {_clean(text)}")
                first_error = first_error if first_error is not None else c["index"]
        if c["count"] is None and first_error is None:
            problems.append(f"{where} did not run")
        for r in c["rendered"]:
            if not r["ok"]:
                what = "figure not drawn" if r["kind"] == "plotly" else "widget not live"
                problems.append(f"{where}: {what}: {r['text'][:240]}")
        undrawn = [p for p in c["plots"] if not p["drawn"]]
        if undrawn:
            problems.append(f"{where}: {len(undrawn)} of {len(c['plots'])} figures not drawn "
                            f"(no .main-svg or zero size): {undrawn}")
        if c["widgetErrors"] and all(r["ok"] for r in c["rendered"] if r["kind"] == "widget"):
            problems.append(f"{where}: {_clean(c['widgetErrors'][0], 2)}")
    if first_error is not None:
        skipped = [c["index"] for c in cells if c["index"] > first_error and c["count"] is None]
        if skipped:
            problems.append(f"cells {skipped} did not run after the error")
    return problems


# ---- interactions: one small function per notebook, driving the page as a user would ----------
def _figures_in(locator) -> list[dict]:
    return locator.evaluate("""el => Array.from(el.querySelectorAll('.js-plotly-plot')).map(g => ({
        drawn: !!g.querySelector('.main-svg'), data: JSON.stringify(g.data)}))""")


def padding_explorer_redraws(page) -> None:
    """02: one step left on the explorer's "batch size" slider (keyboard on the slider handle)
    redraws its two figures for one request fewer."""
    slider = page.locator(".widget-slider", has=page.locator(".widget-label",
                                                                has_text="batch size"))
    assert slider.count() == 1, f"{slider.count()} 'batch size' sliders in the page"
    explorer = page.locator(".widget-vbox", has=slider).first
    readout = slider.locator(".widget-readout")
    before_value, before = int(readout.inner_text()), _figures_in(explorer)
    assert len(before) == 2 and all(f["drawn"] for f in before), before
    handle = slider.locator(".noUi-handle")
    handle.scroll_into_view_if_needed()
    handle.focus()
    page.keyboard.press("ArrowLeft")
    deadline, after = time.monotonic() + 30, before
    while time.monotonic() < deadline:
        after = _figures_in(explorer)
        if (readout.inner_text() == str(before_value - 1) and len(after) == 2
                and all(f["drawn"] for f in after)
                and [f["data"] for f in after] != [f["data"] for f in before]):
            return
        page.wait_for_timeout(250)
    raise AssertionError(f"moving 'batch size' from {before_value} did not redraw the figures: "
                         f"readout {readout.inner_text()!r}, "
                         f"{sum(f['drawn'] for f in after)} of {len(after)} drawn, data "
                         f"{'unchanged' if after == before else 'changed'}")


def _wait_for(check, what: str, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(what)


def pipeline_panel_steps(page) -> None:
    """06: the panel's one enabled phase button runs that phase (the status line counts one phase
    more, the request table shows the phase's forwards); "one round" ends the round (the round
    counter goes up)."""
    status = page.locator(".mla-pipeline-status")
    assert status.count() == 1, f"{status.count()} pipeline status lines in the page"
    panel = page.locator(".widget-vbox", has=status).first
    status.scroll_into_view_if_needed()  # JupyterLab renders only the cells in view
    state = re.compile(r"round (\d+) · phases run (\d+) · next: (\w+)")
    now = lambda: state.search(status.inner_text())  # noqa: E731

    def count(group: int) -> int | None:  # one read: the line changes while a phase runs
        m = now()
        return int(m[group]) if m else None
    _wait_for(now, f"no pipeline status in the panel: {status.inner_text()!r}", 30)
    m = now()
    rounds, phases, nxt = int(m[1]), int(m[2]), m[3]
    enabled = [b.inner_text() for b in panel.locator("button.widget-button").all()
               if b.is_enabled()]
    label = nxt.replace("_", " ")
    assert label in enabled, f"next phase {nxt!r}, enabled buttons {enabled}"
    before = panel.locator("table.mlp").first.inner_text()
    panel.get_by_role("button", name=label, exact=True).click()
    _wait_for(lambda: count(2) == phases + 1,
              f"pressing {label!r} did not run a phase: status {status.inner_text()!r}", 30)
    after = panel.locator("table.mlp").first.inner_text()
    assert after != before, f"the request table did not change after {label!r}"
    panel.get_by_role("button", name="one round", exact=True).click()
    _wait_for(lambda: count(1) == rounds + 1,
              f"'one round' did not end the round: status {status.inner_text()!r}")


# notebook file name -> its interaction
INTERACTIONS: dict[str, Callable] = {
    "02_draft_extend_padding.ipynb": padding_explorer_redraws,
    "06_deepseek_fp4_pipeline.ipynb": pipeline_panel_steps,
}


@pytest.mark.skipif(NOTEBOOKS_DIR != REPO / "notebooks", reason="another notebooks folder")
def test_every_interaction_names_a_notebook():
    assert set(INTERACTIONS) <= set(NOTEBOOKS), sorted(set(INTERACTIONS) - set(NOTEBOOKS))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_in_browser(name, lab, browser, notebook_timings, slow_cells):
    marks = [("start", time.monotonic())]
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda exc: page_errors.append(str(exc)[:300]))
    try:
        # a fresh workspace (&reset): the notebooks opened before are not restored beside this one
        page.goto(lab.url(f"lab/tree/{name}", "&reset"))
        page.wait_for_function(_KERNEL_IDLE, arg=name, timeout=OPEN_TIMEOUT_MS, polling=250)
        marks.append(("open", time.monotonic()))
        page.evaluate(_RUN_ALL)
        page.wait_for_function("() => window.__runAll !== undefined", timeout=RUN_TIMEOUT_MS,
                               polling=250)
        marks.append(("run", time.monotonic()))
        try:
            page.wait_for_function(_SETTLED, timeout=SETTLE_TIMEOUT_MS, polling=250)
        except Exception:  # the checks below say what did not settle
            pass
        cells = page.evaluate(_CELLS)
        slowest = sorted((c for c in cells if c["seconds"]), key=lambda c: -c["seconds"])[:3]
        slow_cells[name] = [(c["index"], c["seconds"], c["source"]) for c in slowest]
        problems = cell_problems(cells)
        if not problems and name in INTERACTIONS:
            try:
                INTERACTIONS[name](page)
            except AssertionError as exc:
                problems.append(f"interaction {INTERACTIONS[name].__name__}: {exc}")
        marks.append(("check", time.monotonic()))
        if problems:
            shot = lab.root / f"{name}.png"
            page.screenshot(path=str(shot))
            extra = f"\n  page errors: {page_errors[:3]}" if page_errors else ""
            pytest.fail(f"{name} in JupyterLab ({lab.url('lab')}):\n  - "
                        + "\n  - ".join(problems) + f"{extra}\n  screenshot: {shot}",
                        pytrace=False)
    finally:
        try:
            page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
        except Exception:  # the server stops its kernels at the end anyway
            pass
        context.close()
        marks.append(("close", time.monotonic()))
        notebook_timings[name] = {b[0]: b[1] - a[1] for a, b in zip(marks, marks[1:])}
