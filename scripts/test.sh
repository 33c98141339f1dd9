#!/usr/bin/env bash
# Set up (first time) and run every test: lint, unit, integration (real NATS + Redis: the ones
# at TURBOSERVE_NATS_URL / TURBOSERVE_REDIS_URL, else embedded ones) and end to end.
#   scripts/test.sh [PYTEST ARGS]          everything (what CI runs)
#   scripts/test.sh --fast [PYTEST ARGS]   lint, types and every test not marked integration,
#                                          e2e or slow: no NATS, Redis, mesh or browser
# docs/testing.md says how the tests are organised.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TURBOSERVE_VENV:-.venv}"
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
# --fast trusts an environment that is already set up (run scripts/setup.sh test after the
# dependencies change); the full run always brings it up to date.
if [ "$fast" = 0 ] || ! "$venv/bin/python" -c 'import tools.cli' >/dev/null 2>&1; then
  bash scripts/setup.sh test
fi
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .  # the tree is formatted by `ruff format`
"$venv/bin/mypy"  # the whole tree, strict (pyproject.toml [tool.mypy] lists the exceptions)
if [ "$fast" = 1 ]; then
  exec "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    -m "not integration and not e2e and not slow" "$@"
fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
