"""The rendered copy of the notebooks (``docs/notebooks/``, built by
``scripts/render_notebooks.sh``) is complete and current: one page per notebook, each holding
the notebook's code as it is now, and each plotly figure in it drawn by a ``Plotly.newPlot`` call.
Reading the committed pages takes a fraction of a second; nothing is executed."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # the notebook extra (CI installs it)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RENDERED = ROOT / "docs" / "notebooks"
FIX = "run `bash scripts/render_notebooks.sh {}`"


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_has_a_current_page(nb):
    page_path = RENDERED / f"{nb.stem}.html"
    assert page_path.exists(), f"no rendered page {page_path.relative_to(ROOT)}: " + \
        FIX.format(nb.relative_to(ROOT))
    page = page_path.read_text()
    text = _text(page)
    stale = [c.source.splitlines()[0] for c in nbformat.read(nb, as_version=4).cells
             if c.cell_type == "code" and c.source.strip() and c.source not in text]
    assert not stale, (f"{page_path.name} is older than {nb.name} (cells {stale[:3]} are not "
                       "in it): " + FIX.format(nb.relative_to(ROOT)))
    divs, plots = page.count('class="plotly-graph-div"'), page.count("Plotly.newPlot(")
    assert 0 < divs <= plots, f"{page_path.name}: {divs} figures, {plots} drawn"
