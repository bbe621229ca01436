"""Compilation configuration: levels, static-graph modes, capture sizes and their validation.

``CompilationConfig`` is the compile half of ``EngineConfig``; it knows nothing about hardware. The
platform adjusts it once, in ``Platform.check_and_update_config`` (e.g. CPU turns graphs off).
Names follow vLLM's ``compilation/config.py`` so that a vLLM user maps them one to one.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import enum
from typing import Any

from pieceworks.logger import init_logger
from pieceworks.utils import hash_factors

logger = init_logger(__name__)

LIBRARY_NAMESPACE = "pieceworks"
ATTENTION_OP = f"{LIBRARY_NAMESPACE}::unified_attention_with_output"
MAMBA_MIXER2_OP = f"{LIBRARY_NAMESPACE}::mamba_mixer2"
GATED_DELTA_NET_OP = f"{LIBRARY_NAMESPACE}::gated_delta_net"


class CompilationLevel(enum.IntEnum):
    NO_COMPILATION = 0  # plain eager PyTorch
    DYNAMO_AS_IS = 1  # plain torch.compile: guards evaluated on every call, recompiles allowed
    DYNAMO_ONCE = 2  # trace once; later calls run the captured bytecode without guards
    PIECEWISE = 3  # trace once + split at the dynamic ops + compile each piece + static graphs


class CUDAGraphMode(enum.Enum):
    """Which static graphs to capture. Tuple members give (decode mode, mixed-batch mode)."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        """Mode for uniform decode batches (every sequence adds one token)."""
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        """Mode for every other batch (prefills, mixed prefill and decode)."""
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_full_cudagraphs(self) -> bool:
        return CUDAGraphMode.FULL in (self.decode_mode(), self.mixed_mode())

    def has_piecewise_cudagraphs(self) -> bool:
        return CUDAGraphMode.PIECEWISE in (self.decode_mode(), self.mixed_mode())


def _parse_enum(enum_cls: Any, value: Any, field: str) -> Any:
    """``value`` as a member of ``enum_cls``: a member, its name (any case) or its int value."""
    if value is None or isinstance(value, enum_cls):
        return value
    if isinstance(value, str) and value.upper() in enum_cls.__members__:
        return enum_cls[value.upper()]
    if isinstance(value, int) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            return enum_cls(value)
    choices = ", ".join(
        f"{m.value} ({m.name})" if isinstance(m.value, int) else m.name for m in enum_cls
    )
    raise ValueError(f"CompilationConfig.{field}={value!r} is not valid; use one of: {choices}")


# vLLM's default ceiling of the capture-size grid (``max_cudagraph_capture_size``): a larger batch
# runs its pieces uncaptured, where launch overhead no longer dominates.
DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE = 512


def default_capture_sizes(
    max_num_seqs: int, max_capture_size: int = DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE
) -> list[int]:
    """The seed's grid: 1, 2, 4, then steps of 8 up to the first multiple of 8 >= max_num_seqs;
    no size above ``max_capture_size``."""
    sizes = [1, 2, 4]
    sizes += list(range(8, ((max_num_seqs + 7) // 8) * 8 + 1, 8))
    return [size for size in sizes if size <= max_capture_size]


@dataclasses.dataclass
class PassConfig:
    """Which pieceworks Inductor passes run on every piece (see ``core/passes``)."""

    enable_noop: bool = True  # remove reshapes/slices that do nothing
    # RMSNorm (+ residual add) -> static FP8 quant fused into one op (why it is on by default:
    # docs/passes.md)
    enable_fusion: bool = True
    # The GEMV epilogue fusions on Dynamo's graph (core/passes/gemv_fusion.py): the gated
    # activation (and the next FP8 layer's input quantization) into the gate/up GEMV, the rotary
    # into the qkv GEMV. They match only where the layers run the GEMV ops, so on by default.
    enable_gemv_act_fusion: bool = True
    enable_rope_fusion: bool = True
    # The per-head q/k RMSNorm (Qwen3, Gemma 3) and the rotary after it, into the qkv GEMV's op.
    enable_qk_norm_rope_fusion: bool = True
    # Attention writing FP8 for an FP8 o_proj (core/passes/attn_quant_fusion.py), where the
    # platform's FP8 format is the attention kernels' e4m3fn.
    enable_attn_quant_fusion: bool = True

    def __post_init__(self) -> None:
        if self.enable_fusion and not self.enable_noop:
            logger.warning(
                "PassConfig: enable_fusion without enable_noop matches fewer patterns "
                "(reshapes between norm and quant hide them); set enable_noop=True"
            )


@dataclasses.dataclass
class CompilationConfig:
    """How the model is compiled and which static graphs are captured (vLLM's names)."""

    level: CompilationLevel = CompilationLevel.PIECEWISE
    backend: str | None = None  # "inductor" | "eager"; None: the platform's default
    splitting_ops: list[str] | None = None  # None: attention + mamba_mixer2 + gated_delta_net
    cudagraph_mode: CUDAGraphMode | None = None  # None: FULL_AND_PIECEWISE at level 3, else NONE
    cudagraph_capture_sizes: list[int] | None = None  # None: default_capture_sizes(max_num_seqs)
    # The largest capture size (vLLM's name): larger sizes are dropped, and the default grid
    # reaches it. None: the grid reaches max_num_seqs, at most 512. Never above
    # max_num_batched_tokens.
    max_cudagraph_capture_size: int | None = None
    compile_sizes: list[int] = dataclasses.field(default_factory=list)
    cudagraph_num_of_warmups: int = 1
    cudagraph_copy_inputs: bool = False
    custom_ops: list[str] = dataclasses.field(default_factory=list)
    pass_config: PassConfig = dataclasses.field(default_factory=PassConfig)
    cache_dir: str | None = None  # compile-cache root; None: PIECEWORKS_CACHE_ROOT
    debug_dump_path: str | None = None
    inductor_compile_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    # Layers that run outside the compiled graph (attention, Mamba mixers), by prefix; the custom
    # ops find their layer here at run time. Filled at model construction; not hashed.
    static_forward_context: dict[str, Any] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    # Filled by finalize_capture_sizes(); not user fields.
    _pad_table: list[int] = dataclasses.field(default_factory=list, repr=False)

    @classmethod
    def from_fields(cls, fields: Any) -> CompilationConfig:
        """A config from a dict of field names (``--compilation-config`` JSON, ``LLM(...)``).

        Anything but a dict, or a name that is not a field, is a ``ValueError`` that lists the
        fields.
        """
        names = [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]
        names.remove("static_forward_context")
        if not isinstance(fields, dict):
            raise ValueError(
                f"the compilation config must be a JSON object / dict of CompilationConfig "
                f'fields (e.g. {{"level": 3}}), not {type(fields).__name__} {fields!r}; '
                f"fields: {', '.join(names)}"
            )
        unknown = sorted(set(fields) - set(names))
        if unknown:
            raise ValueError(
                f"unknown CompilationConfig field(s) {', '.join(map(repr, unknown))}; "
                f"valid fields: {', '.join(names)}"
            )
        return cls(**fields)

    def __post_init__(self) -> None:
        self.level = _parse_enum(CompilationLevel, self.level, "level")
        self.cudagraph_mode = _parse_enum(CUDAGraphMode, self.cudagraph_mode, "cudagraph_mode")
        if isinstance(self.pass_config, dict):
            self.pass_config = PassConfig(**self.pass_config)
        if self.backend not in (None, "inductor", "eager"):
            raise ValueError(
                f"CompilationConfig.backend={self.backend!r} is not supported; "
                "use 'inductor' or 'eager'"
            )
        if self.splitting_ops is None:
            self.splitting_ops = [ATTENTION_OP, MAMBA_MIXER2_OP, GATED_DELTA_NET_OP]
        mode_given = self.cudagraph_mode is not None
        self._resolve_cudagraph_mode()
        for entry in self.custom_ops:
            # ("" and a bare sign are no names; ``"" in "+-"`` would let "" through.)
            if entry not in ("all", "none") and (entry[:1] not in ("+", "-") or len(entry) < 2):
                raise ValueError(
                    f"custom_ops entry {entry!r}: use 'all', 'none', '+name' or '-name'"
                )
        if self.cudagraph_capture_sizes is not None:
            self._validate_capture_sizes(self.cudagraph_capture_sizes)
            if not self.cudagraph_capture_sizes and self.cudagraph_mode != CUDAGraphMode.NONE:
                if mode_given:
                    raise ValueError(
                        f"cudagraph_capture_sizes=[] with cudagraph_mode "
                        f"{self.cudagraph_mode.name} would capture no graph; give the sizes to "
                        "capture (e.g. [1, 2, 4, 8]), leave cudagraph_capture_sizes unset for "
                        "the default grid, or set cudagraph_mode NONE"
                    )
                # the default mode: no sizes asked for means no static graphs
                logger.info("cudagraph_capture_sizes=[]: no static graphs (cudagraph_mode NONE)")
                self.cudagraph_mode = CUDAGraphMode.NONE
        ceiling = self.max_cudagraph_capture_size
        if ceiling is not None and (
            isinstance(ceiling, bool) or not isinstance(ceiling, int) or ceiling < 1
        ):
            raise ValueError(
                f"max_cudagraph_capture_size={ceiling!r} must be a positive int "
                "(or None for the default, 512)"
            )

    def run_uncompiled(self, reason: str) -> None:
        """Level 0 with no static graphs, because of ``reason`` (logged once, when it changes
        anything): what a vLLM user gets where torch's compiler is off."""
        if self.level == CompilationLevel.NO_COMPILATION and self.cudagraph_mode == (
            CUDAGraphMode.NONE
        ):
            return
        assert self.cudagraph_mode is not None  # resolved in __post_init__
        logger.info(
            "%s: the model runs uncompiled (level %d -> 0, cudagraph_mode %s -> NONE)",
            reason,
            int(self.level),
            self.cudagraph_mode.name,
        )
        self.level = CompilationLevel.NO_COMPILATION
        self.cudagraph_mode = CUDAGraphMode.NONE

    def _resolve_cudagraph_mode(self) -> None:
        if self.cudagraph_mode is None:
            piecewise = self.level == CompilationLevel.PIECEWISE
            self.cudagraph_mode = (
                CUDAGraphMode.FULL_AND_PIECEWISE if piecewise else CUDAGraphMode.NONE
            )
        mode = self.cudagraph_mode
        # Level 3 captures the pieces of the split graph; level 0 captures the eager forward as
        # breakable graphs, ended at each splitting op. Levels 1 and 2 have neither.
        piecewise_levels = (CompilationLevel.NO_COMPILATION, CompilationLevel.PIECEWISE)
        if mode.has_piecewise_cudagraphs() and self.level not in piecewise_levels:
            raise ValueError(
                f"cudagraph_mode={mode.name} captures pieces split at the splitting ops, which "
                f"needs level 3 (PIECEWISE, compiled pieces) or level 0 (breakable graphs of the "
                f"eager forward); got level {int(self.level)}. "
                "Use level=3 or level=0, or cudagraph_mode FULL / NONE."
            )
        if mode.has_piecewise_cudagraphs() and not self.splitting_ops:
            promoted = CUDAGraphMode.FULL
            logger.info(
                "cudagraph_mode %s with empty splitting_ops has nothing to split: "
                "promoted to %s (one graph for the whole model)",
                mode.name,
                promoted.name,
            )
            self.cudagraph_mode = promoted

    @staticmethod
    def _validate_capture_sizes(sizes: list[int]) -> None:
        if any(not isinstance(size, int) or size < 1 for size in sizes):
            raise ValueError(f"cudagraph_capture_sizes must be positive ints, got {sizes}")
        if len(set(sizes)) != len(sizes):
            raise ValueError(
                f"cudagraph_capture_sizes has duplicates: {sizes}; use {sorted(set(sizes))}"
            )
        if sizes != sorted(sizes):
            raise ValueError(
                f"cudagraph_capture_sizes must be sorted ascending, got {sizes}; "
                f"use {sorted(sizes)}"
            )

    def finalize_capture_sizes(
        self, max_num_seqs: int, max_num_batched_tokens: int | None = None
    ) -> None:
        """Fill the default capture sizes, drop those above the ceiling (``max_num_batched_tokens``
        and ``max_cudagraph_capture_size``: no step is ever that large), check compile_sizes,
        build the padding table."""
        ceiling = self.max_cudagraph_capture_size or DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE
        if max_num_batched_tokens is not None:
            ceiling = min(ceiling, max_num_batched_tokens)
        if self.cudagraph_capture_sizes is None:
            # The grid covers the decode batches (up to max_num_seqs), or as far as a
            # max_cudagraph_capture_size the user set; never past the ceiling.
            top = self.max_cudagraph_capture_size or max_num_seqs
            self.cudagraph_capture_sizes = default_capture_sizes(top, ceiling)
        else:
            self.cudagraph_capture_sizes = self._drop_sizes_above(
                self.cudagraph_capture_sizes, ceiling, max_num_batched_tokens
            )
        sizes = self.cudagraph_capture_sizes
        for size in self.compile_sizes:
            if size > ceiling:
                raise ValueError(
                    f"compile_sizes entry {size} is above the largest batch a step can run "
                    f"or capture ({ceiling}: max_num_batched_tokens={max_num_batched_tokens}, "
                    f"max_cudagraph_capture_size={self.max_cudagraph_capture_size}); remove it "
                    "or raise the limit"
                )
            if size not in sizes:
                raise ValueError(
                    f"compile_sizes entry {size} is not a capture size; "
                    f"compile sizes must be among cudagraph_capture_sizes {sizes}"
                )
        self._pad_table = list(sizes)

    def _drop_sizes_above(
        self, sizes: list[int], ceiling: int, max_num_batched_tokens: int | None
    ) -> list[int]:
        """``sizes`` without those above ``ceiling``, logged: a graph no step can use."""
        kept = [size for size in sizes if size <= ceiling]
        if len(kept) < len(sizes):
            logger.info(
                "cudagraph_capture_sizes %s dropped: above %d (max_num_batched_tokens=%s, "
                "max_cudagraph_capture_size=%s), no step runs that many tokens",
                [size for size in sizes if size > ceiling],
                ceiling,
                max_num_batched_tokens,
                self.max_cudagraph_capture_size,
            )
        if not kept and self.cudagraph_mode != CUDAGraphMode.NONE:
            raise ValueError(
                f"every cudagraph_capture_sizes entry of {sizes} is above {ceiling} "
                f"(max_num_batched_tokens={max_num_batched_tokens}, max_cudagraph_capture_size="
                f"{self.max_cudagraph_capture_size}): give sizes up to {ceiling}, or set "
                "cudagraph_mode NONE"
            )
        return kept

    @property
    def max_capture_size(self) -> int:
        return self._pad_table[-1] if self._pad_table else 0

    def pad_for_cudagraph(self, num_tokens: int) -> int:
        """The smallest capture size >= num_tokens (a table lookup; callers check the max)."""
        index = bisect.bisect_left(self._pad_table, num_tokens)
        if index == len(self._pad_table):
            raise ValueError(
                f"{num_tokens} tokens exceed the largest capture size {self.max_capture_size}"
            )
        return self._pad_table[index]

    def register_layer(self, prefix: str, layer: Any) -> None:
        """Bind a no-compile layer to its prefix; a duplicate prefix is a model-building bug."""
        if prefix in self.static_forward_context:
            raise ValueError(
                f"duplicate layer name {prefix!r}: every attention / Mamba layer "
                "needs a unique prefix"
            )
        self.static_forward_context[prefix] = layer

    def custom_op_enabled(self, name: str, default: bool) -> bool:
        """Whether the pieceworks kernel ``name`` replaces its plain-torch version (read by the
        kernel chooser while a model is built, ``kernels/chooser.py``)."""
        if f"+{name}" in self.custom_ops:
            return True
        if f"-{name}" in self.custom_ops:
            return False
        if "all" in self.custom_ops:
            return True
        return False if "none" in self.custom_ops else default

    def compute_hash(self) -> str:
        """Hash of the fields that change compiled code (capture sizes and graph modes do not)."""
        return hash_factors(self.compute_factors())

    def compute_factors(self) -> dict[str, Any]:
        """The fields that change compiled code, by name (what ``compute_hash`` hashes)."""
        return {
            "level": int(self.level),
            "backend": self.backend,
            "splitting_ops": self.splitting_ops,
            "compile_sizes": sorted(self.compile_sizes),
            "custom_ops": self.custom_ops,
            "pass_config": dataclasses.asdict(self.pass_config),
            "inductor_compile_config": self.inductor_compile_config,
        }
