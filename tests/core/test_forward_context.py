"""The forward context: what ``set_forward_context`` makes visible to the ops, and for how long.

Proves: outside a block no context is available; inside, the ops read the step's metadata, the
config's layers, the runtime mode and the batch descriptor (defaults: no graph mode, no
descriptor); a nested block shadows the outer one and the outer one is back when it ends, also
after an exception; a descriptor's general form keeps the token count and drops uniform decode.
Run: pytest tests/core/test_forward_context.py
"""

from __future__ import annotations

import pytest

from pieceworks.config import EngineConfig
from pieceworks.core.config import CompilationConfig, CUDAGraphMode
from pieceworks.core.forward_context import (
    BatchDescriptor,
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)


def test_the_block_makes_the_step_visible_and_nested_blocks_restore_the_outer_one():
    layers = {"layers.0.attn": object()}
    config = EngineConfig(compilation_config=CompilationConfig(static_forward_context=layers))
    assert not is_forward_context_available()
    with set_forward_context("outer metadata", config) as outer:
        assert is_forward_context_available()
        assert get_forward_context() is outer
        assert outer.no_compile_layers is layers
        assert outer.attn_metadata == "outer metadata"
        assert outer.cudagraph_runtime_mode == CUDAGraphMode.NONE
        assert outer.batch_descriptor is None
        descriptor = BatchDescriptor(8, uniform_decode=True)
        with (
            pytest.raises(KeyError),
            set_forward_context(
                "inner metadata",
                config,
                cudagraph_runtime_mode=CUDAGraphMode.FULL,
                batch_descriptor=descriptor,
            ) as inner,
        ):
            assert get_forward_context() is inner
            assert (inner.attn_metadata, inner.batch_descriptor) == ("inner metadata", descriptor)
            assert inner.cudagraph_runtime_mode == CUDAGraphMode.FULL
            raise KeyError("a failing step")
        assert get_forward_context() is outer
    assert not is_forward_context_available()


def test_a_descriptor_s_general_form_keeps_the_token_count():
    descriptor = BatchDescriptor(16, uniform_decode=True)
    assert descriptor.non_uniform == BatchDescriptor(16, uniform_decode=False)
    assert BatchDescriptor(16) == BatchDescriptor(16, uniform_decode=False)
    assert descriptor != descriptor.non_uniform
