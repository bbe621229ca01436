"""A warm engine start in a fresh process traces nothing and answers as the traced start did.

llama-tiny and bamba-tiny at level 3 with the eager backend (the warm path is the same for
Inductor, whose artifacts ``tests/core/warm_start/test_warm_start.py`` covers): a cold process
traces once and stores the split graph; a second process, same cache root, loads it
(``num_dynamo_traces`` 0, no graph reaches the backend) and its greedy tokens and logprobs equal
the cold ones exactly. On
the CPU platform (no static graphs), and llama-tiny once more on the simgraph platform with
FULL_AND_PIECEWISE, where the loaded pieces sit in static-graph wrappers and are captured and
replayed. About a minute on 2 CPU cores.
Run: pytest tests/engine/test_warm_start_engine.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Layers that end at a splitting op: llama-tiny's 2 attention layers, bamba-tiny's 3 Mamba2 mixers
# and 1 attention layer; the capturable pieces between them number one more.
SPLIT_LAYERS = {"llama-tiny": 2, "bamba-tiny": 4}


def run_worker(model: str, cache_root: Path, out: Path, **env: str) -> dict:
    """``warm_start_worker`` in a fresh process with the cache on; its JSON result."""
    environment = {k: v for k, v in os.environ.items() if k != "PIECEWORKS_DISABLE_COMPILE_CACHE"}
    environment.update(env)
    command = [sys.executable, "-m", "tests.engine.warm_start_worker"]
    command += ["--model", model, "--cache-root", str(cache_root), "--out", str(out)]
    if "PIECEWORKS_PLATFORM" in env:
        command += ["--cudagraph-mode", "FULL_AND_PIECEWISE"]
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def simgraph_env() -> dict[str, str]:
    pytest.importorskip(
        "pieceworks_simgraph.platform", reason="pip install -e examples/pieceworks-simgraph"
    )
    return {"PIECEWORKS_PLATFORM": "simgraph"}


@pytest.mark.parametrize(
    "model,platform", [("llama-tiny", "cpu"), ("llama-tiny", "simgraph"), ("bamba-tiny", "cpu")]
)
def test_warm_engine_start_loads_the_graph_and_answers_the_same(model, platform, tmp_path):
    env = simgraph_env() if platform == "simgraph" else {}
    cold = run_worker(model, tmp_path / "root", tmp_path / "cold.json", **env)
    warm = run_worker(model, tmp_path / "root", tmp_path / "warm.json", **env)
    assert cold["counters"]["num_dynamo_traces"] == 1
    assert cold["counters"]["num_traced_graphs_saved"] == 1
    assert warm["counters"]["num_dynamo_traces"] == 0
    assert warm["counters"]["num_traced_graphs_loaded"] == 1
    assert warm["counters"]["num_traced_graphs_saved"] == 0
    assert warm["counters"]["num_graphs_seen"] == 0  # no graph came from Dynamo
    assert warm["counters"]["num_backend_compilations"] == SPLIT_LAYERS[model] + 1
    # Each capture size is captured the same way after a load as after a trace.
    assert warm["counters"]["num_cudagraph_captured"] == cold["counters"]["num_cudagraph_captured"]
    if platform == "simgraph":
        assert warm["counters"]["num_cudagraph_captured"] > 0
    assert warm["token_ids"] == cold["token_ids"]
    assert warm["logprobs"] == cold["logprobs"]
    assert all(len(tokens) == 8 for tokens in warm["token_ids"])
