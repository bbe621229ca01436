"""``EngineConfig`` and its parts: model, cache, scheduler, parallel and compilation.

One object, passed explicitly to every constructor that needs configuration (no globals). An
EngineConfig can be built without a model (tests of the compile pipeline do this). The engine fills
``ModelConfig.hf_config`` from a preset or a checkpoint directory; this module reads no files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pieceworks import envs
from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode, PassConfig
from pieceworks.logger import init_logger
from pieceworks.speculative_config import SpeculativeConfig
from pieceworks.utils import hash_factors

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)

# ``SchedulerConfig.policy`` values: each names a policy in ``scheduler/policy.py``.
SCHEDULING_POLICIES = ("fcfs", "priority")

# Architectures whose linear layers take quantization="fp8".
FP8_ARCHITECTURES = ("LlamaForCausalLM",)

# dtype names a user may pass -> the torch dtype's attribute name (torch is imported on use, so
# that importing the configs, and the package root that imports them, stays light).
_DTYPES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float": "float32",
}


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict[str, Any] | None) -> torch.dtype:
    """vLLM's rule: "auto" takes the checkpoint's dtype, float32 checkpoints run in bfloat16."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        name = (hf_config or {}).get("torch_dtype") or (hf_config or {}).get("dtype") or "bfloat16"
        resolved = getattr(torch, _DTYPES.get(str(name).removeprefix("torch."), "bfloat16"))
        return torch.bfloat16 if resolved == torch.float32 else resolved
    if dtype not in _DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not supported; use 'auto', 'float32', 'bfloat16' or 'float16'"
        )
    return getattr(torch, _DTYPES[dtype])


@dataclasses.dataclass
class ModelConfig:
    """Which model, in which dtype, with which shape (``hf_config`` is the config.json dict)."""

    model: str = "llama-tiny"
    hf_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int = 0
    quantization: str | None = None  # None | "fp8"
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        self.dtype = resolve_dtype(self.dtype, self.hf_config)
        if self.quantization not in (None, "fp8"):
            raise ValueError(
                f"quantization={self.quantization!r} is not supported; use None or 'fp8'"
            )
        if self.quantization == "fp8" and self.architecture not in FP8_ARCHITECTURES:
            raise ValueError(
                f"quantization='fp8' is implemented for {', '.join(FP8_ARCHITECTURES)}, not "
                f"{self.architecture}; run it unquantized (quantization=None)"
            )
        limit = self.hf_config.get("max_position_embeddings")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(
                f"max_model_len={self.max_model_len!r} must be a positive integer (tokens of "
                "prompt plus output per request); raise --max-model-len or leave it unset"
            )
        if self.max_model_len is None:
            self.max_model_len = min(limit or 2048, 8192)
        elif limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}; lower --max-model-len"
            )

    @property
    def architecture(self) -> str:
        architectures = self.hf_config.get("architectures") or ["LlamaForCausalLM"]
        return architectures[0]


@dataclasses.dataclass
class CacheConfig:
    """Paged KV cache and Mamba state cache sizing."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    mamba_ssm_cache_dtype: str = "float32"  # "float32" | "auto" (model dtype)
    kv_cache_dtype: str = "auto"
    # At most this many bytes of KV cache (None: what gpu_memory_utilization leaves). Platforms
    # whose device memory is host RAM (the CPU) set a default: see check_and_update_config.
    kv_cache_memory_bytes: int | None = None
    # Reuse the KV of full blocks whose tokens an earlier request computed (docs/engine.md
    # "Prefix caching"); hybrid models with Mamba layers turn it off.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be a positive number "
                "of bytes (or None to size the KV cache from gpu_memory_utilization)"
            )
        if self.mamba_ssm_cache_dtype not in ("float32", "auto"):
            raise ValueError(
                f"mamba_ssm_cache_dtype={self.mamba_ssm_cache_dtype!r} is not supported; use "
                "'float32' or 'auto' (the model dtype)"
            )


@dataclasses.dataclass
class SchedulerConfig:
    """Continuous-batching limits per step."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # Schedule and launch step N+1 before step N's tokens reach the host (docs/engine.md).
    async_scheduling: bool = True
    # Decode steps run back to back on the device per host round trip when every scheduled
    # request decodes (vLLM's ``num_scheduler_steps``; docs/engine.md "Multi-step decode").
    num_scheduler_steps: int = 1
    # The order of the waiting queue and of preemption: "fcfs" or "priority" (vLLM's
    # ``scheduling_policy``; docs/engine.md "Scheduling policies").
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"SchedulerConfig.policy={self.policy!r} is not a scheduling policy; choose one "
                f"of {list(SCHEDULING_POLICIES)} (--scheduling-policy)"
            )
        if self.num_scheduler_steps < 1:
            raise ValueError(
                f"num_scheduler_steps={self.num_scheduler_steps} must be at least 1 "
                "(1: one decode step per host round trip)"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"max_num_seqs={self.max_num_seqs}: a full decode step would not "
                "fit; raise max_num_batched_tokens"
            )


@dataclasses.dataclass
class ParallelConfig:
    """Tensor parallelism: this process's rank among ``tensor_parallel_size``, and its device.

    ``local_rank`` is the device index on this host (default: ``rank``; under ``torchrun`` the
    ``LOCAL_RANK`` it sets).
    """

    tensor_parallel_size: int = 1
    rank: int = 0
    local_rank: int | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size}; it must be at least 1"
            )
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ValueError(
                f"rank {self.rank} outside tensor_parallel_size {self.tensor_parallel_size}"
            )
        if self.local_rank is None:
            self.local_rank = self.rank


class ConfigPlatform(Protocol):
    """What an EngineConfig asks of the platform it will run on: its adjustments, applied once
    when the config is built. ``pieceworks.platforms.Platform`` implements it; the configs sit
    below the platforms and never import them."""

    def check_and_update_config(self, config: EngineConfig) -> None: ...

    def apply_declared_defaults(self, config: EngineConfig) -> None: ...


# Returns the platform an EngineConfig is adjusted for; installed by the package root
# (``pieceworks/__init__.py``: ``current_platform``) before any module of the package runs.
_platform_provider: Callable[[], ConfigPlatform] | None = None


def set_platform_provider(provider: Callable[[], ConfigPlatform]) -> None:
    """Install the function that names the platform every new EngineConfig is adjusted for."""
    global _platform_provider
    _platform_provider = provider


@dataclasses.dataclass
class EngineConfig:
    """Everything that configures one engine; passed explicitly, never read from globals."""

    model_config: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    # None: no speculative decoding (docs/engine.md, "Speculative decoding").
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_fields(self.speculative_config)
        if self.speculative_config is not None:
            self._check_speculative()
        if envs.torch_compile_disabled():
            # torch.compile would return the model unchanged; run it as vLLM does, uncompiled.
            self.compilation_config.run_uncompiled(
                "torch's compiler is off (TORCH_COMPILE_DISABLE)"
            )
        scheduler = self.scheduler_config
        self.compilation_config.finalize_capture_sizes(
            scheduler.max_num_seqs, scheduler.max_num_batched_tokens
        )
        assert _platform_provider is not None, "installed by the pieceworks package on import"
        platform = _platform_provider()
        platform.check_and_update_config(self)
        platform.apply_declared_defaults(self)  # also where an override skipped the base class

    def _check_speculative(self) -> None:
        """Refuse what speculation does not implement. A draft model schedules synchronously
        (its mirrors follow every step); n-gram speculation keeps async scheduling, which the
        engine leaves for a host sync only before a step that may propose (a proposal needs the
        last token on the host) and after one that verifies (``EngineCore._step``)."""
        assert self.speculative_config is not None
        self.speculative_config.check_engine(self)
        draft = self.speculative_config.method == "draft_model"
        if draft and self.scheduler_config.async_scheduling:
            self.scheduler_config.async_scheduling = False
            logger.info("a draft model proposes after every step: async_scheduling off")

    def compute_hash(self) -> str:
        """Hash of every field that changes compiled code."""
        return hash_factors(self.compute_factors())

    def compute_factors(self) -> dict[str, Any]:
        """Every field that changes compiled code, by name (what ``compute_hash`` hashes)."""
        model = self.model_config
        return {
            "hf_config": model.hf_config,
            "dtype": str(model.dtype),
            "quantization": model.quantization,
            "max_model_len": model.max_model_len,
            "block_size": self.cache_config.block_size,
            "kv_cache_dtype": self.cache_config.kv_cache_dtype,
            "mamba_ssm_cache_dtype": self.cache_config.mamba_ssm_cache_dtype,
            "tensor_parallel_size": self.parallel_config.tensor_parallel_size,
            "compilation": self.compilation_config.compute_factors(),
        }


__all__ = [
    "CUDAGraphMode",
    "CacheConfig",
    "CompilationConfig",
    "CompilationLevel",
    "ConfigPlatform",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "PassConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "resolve_dtype",
    "set_platform_provider",
]
