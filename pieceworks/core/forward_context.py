"""The forward context: per-step data the opaque ops need, set around each model call.

The runner wraps every forward in ``set_forward_context(...)``; the attention and Mamba ops read the
step's metadata and find their layer here, and the static-graph wrappers read the runtime mode and
``BatchDescriptor`` to decide whether to capture, replay or call through.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pieceworks.core.config import CUDAGraphMode

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """The key a static graph is captured under: padded token count and batch shape."""

    num_tokens: int
    uniform_decode: bool = False  # every sequence is a decode with uniform_query_len tokens
    # Query tokens per sequence of a uniform batch: 1 for plain decodes, 1 + k for the verify
    # step of speculative decoding (k proposals per sequence).
    uniform_query_len: int = 1

    @property
    def non_uniform(self) -> BatchDescriptor:
        """The same token count as a general (mixed) batch."""
        return BatchDescriptor(self.num_tokens, uniform_decode=False)


@dataclasses.dataclass
class ForwardContext:
    no_compile_layers: dict[str, Any]  # prefix -> attention / Mamba layer
    attn_metadata: Any
    cudagraph_runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor | None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(...)")
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Any,
    config: EngineConfig,
    *,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
) -> Iterator[ForwardContext]:
    """Make the step's metadata and graph mode visible to the ops and wrappers in this block."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(
        no_compile_layers=config.compilation_config.static_forward_context,
        attn_metadata=attn_metadata,
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
    )
    try:
        yield _forward_context
    finally:
        _forward_context = previous
