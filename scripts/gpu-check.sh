#!/usr/bin/env bash
# The GPU path measured in one go: scripts/gpu-check.sh [--device cuda|cpu] [--preset P] --out DIR
# Writes DIR/gpu-check.json and DIR/gpu-check.md; exits 1 when a step fails. Runs with the
# interpreter of TURBOSERVE_VENV (default .venv), else python3 (a lent GPU machine's own torch):
# see docs/testing.md for what to carry there.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${TURBOSERVE_VENV:-.venv}/bin/python"
[ -x "$python" ] || python="$(command -v python3)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" -m tools.cli gpu-check "$@"
