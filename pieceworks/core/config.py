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


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """The seed's grid: 1, 2, 4, then steps of 8 up to the first multiple of 8 >= max_num_seqs."""
    sizes = [1, 2, 4]
    sizes += list(range(8, ((max_num_seqs + 7) // 8) * 8 + 1, 8))
    return sizes


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
    splitting_ops: list[str] | None = None  # None: attention + mamba_mixer2
    cudagraph_mode: CUDAGraphMode | None = None  # None: FULL_AND_PIECEWISE at level 3, else NONE
    cudagraph_capture_sizes: list[int] | None = None  # None: default_capture_sizes(max_num_seqs)
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
            self.splitting_ops = [ATTENTION_OP, MAMBA_MIXER2_OP]
        self._resolve_cudagraph_mode()
        for entry in self.custom_ops:
            # ("" and a bare sign are no names; ``"" in "+-"`` would let "" through.)
            if entry not in ("all", "none") and (entry[:1] not in ("+", "-") or len(entry) < 2):
                raise ValueError(
                    f"custom_ops entry {entry!r}: use 'all', 'none', '+name' or '-name'"
                )
        if self.cudagraph_capture_sizes is not None:
            self._validate_capture_sizes(self.cudagraph_capture_sizes)

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

    def finalize_capture_sizes(self, max_num_seqs: int) -> None:
        """Fill the default capture sizes, check compile_sizes, build the padding table."""
        if self.cudagraph_capture_sizes is None:
            self.cudagraph_capture_sizes = default_capture_sizes(max_num_seqs)
        sizes = self.cudagraph_capture_sizes
        for size in self.compile_sizes:
            if size not in sizes:
                raise ValueError(
                    f"compile_sizes entry {size} is not a capture size; "
                    f"compile sizes must be among cudagraph_capture_sizes {sizes}"
                )
        self._pad_table = list(sizes)

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
