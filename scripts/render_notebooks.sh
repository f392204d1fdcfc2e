#!/usr/bin/env bash
# The rendered copy of the notebooks, for readers who run nothing: each notebook executed on a
# fresh kernel with no environment variable set (as a reader's; one intra-op thread unless
# OMP_NUM_THREADS says otherwise) and exported to static HTML in docs/notebooks/, its plotly
# figures drawn by plotly.js from its CDN and its widgets in the state the run left them.
# tests/test_rendered_notebooks.py checks that every notebook has its page and that each page
# holds the notebook's current code. Usage: bash scripts/render_notebooks.sh [NOTEBOOK ...]
# (default: every notebook; about 3 minutes on 2 CPU cores).
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/notebooks
mkdir -p "$out"
[ $# -gt 0 ] || set -- notebooks/*.ipynb
for nb in "$@"; do
    start=$(date +%s)
    env -u TRITON_INTERPRET -u MLA_SPEC_TRITON_ON_CPU OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
        PLOTLY_RENDERER=plotly_mimetype+notebook_connected \
        .venv/bin/jupyter nbconvert --execute --to html --output-dir "$out" \
        --ExecutePreprocessor.timeout=600 --log-level=WARN "$nb"
    echo "$out/$(basename "${nb%.ipynb}").html ($(( $(date +%s) - start )) s)"
done
