#!/usr/bin/env bash
# Create the virtual environment and install TurboServe with the given extras.
#   scripts/setup.sh [EXTRAS]     e.g. scripts/setup.sh embedded   or   scripts/setup.sh test
# Needs only Python 3.11+. torch goes in first (TURBOSERVE_TORCH_SPEC, default torch==2.13.0) so
# that the project's torch>=... range is met by it; on Linux PyPI's wheel is the CUDA build.
# Prints a line per step; TURBOSERVE_SETUP_QUIET=1 keeps pip's own output quiet.
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
quiet=()
[ "${TURBOSERVE_SETUP_QUIET:-0}" = "1" ] && quiet=(--quiet)
step() { echo "setup: $*"; }

if [ ! -x "$venv/bin/python" ]; then
  step "creating the virtual environment $venv ($("$python" --version))"
  "$python" -m venv "$venv"
fi
step "upgrading pip"
"$venv/bin/python" -m pip install --quiet --upgrade pip
if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  spec="${TURBOSERVE_TORCH_SPEC:-torch==2.13.0}"
  step "installing $spec first (on Linux, PyPI's torch is the CUDA build: a download of several"
  step "GB that takes a while; set TURBOSERVE_TORCH_SPEC to pick another build)"
  "$venv/bin/python" -m pip install "${quiet[@]}" --progress-bar on "$spec"
else
  step "torch already installed: $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
fi
step "installing TurboServe with extras [$extras] and its dependencies"
"$venv/bin/python" -m pip install "${quiet[@]}" --progress-bar on -e ".[${extras}]"
"$venv/bin/python" -c 'import tools.cli' || { echo "setup: the install is broken" >&2; exit 1; }
step "$venv ready ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
