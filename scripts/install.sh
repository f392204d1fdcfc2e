#!/usr/bin/env bash
# Creates .venv in the repo root and installs mla_spec with its dev and notebook extras, CPU torch first
# (a plain `pip install torch` pulls a multi-GB CUDA build). Override the torch spec with TORCH_SPEC,
# e.g. TORCH_SPEC="torch" on a GPU machine, and add the gpu extra with EXTRAS="dev,notebooks,gpu".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-dev,notebooks}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
.venv/bin/python -c "import mla_spec, torch, triton; print('mla_spec', mla_spec.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
