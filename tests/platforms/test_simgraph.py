"""The example out-of-tree platform enforces the static-address contract of real device graphs.

A caller that copies new values into the captured input buffer gets fresh results; one that hands
a fresh tensor gets the captured, stale result, exactly as with a CUDA graph.
Run: pytest tests/platforms/test_simgraph.py   (needs: pip install -e examples/pieceworks-simgraph)
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.config import EngineConfig
from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.forward_context import BatchDescriptor, set_forward_context

pytestmark = pytest.mark.platform_agnostic

simgraph = pytest.importorskip("pieceworks_simgraph.wrapper")


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_replay_reads_the_captured_buffer_not_the_argument(simgraph_platform):
    config = EngineConfig()
    wrapper = simgraph.SimGraphWrapper(_double, config, CUDAGraphMode.PIECEWISE)
    static_input = torch.arange(4.0)
    descriptor = BatchDescriptor(num_tokens=4)
    with set_forward_context(
        None, config, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE, batch_descriptor=descriptor
    ):
        with compilation_counter.expect(num_cudagraph_captured=1):
            captured = wrapper(static_input)
        assert torch.equal(captured, torch.arange(4.0) * 2)

        static_input.copy_(torch.full((4,), 5.0))  # the right way: copy into the buffer
        assert torch.equal(wrapper(static_input), torch.full((4,), 10.0))

        fresh = torch.full((4,), 7.0)  # the wrong way: a new tensor at a new address
        with compilation_counter.expect(num_cudagraph_captured=0):
            stale = wrapper(fresh)
        assert torch.equal(stale, torch.full((4,), 10.0))  # the captured input, not 7 * 2


def test_other_runtime_mode_calls_through(simgraph_platform):
    config = EngineConfig()
    wrapper = simgraph.SimGraphWrapper(_double, config, CUDAGraphMode.FULL)
    with set_forward_context(
        None,
        config,
        cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
        batch_descriptor=BatchDescriptor(2),
    ):
        with compilation_counter.expect(num_cudagraph_captured=0):
            assert torch.equal(wrapper(torch.ones(2)), torch.full((2,), 2.0))
    assert wrapper.entries == {}
