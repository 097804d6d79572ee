#!/usr/bin/env bash
# Tools and peer systems for comparisons, each in its own ignored environment (never .venv/):
#   .venv-peers/  guidellm, a public OpenAI-API load tool (bench/results/guidellm_*.json).
# Usage: bash scripts/peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-peers/bin/guidellm ]; then
  "$PY" -m venv .venv-peers
  .venv-peers/bin/pip install -q --upgrade pip
  .venv-peers/bin/pip install -q "guidellm==0.8.1"
fi
.venv-peers/bin/guidellm --version 2>/dev/null || .venv-peers/bin/pip show guidellm | head -2
