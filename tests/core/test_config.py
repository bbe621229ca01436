"""Compilation config: defaults, capture-size grid and padding table, validation messages.

Run: pytest tests/core/test_config.py
"""

from __future__ import annotations

import logging

import pytest

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.config import (
    ATTENTION_OP,
    MAMBA_MIXER2_OP,
    CompilationConfig,
    CompilationLevel,
    CUDAGraphMode,
    default_capture_sizes,
)


def test_graph_mode_routines():
    assert CUDAGraphMode.FULL_AND_PIECEWISE.decode_mode() == CUDAGraphMode.FULL
    assert CUDAGraphMode.FULL_AND_PIECEWISE.mixed_mode() == CUDAGraphMode.PIECEWISE
    assert CUDAGraphMode.FULL_DECODE_ONLY.mixed_mode() == CUDAGraphMode.NONE
    assert CUDAGraphMode.PIECEWISE.decode_mode() == CUDAGraphMode.PIECEWISE


def test_default_capture_grid():
    assert default_capture_sizes(1) == [1, 2, 4, 8]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 24]


def test_padding_table():
    config = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=20))
    compilation = config.compilation_config
    assert [compilation.pad_for_cudagraph(n) for n in (1, 3, 5, 9, 17, 24)] == [1, 4, 8, 16, 24, 24]
    assert compilation.max_capture_size == 24
    with pytest.raises(ValueError, match="exceed the largest capture size"):
        compilation.pad_for_cudagraph(25)


def test_defaults():
    compilation = CompilationConfig()
    assert compilation.level == CompilationLevel.PIECEWISE
    assert compilation.splitting_ops == [ATTENTION_OP, MAMBA_MIXER2_OP]
    assert compilation.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert CompilationConfig(level=1).cudagraph_mode == CUDAGraphMode.NONE


def test_compile_size_must_be_a_capture_size():
    with pytest.raises(ValueError, match="compile_sizes entry 3 is not a capture size"):
        EngineConfig(
            compilation_config=CompilationConfig(
                cudagraph_capture_sizes=[1, 2, 4], compile_sizes=[3]
            )
        )


@pytest.mark.parametrize(
    "sizes,message", [([1, 2, 2], "duplicates"), ([4, 1, 2], "sorted"), ([0, 1], "positive")]
)
def test_capture_sizes_validated(sizes, message):
    with pytest.raises(ValueError, match=message):
        CompilationConfig(cudagraph_capture_sizes=sizes)


def test_piecewise_with_empty_splitting_ops_promoted_to_full(caplog):
    logging.getLogger("pieceworks").propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="pieceworks"):
            config = CompilationConfig(splitting_ops=[], cudagraph_mode="piecewise")
    finally:
        logging.getLogger("pieceworks").propagate = False
    assert config.cudagraph_mode == CUDAGraphMode.FULL
    assert "promoted to FULL" in caplog.text


def test_piecewise_graphs_need_level_3():
    with pytest.raises(ValueError, match="needs level 3"):
        CompilationConfig(level=2, cudagraph_mode=CUDAGraphMode.PIECEWISE)


def test_platform_without_graphs_turns_them_off(caplog, monkeypatch):
    from pieceworks import platforms
    from pieceworks.platforms.cpu import CpuPlatform

    monkeypatch.setattr(platforms, "_current", CpuPlatform())
    logging.getLogger("pieceworks").propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="pieceworks"):
            config = EngineConfig()
    finally:
        logging.getLogger("pieceworks").propagate = False
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert "has no static graphs" in caplog.text
    assert config.compilation_config.backend == "inductor"


def test_hash_changes_with_compiled_fields_only():
    base = CompilationConfig(backend="eager")
    assert base.compute_hash() == CompilationConfig(backend="eager").compute_hash()
    assert base.compute_hash() != CompilationConfig(backend="inductor").compute_hash()
    same = CompilationConfig(backend="eager", cudagraph_capture_sizes=[1, 2])
    assert base.compute_hash() == same.compute_hash()


def test_bad_backend_message():
    with pytest.raises(ValueError, match="use 'inductor' or 'eager'"):
        CompilationConfig(backend="tvm")


def test_a_bad_level_or_mode_names_the_field_and_every_choice():
    with pytest.raises(ValueError) as level:
        CompilationConfig(level="high")
    assert str(level.value) == (
        "CompilationConfig.level='high' is not valid; use one of: 0 (NO_COMPILATION), "
        "1 (DYNAMO_AS_IS), 2 (DYNAMO_ONCE), 3 (PIECEWISE)"
    )
    with pytest.raises(ValueError) as mode:
        CompilationConfig(cudagraph_mode=True)  # a bool is not the int 1
    assert str(mode.value) == (
        "CompilationConfig.cudagraph_mode=True is not valid; use one of: 0 (NONE), "
        "1 (PIECEWISE), 2 (FULL), FULL_DECODE_ONLY, FULL_AND_PIECEWISE"
    )


def test_from_fields_refuses_unknown_names_and_non_dicts_listing_the_fields():
    fields = (
        "level, backend, splitting_ops, cudagraph_mode, cudagraph_capture_sizes, compile_sizes, "
        "cudagraph_num_of_warmups, cudagraph_copy_inputs, custom_ops, pass_config, cache_dir, "
        "debug_dump_path, inductor_compile_config"
    )
    assert CompilationConfig.from_fields({"level": 1}).level == CompilationLevel.DYNAMO_AS_IS
    with pytest.raises(ValueError) as unknown:
        CompilationConfig.from_fields({"foo": 1, "bar": 2, "level": 1})
    assert str(unknown.value) == (
        f"unknown CompilationConfig field(s) 'bar', 'foo'; valid fields: {fields}"
    )
    with pytest.raises(ValueError, match="'static_forward_context'; valid"):
        CompilationConfig.from_fields({"static_forward_context": {}})  # set by the engine
    with pytest.raises(ValueError) as not_a_dict:
        CompilationConfig.from_fields([1])
    assert str(not_a_dict.value) == (
        "the compilation config must be a JSON object / dict of CompilationConfig fields "
        f'(e.g. {{"level": 3}}), not list [1]; fields: {fields}'
    )
