#!/usr/bin/env bash
# Create .venv and install Switchyard with its dev tools. torch is pinned by constraints.txt:
# a CPU build that lies on disk on these machines; an unpinned torch pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
# The engine's native CPU kernels, built once here rather than by the first worker (~30 s;
# a machine without a C++ compiler runs torch's slower path and the log says so).
.venv/bin/python -m workers.runner.native || echo "warning: native kernels not built (see above)" >&2
# System packages the tests drive: chromium (the /dashboard page's browser test, through
# Playwright), promtool (from `prometheus`: the alert rules' check), wrk (the gateway
# bench's load generator), cmake and a C++ compiler (llama-server's build, below). Nothing
# to do when all are there; installing needs root and apt-get, else those tests fail and
# say why.
if ! command -v chromium >/dev/null || ! command -v promtool >/dev/null || ! command -v wrk >/dev/null \
  || ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium prometheus wrk cmake g++ >/dev/null
  else
    echo "warning: chromium, promtool, wrk, cmake or c++ missing (as root: apt-get install chromium prometheus wrk cmake g++)" >&2
  fi
fi
# llama.cpp's llama-server (a `kind: llamacpp` serve pool, its tests, the peer benchmarks):
# built once per machine and CPU from a pinned, checksummed source into
# ~/.cache/switchyard/peers/llama-server, outside the repository (about 15 min on 2 cores
# the first time, with progress; a no-op when cached). A failed build does not stop setup:
# the tests that need llama-server then fail naming this command.
.venv/bin/python -m benchmarks.peers build-llama-server \
  || echo "warning: llama-server not built (see above); retry with: .venv/bin/python -m benchmarks.peers build-llama-server" >&2
