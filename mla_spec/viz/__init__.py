"""Plotly figures shared by the notebooks and the CLI, one module per topic."""
