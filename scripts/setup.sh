#!/usr/bin/env bash
# Create .venv and install Switchyard with its dev tools and the GGUF conversion extras
# (`convert`: gguf, accelerate). torch is pinned by constraints.txt: a CPU build that lies
# on disk on these machines; an unpinned torch pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev,convert]'
