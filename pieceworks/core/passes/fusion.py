"""``RMSNormQuantFusionPass``: RMSNorm (+ residual add) then static FP8 quant, as one fused op.

An FP8 linear layer quantizes its input with a static per-tensor scale; in a decoder that input
is an RMSNorm's output. This pass finds, in the post-grad graph of a piece, the ATen sequence of
``rms_norm`` -> ``static_scaled_fp8_quant`` and of ``add_rms_norm`` -> quant (``core/norm_quant``,
the functions the layers call) and replaces each with one call of the fused op, which reads the
activation once and writes FP8 (and, in the residual form, the new residual) directly:

    quant(rms_norm(x, w, eps), s)       -> rms_norm_static_fp8_quant(result, x, w, s, eps)
    quant(add_rms_norm(x, r, w, eps)), . -> fused_add_rms_norm_static_fp8_quant(result,
                                              residual_out, x, r, w, s, eps)

The replacement calls the op through ``auto_functionalized`` (the graph is functional at this
point); ``FixFunctionalizationPass`` then turns it into the in-place call on fresh buffers.
Patterns are traced once per process for float32, bfloat16 and float16 (the casts in the
sequence differ by dtype), with ``eps`` a wildcard. They need the fused ops registered
(``kernels/norm_quant/norm_quant_ops.py``, done when an FP8 model is built); before that
there is nothing to fuse and the pass does nothing.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import Tensor

from pieceworks.core import norm_quant
from pieceworks.core.config import LIBRARY_NAMESPACE
from pieceworks.core.norm_quant import (
    FUSED_ADD_RMS_NORM_QUANT_OP,
    RMS_NORM_QUANT_OP,
    add_rms_norm,
    fp8_dtype,
    rms_norm,
    static_scaled_fp8_quant,
)
from pieceworks.core.passes.inductor_pass import InductorPass
from pieceworks.logger import init_logger

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match, PatternMatcherPass

logger = init_logger(__name__)

PATTERN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPSILON_PLACEHOLDER = 1e-6  # marks eps in the traced pattern; any eps matches
_patterns: PatternMatcherPass | None = None  # built on the first call after the ops exist


class RMSNormQuantFusionPass(InductorPass):
    """Replaces RMSNorm (+ residual add) -> static FP8 quant with the fused op."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        patterns = fusion_patterns()
        self.num_rewrites = patterns.apply(graph) if patterns is not None else 0
        logger.debug("RMSNorm + quant fusion: %d matches", self.num_rewrites)

    def source_files(self) -> list[str]:
        return [inspect.getfile(type(self)), inspect.getfile(norm_quant)]


def fused_op(name: str) -> torch._ops.OpOverload | None:
    """``torch.ops.pieceworks.<name>.default``, or None while it is not registered."""
    namespace = getattr(torch.ops, LIBRARY_NAMESPACE)
    return getattr(namespace, name).default if hasattr(namespace, name) else None


def fusion_patterns() -> PatternMatcherPass | None:
    """The process's pattern set, traced on first use; None until the fused ops are registered."""
    global _patterns
    if _patterns is None:
        plain_op, add_op = fused_op(RMS_NORM_QUANT_OP), fused_op(FUSED_ADD_RMS_NORM_QUANT_OP)
        if plain_op is None or add_op is None:
            return None
        from torch._inductor.pattern_matcher import PatternMatcherPass

        patterns = PatternMatcherPass(pass_name="pieceworks_rms_norm_quant_fusion")
        # The residual form first: in float32 its sum is a plain add that the norm-only pattern
        # would also match, leaving the add unfused; the first registered pattern wins.
        for dtype in PATTERN_DTYPES:
            _register_add_rms_norm_quant(patterns, add_op, dtype)
        for dtype in PATTERN_DTYPES:
            _register_rms_norm_quant(patterns, plain_op, dtype)
        _patterns = patterns
    return _patterns


def _is_per_tensor(match: Match) -> bool:
    """The fused op takes one float32 scale and a 1-D weight (broadcasting would hide others)."""
    scale = match.kwargs["scale"].meta["val"]
    weight = match.kwargs["weight"].meta["val"]
    return scale.numel() == 1 and scale.dtype == torch.float32 and weight.dim() == 1


def _example_inputs(dtype: torch.dtype, with_residual: bool) -> list[torch.Tensor]:
    # Distinct tensors: tracing would merge two inputs that are one tensor into one argument.
    activations = [torch.empty(5, 16, dtype=dtype) for _ in range(2 if with_residual else 1)]
    return [*activations, torch.empty(16, dtype=dtype), torch.empty((), dtype=torch.float32)]


def _register(patterns: PatternMatcherPass, search: Any, replace: Any, inputs: list) -> None:
    from torch._inductor.pattern_matcher import fwd_only, register_replacement

    register_replacement(
        search,
        replace,
        inputs,
        fwd_only,
        patterns,
        extra_check=_is_per_tensor,
        scalar_workaround={"epsilon": EPSILON_PLACEHOLDER},
        skip_duplicates=True,
    )


def _register_rms_norm_quant(
    patterns: PatternMatcherPass, op: torch._ops.OpOverload, dtype: torch.dtype
) -> None:
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    def search(input: Tensor, weight: Tensor, scale: Tensor, epsilon: float) -> Tensor:
        return static_scaled_fp8_quant(rms_norm(input, weight, epsilon), scale)

    def replace(input: Tensor, weight: Tensor, scale: Tensor, epsilon: float) -> Tensor:
        result = torch.empty_like(input, dtype=fp8_dtype())
        fused: Any = auto_functionalized(  # (None, result[, residual_out])
            op, result=result, input=input, weight=weight, scale=scale, epsilon=epsilon
        )
        return fused[1]

    _register(patterns, search, replace, _example_inputs(dtype, with_residual=False))


def _register_add_rms_norm_quant(
    patterns: PatternMatcherPass, op: torch._ops.OpOverload, dtype: torch.dtype
) -> None:
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    def search(
        input: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, epsilon: float
    ) -> tuple[Tensor, Tensor]:
        normed, residual_out = add_rms_norm(input, residual, weight, epsilon)
        return static_scaled_fp8_quant(normed, scale), residual_out

    def replace(
        input: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, epsilon: float
    ) -> tuple[Tensor, Tensor]:
        result = torch.empty_like(input, dtype=fp8_dtype())
        residual_out = torch.empty_like(input)
        fused: Any = auto_functionalized(  # (None, result[, residual_out])
            op,
            result=result,
            residual_out=residual_out,
            input=input,
            residual=residual,
            weight=weight,
            scale=scale,
            epsilon=epsilon,
        )
        return fused[1], fused[2]

    _register(patterns, search, replace, _example_inputs(dtype, with_residual=True))
