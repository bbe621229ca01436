"""The runs of the float32 GPU checks against HF (``test_llama_hf_gpu.py``, ``test_bamba_gpu.py``),
which tell the parts of the GPU path apart when the logits leave HF's: FULL_AND_PIECEWISE graphs,
level 0 with the kernels the platform chooses, the same launched without programmatic dependent
launch (``PIECEWORKS_PDL=0``: each kernel starts after the one before has finished, whatever it
reads before its wait), and level 0 with every kernel op in its torch form (``custom_ops=["none"]``;
attention stays the platform's)."""

from __future__ import annotations

import pytest

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.engine.llm import LLM
from pieceworks.kernels import programmatic_launch

RUNS = {
    "full_and_piecewise": lambda: compilation_for_mode("full_and_piecewise"),
    "level0-kernels": lambda: {"level": 0},
    "level0-kernels-no-pdl": lambda: {"level": 0},
    "level0-torch-ops": lambda: {"level": 0, "custom_ops": ["none"]},
}


def float32_llm(
    path: str, run: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> LLM:
    """The float32 engine of the checkpoint at ``path`` for ``run`` (4 sequences, 24 tokens a
    step), with programmatic dependent launch off for the no-pdl run (the decision is made once
    per process: it is read again now, and again after the test)."""
    no_pdl = run.endswith("no-pdl")
    if no_pdl:
        monkeypatch.setenv("PIECEWORKS_PDL", "0")
    programmatic_launch.programmatic_launch_enabled.cache_clear()
    request.addfinalizer(programmatic_launch.programmatic_launch_enabled.cache_clear)
    if no_pdl:
        assert not programmatic_launch.programmatic_launch_enabled()
    return LLM(
        path,
        compilation_config=RUNS[run](),
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=24,
    )
