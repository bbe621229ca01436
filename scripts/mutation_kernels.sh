#!/usr/bin/env bash
# Mutation testing of the kernels' torch references (kernels/rope/torch_rotary.py,
# kernels/activation/torch_activation.py) with eager tests as the oracle, in a tree of its own.
# They are not in scripts/mutation.sh's configuration: the model's forward calls them, Dynamo
# traces that forward in the oracle's compile tests, and while mutmut maps tests to functions its
# trampoline reads a ContextVar, which Dynamo cannot trace (every compile test fails). Here the
# oracle runs them eagerly only. The tree is a copy of pieceworks/, tests/ and examples/ in
# build/mutation-kernels/ (git-ignored), with [tool.mutmut] replaced by KERNELS_CONFIG below;
# results accumulate in build/mutation-kernels/mutants/.
# Usage: bash scripts/mutation_kernels.sh [mutant-name globs]
#        cd build/mutation-kernels && python ../../scripts/mutation_score.py pieceworks.kernels
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$(cd "${VENV:-.venv}" && pwd)
WORK=$ROOT/build/mutation-kernels
mkdir -p "$WORK"
for part in pieceworks tests examples; do
    rm -rf "${WORK:?}/$part"
    cp -r "$ROOT/$part" "$WORK/$part"
done
"$VENV/bin/python" - "$ROOT/pyproject.toml" "$WORK/pyproject.toml" <<'EOF'
import re
import sys

KERNELS_CONFIG = '''[tool.mutmut]
source_paths = ["pieceworks"]
only_mutate = [
    "pieceworks/kernels/rope/torch_rotary.py",
    "pieceworks/kernels/activation/torch_activation.py",
]
# The rotary op's implementation and fake: torch.library reads their annotations through the
# function's globals, which a trampoline replaces; a function without mutants keeps its own.
do_not_mutate_patterns = [
    "rotate_heads_by_cache\\\\(positions, (query|key), cos_sin_cache, head_size, is_neox_style\\\\)",
    "return torch\\\\.empty_like\\\\(query\\\\), torch\\\\.empty_like\\\\(key\\\\)",
]
also_copy = ["examples"]
process_isolation = "forkserver"
pytest_add_cli_args = ["-m", "not gpu and not inductor", "-q", "-x", "-p", "no:cacheprovider"]
pytest_add_cli_args_test_selection = [
    "tests/kernels/test_torch_references.py",
    "tests/models/test_llama_hf.py::test_prefill_decode_and_mixed_batches_match_hf[gqa-llama3-rope-0]",
    "tests/models/test_llama_hf.py::test_prefill_decode_and_mixed_batches_match_hf[mha-tied-0]",
    "tests/engine/test_engine.py::test_greedy_equals_hf_step_by_step",
]

'''
source, target = sys.argv[1:]
text = open(source).read()
start = text.index("[tool.mutmut]")
following = re.compile(r"^\[", re.M).search(text, start + 1)
end = following.start() if following else len(text)
open(target, "w").write(text[:start] + KERNELS_CONFIG + text[end:])
EOF
cd "$WORK"
export PIECEWORKS_PLATFORM=cpu
export PIECEWORKS_CACHE_ROOT=${PIECEWORKS_CACHE_ROOT:-$(mktemp -d)}
"$VENV/bin/mutmut" run --max-children "${MUTATION_JOBS:-2}" "$@"
"$VENV/bin/mutmut" results
