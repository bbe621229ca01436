"""Compilation config: defaults, capture-size grid and padding table, validation messages.

Every refusal and the two logged decisions (a piecewise mode promoted to FULL, fusion without
no-op elimination) read in full; what each graph mode captures; levels and modes read from
names in any case and from ints; the compiled fields by name (what the cache key hashes); and
how ``custom_ops`` entries decide before a kernel's default.

Run: pytest tests/core/test_config.py
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.config import (
    ATTENTION_OP,
    GATED_DELTA_NET_OP,
    MAMBA_MIXER2_OP,
    CompilationConfig,
    CompilationLevel,
    CUDAGraphMode,
    PassConfig,
    default_capture_sizes,
)
from pieceworks.utils import hash_factors


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
    assert compilation.splitting_ops == [ATTENTION_OP, MAMBA_MIXER2_OP, GATED_DELTA_NET_OP]
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
        "level, backend, splitting_ops, cudagraph_mode, cudagraph_capture_sizes, "
        "max_cudagraph_capture_size, compile_sizes, cudagraph_num_of_warmups, "
        "cudagraph_copy_inputs, custom_ops, pass_config, cache_dir, "
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


def test_each_refusal_reads_in_full():
    refusals = [
        (
            lambda: CompilationConfig(cudagraph_capture_sizes=[0, 1]),
            "cudagraph_capture_sizes must be positive ints, got [0, 1]",
        ),
        (
            lambda: CompilationConfig(cudagraph_capture_sizes=[1, 2.0]),
            "cudagraph_capture_sizes must be positive ints, got [1, 2.0]",
        ),
        (
            lambda: CompilationConfig(cudagraph_capture_sizes=[1, 4, 4, 2]),
            "cudagraph_capture_sizes has duplicates: [1, 4, 4, 2]; use [1, 2, 4]",
        ),
        (
            lambda: CompilationConfig(cudagraph_capture_sizes=[4, 1, 2]),
            "cudagraph_capture_sizes must be sorted ascending, got [4, 1, 2]; use [1, 2, 4]",
        ),
        (
            lambda: CompilationConfig(backend="tvm"),
            "CompilationConfig.backend='tvm' is not supported; use 'inductor' or 'eager'",
        ),
        (
            lambda: CompilationConfig(custom_ops=["+rms_norm", "silu"]),
            "custom_ops entry 'silu': use 'all', 'none', '+name' or '-name'",
        ),
        (
            lambda: CompilationConfig(custom_ops=[""]),
            "custom_ops entry '': use 'all', 'none', '+name' or '-name'",
        ),
        (
            lambda: CompilationConfig(custom_ops=["-"]),
            "custom_ops entry '-': use 'all', 'none', '+name' or '-name'",
        ),
        (
            lambda: CompilationConfig(level=2, cudagraph_mode="full_and_piecewise"),
            "cudagraph_mode=FULL_AND_PIECEWISE captures pieces split at the splitting ops, which "
            "needs level 3 (PIECEWISE, compiled pieces) or level 0 (breakable graphs of the "
            "eager forward); got level 2. Use level=3 or level=0, or cudagraph_mode FULL / NONE.",
        ),
    ]
    for make, message in refusals:
        with pytest.raises(ValueError) as refused:
            make()
        assert str(refused.value) == message


def test_the_capture_size_refusals_of_a_finalized_config_read_in_full():
    compilation = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4], compile_sizes=[3])
    with pytest.raises(ValueError) as not_captured:
        compilation.finalize_capture_sizes(max_num_seqs=4)
    assert str(not_captured.value) == (
        "compile_sizes entry 3 is not a capture size; compile sizes must be among "
        "cudagraph_capture_sizes [1, 2, 4]"
    )
    compilation = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4], compile_sizes=[4])
    compilation.finalize_capture_sizes(max_num_seqs=4)
    with pytest.raises(ValueError) as too_many:
        compilation.pad_for_cudagraph(5)
    assert str(too_many.value) == "5 tokens exceed the largest capture size 4"
    assert CompilationConfig().max_capture_size == 0  # not finalized: no table yet
    defaulted = CompilationConfig()
    defaulted.finalize_capture_sizes(max_num_seqs=20)
    assert defaulted.cudagraph_capture_sizes == default_capture_sizes(20)


def test_a_duplicate_layer_prefix_is_refused_in_full():
    compilation = CompilationConfig()
    layer = object()
    compilation.register_layer("layers.0.attn", layer)
    assert compilation.static_forward_context == {"layers.0.attn": layer}
    with pytest.raises(ValueError) as refused:
        compilation.register_layer("layers.0.attn", object())
    assert str(refused.value) == (
        "duplicate layer name 'layers.0.attn': every attention / Mamba layer needs a unique prefix"
    )
    assert compilation.static_forward_context["layers.0.attn"] is layer


def pieceworks_records(caplog) -> list[tuple[int, str]]:
    """(level, message) of each pieceworks record, each once."""
    records = {id(r): r for r in caplog.records if r.name.startswith("pieceworks")}.values()
    return [(record.levelno, record.getMessage()) for record in records]


def test_the_promotion_and_the_fusion_warning_read_in_full(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.INFO, logger="pieceworks.core.config")
    CompilationConfig(splitting_ops=[], cudagraph_mode="full_and_piecewise")
    PassConfig(enable_noop=False, enable_fusion=True)
    PassConfig(enable_noop=False, enable_fusion=False)  # nothing to warn about
    assert pieceworks_records(caplog) == [
        (
            logging.INFO,
            "cudagraph_mode FULL_AND_PIECEWISE with empty splitting_ops has nothing to split: "
            "promoted to FULL (one graph for the whole model)",
        ),
        (
            logging.WARNING,
            "PassConfig: enable_fusion without enable_noop matches fewer patterns (reshapes "
            "between norm and quant hide them); set enable_noop=True",
        ),
    ]


def test_level_0_may_capture_breakable_graphs_and_full_needs_no_split():
    assert CompilationConfig(level=0, cudagraph_mode="piecewise").cudagraph_mode == (
        CUDAGraphMode.PIECEWISE
    )
    assert CompilationConfig(level=2, cudagraph_mode="full").cudagraph_mode == CUDAGraphMode.FULL
    no_split = CompilationConfig(splitting_ops=[], cudagraph_mode="full")
    assert no_split.cudagraph_mode == CUDAGraphMode.FULL
    assert CompilationConfig(level=0).cudagraph_mode == CUDAGraphMode.NONE


def test_each_graph_mode_says_what_it_captures():
    modes = {
        CUDAGraphMode.NONE: (False, False, False),
        CUDAGraphMode.PIECEWISE: (False, False, True),
        CUDAGraphMode.FULL: (False, True, False),
        CUDAGraphMode.FULL_DECODE_ONLY: (True, True, False),
        CUDAGraphMode.FULL_AND_PIECEWISE: (True, True, True),
    }
    for mode, expected in modes.items():
        said = (
            mode.separate_routine(),
            mode.has_full_cudagraphs(),
            mode.has_piecewise_cudagraphs(),
        )
        assert said == expected, mode
    assert CUDAGraphMode.FULL_DECODE_ONLY.decode_mode() == CUDAGraphMode.FULL
    assert CUDAGraphMode.NONE.mixed_mode() == CUDAGraphMode.NONE


def test_levels_and_modes_are_read_from_names_in_any_case_and_from_ints():
    assert CompilationConfig(level="piecewise").level == CompilationLevel.PIECEWISE
    assert CompilationConfig(level=2).level == CompilationLevel.DYNAMO_ONCE
    assert CompilationConfig(level="Dynamo_Once").level == CompilationLevel.DYNAMO_ONCE
    assert CompilationConfig(cudagraph_mode=2).cudagraph_mode == CUDAGraphMode.FULL
    assert CompilationConfig(level=3, cudagraph_mode="Full").cudagraph_mode == CUDAGraphMode.FULL


def test_the_compiled_fields_by_name():
    compilation = CompilationConfig(
        level=3,
        backend="eager",
        splitting_ops=["silly::attention"],
        compile_sizes=[4, 1],
        cudagraph_capture_sizes=[1, 2, 4],
        custom_ops=["+rms_norm"],
        pass_config={"enable_fusion": False},
        inductor_compile_config={"max_autotune": True},
    )
    assert compilation.pass_config == PassConfig(enable_fusion=False)
    assert compilation.compute_factors() == {
        "level": 3,
        "backend": "eager",
        "splitting_ops": ["silly::attention"],
        "compile_sizes": [1, 4],
        "custom_ops": ["+rms_norm"],
        "pass_config": dataclasses.asdict(PassConfig(enable_fusion=False)),
        "inductor_compile_config": {"max_autotune": True},
    }
    assert compilation.compute_hash() == hash_factors(compilation.compute_factors())


@pytest.mark.parametrize(
    "custom_ops, default, enabled",
    [
        ([], True, True),
        ([], False, False),
        (["all"], False, True),
        (["none"], True, False),
        (["all", "-rms_norm"], True, False),
        (["none", "+rms_norm"], False, True),
        (["+rms_norm", "-rms_norm"], False, True),  # "+name" is read first
        (["-silu"], True, True),  # another op's entry
    ],
)
def test_custom_ops_entries_decide_before_the_default(custom_ops, default, enabled):
    compilation = CompilationConfig(custom_ops=custom_ops)
    assert compilation.custom_op_enabled("rms_norm", default) is enabled
