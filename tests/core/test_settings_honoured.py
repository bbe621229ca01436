"""Capture-size and compile-switch settings are honoured or refused, as a vLLM user expects.

An empty capture-size list with a graph mode on is refused; capture sizes above the token budget
are dropped with a log line; the default grid stops at ``max_cudagraph_capture_size`` (512 unless
set) and at ``max_num_batched_tokens``; a compile size no step can reach is refused; and with
torch's compiler off (``TORCH_COMPILE_DISABLE=1``, set before or after torch was imported) the
engine runs the model uncompiled, without static graphs, and says so.

Run: pytest tests/core/test_settings_honoured.py
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode


@pytest.fixture
def pieceworks_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    logging.getLogger("pieceworks").propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="pieceworks"):
            yield caplog
    finally:
        logging.getLogger("pieceworks").propagate = False


def engine_config(
    max_num_seqs: int = 4, max_num_batched_tokens: int = 2048, **compilation: object
) -> EngineConfig:
    return EngineConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        compilation_config=CompilationConfig(**compilation),  # type: ignore[arg-type]
    )


# --- capture sizes ---------------------------------------------------------------------------


def test_empty_capture_sizes_with_a_graph_mode_are_refused():
    with pytest.raises(ValueError) as refused:
        CompilationConfig(cudagraph_capture_sizes=[], cudagraph_mode="FULL_AND_PIECEWISE")
    assert str(refused.value) == (
        "cudagraph_capture_sizes=[] with cudagraph_mode FULL_AND_PIECEWISE would capture no "
        "graph; give the sizes to capture (e.g. [1, 2, 4, 8]), leave cudagraph_capture_sizes "
        "unset for the default grid, or set cudagraph_mode NONE"
    )
    assert CompilationConfig(cudagraph_capture_sizes=[], cudagraph_mode="NONE")


def test_empty_capture_sizes_with_the_default_mode_turn_graphs_off():
    # no mode asked for: an empty list asks for no graphs, as cudagraph_mode NONE does
    config = CompilationConfig(level=3, cudagraph_capture_sizes=[])
    assert config.cudagraph_mode == CUDAGraphMode.NONE


def test_capture_sizes_above_the_token_budget_are_dropped_with_a_log(pieceworks_logs):
    config = engine_config(
        max_num_seqs=4, max_num_batched_tokens=8, cudagraph_capture_sizes=[1, 2, 4, 15]
    )
    compilation = config.compilation_config
    assert compilation.cudagraph_capture_sizes == [1, 2, 4]
    assert compilation.max_capture_size == 4
    dropped = [r.getMessage() for r in pieceworks_logs.records if "dropped" in r.getMessage()]
    assert dropped == [
        "cudagraph_capture_sizes [15] dropped: above 8 (max_num_batched_tokens=8, "
        "max_cudagraph_capture_size=None), no step runs that many tokens"
    ]


def test_capture_sizes_all_above_the_budget_are_refused():
    with pytest.raises(ValueError, match="every cudagraph_capture_sizes entry of \\[16, 32\\]"):
        engine_config(max_num_batched_tokens=8, cudagraph_capture_sizes=[16, 32])


def test_default_grid_stops_at_512_and_at_the_token_budget():
    wide = engine_config(max_num_seqs=2048).compilation_config
    assert wide.cudagraph_capture_sizes is not None
    assert wide.cudagraph_capture_sizes[-1] == 512
    assert len(wide.cudagraph_capture_sizes) == 3 + 512 // 8
    tight = engine_config(max_num_seqs=6, max_num_batched_tokens=6).compilation_config
    assert tight.cudagraph_capture_sizes == [1, 2, 4]  # 8 > the 6-token budget


def test_max_cudagraph_capture_size_sets_the_ceiling():
    lower = engine_config(max_num_seqs=64, max_cudagraph_capture_size=16).compilation_config
    assert lower.cudagraph_capture_sizes == [1, 2, 4, 8, 16]
    # Set above max_num_seqs, the default grid reaches it (mixed batches are larger than decode).
    higher = engine_config(max_num_seqs=4, max_cudagraph_capture_size=32).compilation_config
    assert higher.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 24, 32]
    given = engine_config(cudagraph_capture_sizes=[1, 8, 64], max_cudagraph_capture_size=8)
    assert given.compilation_config.cudagraph_capture_sizes == [1, 8]
    with pytest.raises(ValueError, match="max_cudagraph_capture_size=0 must be a positive int"):
        CompilationConfig(max_cudagraph_capture_size=0)


def test_a_compile_size_above_the_budget_is_refused():
    with pytest.raises(ValueError) as refused:
        engine_config(
            max_num_batched_tokens=8, cudagraph_capture_sizes=[1, 2, 16], compile_sizes=[16]
        )
    assert str(refused.value) == (
        "compile_sizes entry 16 is above the largest batch a step can run or capture (8: "
        "max_num_batched_tokens=8, max_cudagraph_capture_size=None); remove it or raise the limit"
    )


# --- TORCH_COMPILE_DISABLE -------------------------------------------------------------------


def test_torch_compile_disable_set_in_the_process_runs_uncompiled(monkeypatch, pieceworks_logs):
    import torch  # noqa: F401  (the variable is set after torch was imported)

    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    compilation = engine_config(level=3).compilation_config
    assert compilation.level == CompilationLevel.NO_COMPILATION
    assert compilation.cudagraph_mode == CUDAGraphMode.NONE
    lines = [r.getMessage() for r in pieceworks_logs.records if "uncompiled" in r.getMessage()]
    assert lines == [
        "torch's compiler is off (TORCH_COMPILE_DISABLE): the model runs uncompiled "
        "(level 3 -> 0, cudagraph_mode FULL_AND_PIECEWISE -> NONE)"
    ]


def test_torch_dynamo_config_disable_runs_uncompiled(monkeypatch):
    import torch._dynamo.config

    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    with torch._dynamo.config.patch(disable=True):  # (monkeypatch's undo deletes the entry)
        compilation = engine_config(level=3).compilation_config
    assert compilation.level == CompilationLevel.NO_COMPILATION


def test_compile_stays_on_without_the_switch(monkeypatch):
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    assert engine_config(level=3).compilation_config.level == CompilationLevel.PIECEWISE


def test_the_report_says_why_every_mode_ran_eager(monkeypatch):
    from pieceworks.benchmarks.report import format_notes

    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    assert format_notes([], []) == (
        "TORCH_COMPILE_DISABLE=1: torch's compiler is off, so every mode ran uncompiled "
        "(level 0, no static graphs)"
    )


_LEVEL_3_TOY_MODEL = """
import torch
from pieceworks.config import EngineConfig
from pieceworks.core.config import CompilationConfig
from pieceworks.core.counters import compilation_counter
from pieceworks.core.forward_context import set_forward_context
from tests.core.toy_model import SILLY_OP, ToyModel

compilation = CompilationConfig(level=3, backend="eager", splitting_ops=[SILLY_OP])
config = EngineConfig(compilation_config=compilation)
with compilation_counter.expect(num_models_seen=0, num_graphs_seen=0):
    model = ToyModel(config=config).requires_grad_(False)
    with set_forward_context(None, config):
        out = model(torch.randn(4, 8))
print(int(compilation.level), compilation.cudagraph_mode.name, tuple(out.shape))
"""


def test_torch_compile_disable_set_before_the_process_starts():
    """The model runs eager instead of failing for want of a compiled frame."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-c", _LEVEL_3_TOY_MODEL],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "0 NONE (4, 8)"
