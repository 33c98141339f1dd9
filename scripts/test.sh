#!/usr/bin/env bash
# Set up (first time) and run every test: lint, unit, integration (real NATS + Redis: the ones
# at TURBOSERVE_NATS_URL / TURBOSERVE_REDIS_URL, else embedded ones) and end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
venv="${TURBOSERVE_VENV:-.venv}"
"$venv/bin/ruff" check .
"$venv/bin/mypy"  # the whole tree, strict (pyproject.toml [tool.mypy] lists the exceptions)
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
