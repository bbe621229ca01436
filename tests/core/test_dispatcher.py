"""``CudagraphDispatcher``: key tables per graph mode and the four-step dispatch order.

Run: pytest tests/core/test_dispatcher.py
"""

from __future__ import annotations

import pytest

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.config import CompilationConfig, CUDAGraphMode
from pieceworks.core.cudagraph_dispatcher import CudagraphDispatcher
from pieceworks.core.forward_context import BatchDescriptor as BD

pytestmark = pytest.mark.platform_agnostic
FULL, PIECEWISE, NONE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE


def dispatcher(mode: CUDAGraphMode, graph_platform) -> CudagraphDispatcher:
    compilation = CompilationConfig(
        backend="eager", cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8]
    )
    return CudagraphDispatcher(
        EngineConfig(
            scheduler_config=SchedulerConfig(max_num_seqs=4), compilation_config=compilation
        )
    )


def test_full_and_piecewise(graph_platform):
    d = dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, graph_platform)
    assert d.cudagraph_keys[FULL] == {BD(s, True) for s in (1, 2, 4)}  # decode: <= max_num_seqs
    assert d.cudagraph_keys[PIECEWISE] == {BD(s) for s in (1, 2, 4, 8)}
    assert d.dispatch(BD(4, True)) == (FULL, BD(4, True))
    assert d.dispatch(BD(8, True)) == (PIECEWISE, BD(8))
    assert d.dispatch(BD(4)) == (PIECEWISE, BD(4))
    assert d.dispatch(BD(16)) == (NONE, None)


def test_piecewise_only(graph_platform):
    d = dispatcher(CUDAGraphMode.PIECEWISE, graph_platform)
    assert d.cudagraph_keys[FULL] == set()
    assert d.dispatch(BD(2, True)) == (PIECEWISE, BD(2))


def test_full_only(graph_platform):
    # General graphs for every size, and decode graphs (the split-KV decode kernel) up to
    # max_num_seqs, as FULL_AND_PIECEWISE has them.
    d = dispatcher(CUDAGraphMode.FULL, graph_platform)
    assert d.cudagraph_keys[FULL] == {BD(s) for s in (1, 2, 4, 8)} | {
        BD(s, True) for s in (1, 2, 4)
    }
    assert d.dispatch(BD(2, True)) == (FULL, BD(2, True))
    assert d.dispatch(BD(2)) == (FULL, BD(2))
    assert d.dispatch(BD(8, True)) == (FULL, BD(8))  # step 2: FULL for the general batch
    assert d.cudagraph_keys[PIECEWISE] == set()


def test_full_decode_only(graph_platform):
    d = dispatcher(CUDAGraphMode.FULL_DECODE_ONLY, graph_platform)
    assert d.dispatch(BD(2, True)) == (FULL, BD(2, True))
    assert d.dispatch(BD(2)) == (NONE, None)
    assert d.dispatch(BD(8, True)) == (NONE, None)  # a decode graph serves <= max_num_seqs rows
    assert d.cudagraph_keys[PIECEWISE] == set()


def test_none(graph_platform):
    d = dispatcher(CUDAGraphMode.NONE, graph_platform)
    assert d.dispatch(BD(1, True)) == (NONE, None)
    assert d.capture_descriptors() == []


def test_capture_order_is_largest_first(graph_platform):
    d = dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, graph_platform)
    sizes = [desc.num_tokens for _, desc in d.capture_descriptors()]
    assert sizes == sorted(sizes, reverse=True)
    # Each size once per mode; at one size the FULL decode graph comes before the piecewise one.
    assert d.capture_descriptors() == [
        (PIECEWISE, BD(8)),
        (FULL, BD(4, True)),
        (PIECEWISE, BD(4)),
        (FULL, BD(2, True)),
        (PIECEWISE, BD(2)),
        (FULL, BD(1, True)),
        (PIECEWISE, BD(1)),
    ]


def test_speculative_decoding_adds_full_keys_for_uniform_verify_batches(graph_platform):
    """k = 3: S sequences of 4 tokens for each decode size S whose 4 * S tokens fit a step."""
    compilation = CompilationConfig(
        backend="eager",
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=[1, 2, 4, 8],
    )
    config = EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8),
        compilation_config=compilation,
        speculative_config={"num_speculative_tokens": 3},
    )
    d = CudagraphDispatcher(config)
    verify = {BD(4, True, 4), BD(8, True, 4)}  # 1 and 2 sequences; 4 would be 16 tokens
    assert d.cudagraph_keys[FULL] == {BD(s, True) for s in (1, 2, 4)} | verify
    assert d.dispatch(BD(8, True, 4)) == (FULL, BD(8, True, 4))
    assert d.dispatch(BD(8, True)) == (PIECEWISE, BD(8))  # 8 decodes: more than max_num_seqs
