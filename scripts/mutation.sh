#!/usr/bin/env bash
# Mutation testing with mutmut 3 over pieceworks/core, engine, scheduler, worker, platforms,
# models/loading, the model reference ops and the in-process entrypoint modules, the fast CPU
# tests as the oracle (configuration: [tool.mutmut] in pyproject.toml; the kernels' torch
# references: scripts/mutation_kernels.sh). Not in
# CI: a full run takes hours on a small machine. Results accumulate in mutants/ (git-ignored), so
# a run can be split by module and resumed; docs/testing.md records the last score.
# Usage: bash scripts/mutation.sh [mutant-name globs]   e.g. 'pieceworks.worker.sampler.*'
#        MUTATION_JOBS=4 bash scripts/mutation.sh        (parallel test processes, default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PIECEWORKS_PLATFORM=cpu
export PIECEWORKS_CACHE_ROOT=${PIECEWORKS_CACHE_ROOT:-$(mktemp -d)}
"$VENV/bin/mutmut" run --max-children "${MUTATION_JOBS:-2}" "$@"
"$VENV/bin/mutmut" export-cicd-stats 2>/dev/null || true
"$VENV/bin/mutmut" results
