"""Engine arguments (vLLM's names) -> ``EngineConfig``: model sources, validation.

``build_engine_config(model, compilation_config=None, **engine_args)`` is what ``LLM`` and the CLI
call; unknown arguments are an error that lists the known ones.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

from pieceworks.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode
from pieceworks.kernels.programmatic_launch import inductor_launch_options
from pieceworks.models.loading.config_checks import check_hf_config, check_tensor_parallel
from pieceworks.models.loading.config_defaults import with_architecture_defaults
from pieceworks.models.loading.presets import is_preset
from pieceworks.models.loading.sources import model_hf_config
from pieceworks.models.registry import is_hybrid


@dataclasses.dataclass
class EngineArgs:
    """Everything a user may pass to ``LLM(...)`` besides the model and compilation config."""

    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    quantization: str | None = None
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    mamba_ssm_cache_dtype: str = "float32"
    tokenizer: str | None = None
    async_scheduling: bool = True
    num_scheduler_steps: int = 1
    scheduling_policy: str = "fcfs"
    speculative_config: Any = None  # vLLM's dict (or its JSON text); see SpeculativeConfig
    enable_prefix_caching: bool = True
    # vLLM's --hf-overrides: config.json fields replaced (nested objects merged) before the
    # config is checked; a dict or its JSON text.
    hf_overrides: Any = None


def resolve_hf_config(model: str) -> dict[str, Any]:
    """The config.json dict of a preset, an HF directory, a GGUF file or ``smollm2-135m``."""
    return model_hf_config(model)


def apply_hf_overrides(hf_config: dict[str, Any], overrides: Any) -> dict[str, Any]:
    """``hf_config`` with ``overrides`` (a dict or its JSON text) merged in as vLLM's
    ``hf_overrides``: a nested object updates the config's object key by key, any other value
    replaces the field. The result is checked as the model's own config is, so an override of a
    field pieceworks does not implement is refused naming it."""
    if overrides is None:
        return hf_config
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"hf_overrides {overrides!r} is not valid JSON ({error}); pass an object of "
                """config.json fields such as '{"tie_word_embeddings": true}'"""
            ) from None
    if not isinstance(overrides, dict):
        raise ValueError(
            f"hf_overrides must be an object of config.json fields, not "
            f"{type(overrides).__name__} {overrides!r}"
        )
    merged = copy.deepcopy(hf_config)
    _merge(merged, overrides)
    return merged


def _merge(config: dict[str, Any], overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge(config[key], value)
        else:
            config[key] = copy.deepcopy(value)


def config_source(model: str) -> str:
    """Where a model's config comes from, as error messages name it."""
    if is_preset(model):
        return f"preset {model!r}"
    return os.path.join(model, "config.json") if os.path.isdir(model) else model


def _compilation(compilation_config: Any, enforce_eager: bool) -> CompilationConfig:
    if isinstance(compilation_config, CompilationConfig):
        # A copy: engines never share the layers each registers, nor the sizes each finalises.
        config = dataclasses.replace(compilation_config, static_forward_context={}, _pad_table=[])
    elif isinstance(compilation_config, int) and not isinstance(compilation_config, bool):
        config = CompilationConfig.from_fields({"level": compilation_config})
    else:
        config = CompilationConfig.from_fields(compilation_config or {})
    if enforce_eager:  # vLLM's meaning: no compilation, no graphs
        config.level, config.cudagraph_mode = CompilationLevel.NO_COMPILATION, CUDAGraphMode.NONE
    # Inductor's kernels launch as pieceworks' do (PDL); the user's own entries win. A new dict:
    # the caller's config keeps its own.
    config.inductor_compile_config = {**inductor_launch_options(), **config.inductor_compile_config}
    return config


def build_engine_config(
    model: str, compilation_config: Any = None, **engine_args: Any
) -> EngineConfig:
    known = {field.name for field in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
    args = EngineArgs(**engine_args)
    hf_config = apply_hf_overrides(resolve_hf_config(model), args.hf_overrides)
    source = config_source(model) + (" with hf_overrides" if args.hf_overrides else "")
    check_hf_config(hf_config, source=source)
    check_tensor_parallel(hf_config, args.tensor_parallel_size, source)
    if args.speculative_config is not None:
        check_not_hybrid(hf_config, model)
    model_config = ModelConfig(
        model=model,
        hf_config=with_architecture_defaults(hf_config),  # absent fields: transformers' values
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        quantization=args.quantization,
        tokenizer=args.tokenizer,
    )
    max_model_len = model_config.max_model_len or 0
    max_batched = args.max_num_batched_tokens or max(2048, args.max_num_seqs)
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=min(max_batched, max(max_model_len, 1) * args.max_num_seqs),
            async_scheduling=args.async_scheduling,
            num_scheduler_steps=args.num_scheduler_steps,
            policy=args.scheduling_policy,
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        compilation_config=_compilation(compilation_config, args.enforce_eager),
        speculative_config=args.speculative_config,
    )


def draft_engine_config(config: EngineConfig) -> EngineConfig | None:
    """The draft model's engine config for ``speculative_config`` method ``draft_model`` (None
    otherwise): the target's settings (dtype, lengths, KV block size, batch limits, compilation)
    for the draft checkpoint, scheduled synchronously. A draft of another vocabulary, or a hybrid
    (Mamba) draft whose state cannot be rewound, is refused naming it."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None
    hf_config = resolve_hf_config(spec.model)
    check_hf_config(hf_config, source=config_source(spec.model))
    target_vocab = config.model_config.hf_config.get("vocab_size")
    if hf_config.get("vocab_size") != target_vocab:
        raise ValueError(
            f"speculative_config model {spec.model!r} has a vocabulary of "
            f"{hf_config.get('vocab_size')} tokens, the target {target_vocab}; a draft model "
            "must share the target's vocabulary"
        )
    check_not_hybrid(hf_config, spec.model)
    model = config.model_config
    return EngineConfig(
        model_config=ModelConfig(
            model=spec.model,
            hf_config=with_architecture_defaults(hf_config),
            dtype=model.dtype,
            max_model_len=model.max_model_len,
            seed=model.seed,
        ),
        cache_config=dataclasses.replace(config.cache_config),
        scheduler_config=dataclasses.replace(config.scheduler_config, async_scheduling=False),
        parallel_config=dataclasses.replace(config.parallel_config),
        compilation_config=_compilation(config.compilation_config, enforce_eager=False),
    )


def check_not_hybrid(hf_config: dict[str, Any], model: str) -> None:
    """Refuse speculative decoding for a hybrid model (target or draft): its recurrent state
    cannot be rewound past rejected tokens."""
    if is_hybrid(hf_config):
        raise ValueError(
            f"speculative decoding cannot run {model!r}: a hybrid (recurrent-state) model's "
            "state cannot be rewound past rejected tokens; drop speculative_config or use a "
            "transformer model"
        )
