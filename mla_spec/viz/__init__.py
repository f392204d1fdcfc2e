"""Plotly figures shared by the notebooks and the CLI, one module per topic."""

import json
from pathlib import Path

#: recorded results shipped with the package (``mla_spec/data``)
DATA = Path(__file__).resolve().parents[1] / "data"


def read_json(path: str | Path | None, shipped: str) -> dict:
    """The JSON file at ``path``; None reads ``mla_spec/data/<shipped>`` (works installed too)."""
    return json.loads(Path(DATA / shipped if path is None else path).read_text())
