#!/usr/bin/env bash
# Set up (first time) and run the whole mesh locally: `turboserve up`.
# Uses NATS/Redis at TURBOSERVE_NATS_URL / TURBOSERVE_REDIS_URL when they answer, else its own.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh embedded
exec "${TURBOSERVE_VENV:-.venv}/bin/turboserve" up "$@"
