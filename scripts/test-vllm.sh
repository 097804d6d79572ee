#!/usr/bin/env bash
# The whole test suite against the vLLM profile, in vLLM's own environment (never .venv/):
# configs/cpu-vllm.yaml on a CPU box, configs/gpu.yaml where vLLM sees a GPU. Tests of what the
# CPU engines do alone (their speculation, the busy box) run on their own profile or skip.
# Usage: bash scripts/test-vllm.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/peers.sh vllm ours_vllm
PY=.venv-peers/ours-vllm/bin/python
profile=$("$PY" -c 'from vllm.platforms import current_platform as p; print("configs/cpu-vllm.yaml" if p.is_cpu() else "configs/gpu.yaml")')
echo "vLLM profile: $profile" >&2
export RUN_SLOW=1 SERVE_CONFIG="${SERVE_CONFIG:-$profile}" HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
exec "$PY" -m pytest -q "${@:-tests}"
