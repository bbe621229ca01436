"""Conformance checks of a platform's static graphs, on a toy piecewise model.

The toy model is two pieces around an eager middle op, as a compiled model is pieces around its
splitting ops: ``piece_a`` (a linear layer), the middle op in place on ``piece_a``'s output (it
reads and writes the captured address, as attention writes into its output buffer), ``piece_b``
(another linear layer). Each piece is wrapped in the platform's static-graph wrapper. The runner's
side of the address contract is played here: inputs are copied into one static buffer sized to
the largest capture size, and outputs are read where the capture left them. A capture records
the device's work without running it (CUDA and HIP graphs do), so its own output is not compared;
each replay's is. A wrapper that replays on copies of its inputs, on the argument instead of the
captured buffer, or that moves its outputs fails ``toy piecewise capture/replay``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode
from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.forward_context import BatchDescriptor, set_forward_context
from pieceworks.core.static_graph import CUDAGraphOptions
from pieceworks.entrypoints.platform_check.report import (
    CheckFailed,
    CheckOptions,
    CheckSkipped,
    check_library,
)

CAPTURE_SIZES = (8, 4, 2, 1)  # captured largest first, as the runner does
HIDDEN_SIZE = 16
NUM_REPLAYS = 3  # fresh inputs per size


class ToyPiecewiseModel(nn.Module):
    """``piece_b(middle(piece_a(x)))``; ``wrap`` wraps each piece (identity: the eager model)."""

    def __init__(self, device: torch.device, wrap: Any = None) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight_a = torch.randn(HIDDEN_SIZE, HIDDEN_SIZE, generator=generator).to(device)
        self.weight_b = torch.randn(HIDDEN_SIZE, HIDDEN_SIZE, generator=generator).to(device)
        self.piece_a = wrap(self._piece_a) if wrap else self._piece_a
        self.piece_b = wrap(self._piece_b) if wrap else self._piece_b

    def _piece_a(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_a + 1.0

    def _piece_b(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.piece_a(x)
        h.sin_()  # the eager op between pieces, in place at the captured address
        return self.piece_b(h)


def graph_config(level: CompilationLevel, mode: CUDAGraphMode, **fields: Any) -> EngineConfig:
    compilation = CompilationConfig(
        level=level, cudagraph_mode=mode, cudagraph_capture_sizes=sorted(CAPTURE_SIZES), **fields
    )
    return EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=max(CAPTURE_SIZES)),
        compilation_config=compilation,
    )


def forward(model: Any, config: EngineConfig, x: torch.Tensor, mode: CUDAGraphMode) -> Any:
    descriptor = None if mode == CUDAGraphMode.NONE else BatchDescriptor(x.shape[0])
    with set_forward_context(
        None, config, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
    ):
        return model(x)


def _require_static_graphs(platform: Any) -> None:
    if not platform.capabilities().static_graphs:
        raise CheckSkipped("static graphs not declared")


def _wrapped_model(platform: Any, config: EngineConfig, mode: CUDAGraphMode) -> ToyPiecewiseModel:
    wrapper_cls = platform.static_graph_wrapper_cls()
    device = platform.device()
    return ToyPiecewiseModel(device, lambda piece: wrapper_cls(piece, config, mode))


@torch.inference_mode()
def check_piecewise_replay(platform: Any, options: CheckOptions) -> str:
    """Capture every size, then replay fresh inputs copied into the static buffer: outputs equal
    eager, read at the capture's addresses; a fresh tensor passed as the argument is not read."""
    _require_static_graphs(platform)
    mode = CUDAGraphMode.PIECEWISE
    config = graph_config(CompilationLevel.PIECEWISE, mode)
    device = platform.device()
    eager = ToyPiecewiseModel(device)
    model = _wrapped_model(platform, config, mode)
    static_input = torch.zeros(max(CAPTURE_SIZES), HIDDEN_SIZE, device=device)
    generator = torch.Generator().manual_seed(1)
    forward(eager, config, static_input, CUDAGraphMode.NONE)  # warm-up, as the runner does
    for size in CAPTURE_SIZES:
        view = static_input[:size]
        view.copy_(torch.randn(size, HIDDEN_SIZE, generator=generator).to(device))
        address = forward(model, config, view, mode).data_ptr()  # the capture
        for _ in range(NUM_REPLAYS):
            view.copy_(torch.randn(size, HIDDEN_SIZE, generator=generator).to(device))
            replayed = forward(model, config, view, mode)
            platform.synchronize()
            _expect_equal(
                replayed,
                eager(view),
                f"replay at size {size} (inputs copied into the static buffer; a stale result "
                "means the wrapper replays on its own copies of the captured inputs)",
            )
            if replayed.data_ptr() != address:
                raise CheckFailed(
                    f"replay at size {size} returned its output at a new address; the runner "
                    "reads outputs where the capture left them"
                )
        _check_fresh_argument_not_read(platform, model, eager, config, view, mode)
    return f"sizes {', '.join(map(str, CAPTURE_SIZES))}: {NUM_REPLAYS} replays each equal eager"


def _check_fresh_argument_not_read(platform, model, eager, config, view, mode) -> None:
    fresh = torch.randn(view.shape, device=view.device) + 5.0
    try:
        result = forward(model, config, fresh, mode)
    except Exception:  # refusing a new input address (CUDAGraphWrapper's debug check) is fine
        return
    platform.synchronize()
    if torch.allclose(result, eager(fresh)):
        raise CheckFailed(
            f"replay at size {view.shape[0]} computed from its argument, a tensor at a new "
            "address: it ran the piece instead of replaying a graph on the captured buffers"
        )


def _expect_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4):
        difference = (actual - expected).abs().max().item()
        raise CheckFailed(f"{what} differs from eager (max abs difference {difference:.3g})")


@torch.inference_mode()
def check_graph_pool(platform: Any, options: CheckOptions) -> str:
    """Every size's graphs take memory from the one pool ``graph_pool()`` returns."""
    _require_static_graphs(platform)
    if not platform.capabilities().graph_pool_sharing:
        raise CheckSkipped("graph pool sharing not declared")
    pool = platform.graph_pool()
    if pool is None:
        raise CheckFailed("graph_pool() is None although graph_pool_sharing is declared")
    mode = CUDAGraphMode.PIECEWISE
    config = graph_config(CompilationLevel.PIECEWISE, mode)
    model = _wrapped_model(platform, config, mode)
    static_input = torch.ones(max(CAPTURE_SIZES), HIDDEN_SIZE, device=platform.device())
    forward(model, config, static_input, CUDAGraphMode.NONE)
    for size in CAPTURE_SIZES:
        forward(model, config, static_input[:size], mode)
        if platform.graph_pool() is not pool:
            raise CheckFailed(f"graph_pool() changed after the capture at size {size}")
    return f"one pool for sizes {', '.join(map(str, CAPTURE_SIZES))}"


@torch.inference_mode()
def check_full_and_piecewise_nesting(platform: Any, options: CheckOptions) -> str:
    """A FULL wrapper around the model whose pieces are PIECEWISE wrappers: in a FULL step the
    pieces call through and the outer wrapper captures; in a PIECEWISE step the reverse."""
    _require_static_graphs(platform)
    config = graph_config(CompilationLevel.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)
    device = platform.device()
    eager = ToyPiecewiseModel(device)
    inner = _wrapped_model(platform, config, CUDAGraphMode.PIECEWISE)
    outer = platform.static_graph_wrapper_cls()(inner, config, CUDAGraphMode.FULL)
    static_input = torch.zeros(max(CAPTURE_SIZES), HIDDEN_SIZE, device=device)
    forward(eager, config, static_input, CUDAGraphMode.NONE)
    for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
        for size in CAPTURE_SIZES:
            view = static_input[:size]
            for seed in range(3):  # the capture (recorded, not run), then two replays
                view.copy_(torch.randn(size, HIDDEN_SIZE, generator=_generator(seed)).to(device))
                result = forward(outer, config, view, mode)
                platform.synchronize()
                if seed > 0:
                    _expect_equal(result, eager(view), f"{mode.name} step at size {size}")
    piece_a: Any = inner.piece_a
    num_full, num_pieces = len(outer.entries), len(piece_a.entries)
    if num_full != len(CAPTURE_SIZES) or num_pieces != len(CAPTURE_SIZES):
        raise CheckFailed(
            f"expected one FULL graph and one graph per piece for each of {len(CAPTURE_SIZES)} "
            f"sizes, got {num_full} FULL and {num_pieces} per piece"
        )
    return "FULL and PIECEWISE steps equal eager; each wrapper captured only its own mode"


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(100 + seed)


SPLIT_OP = "pieceworks_check::scale"
_NUM_SPLIT_LAYERS = 2
_split_calls = [0]


def _scale(x: torch.Tensor, out: torch.Tensor) -> None:
    _split_calls[0] += 1
    out.copy_(x * 0.5)


def _scale_fake(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


class ToyEagerModel(nn.Module):
    """Layers of: linear, the dynamic split op, add the residual (a breakable capture's model)."""

    def __init__(self, device: torch.device, split: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.split = split
        self.layers = nn.ModuleList(
            nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE, bias=False) for _ in range(_NUM_SPLIT_LAYERS)
        ).to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            out = torch.empty_like(h)
            self.split(h, out)
            x = out + x
        return x * 2.0


@torch.inference_mode()
def check_breakable_capture(platform: Any, options: CheckOptions) -> str:
    """A level-0 breakable capture: segments ended at the split op, which runs eagerly at each
    replay; replays of inputs copied into the static buffer equal eager."""
    _require_static_graphs(platform)
    if not platform.capabilities().breakable_capture:
        raise CheckSkipped("breakable capture not declared")
    split = direct_register_custom_op(
        "scale", _scale, ["out"], _scale_fake, target_lib=check_library(), dynamic=True
    )
    config = graph_config(
        CompilationLevel.NO_COMPILATION, CUDAGraphMode.PIECEWISE, splitting_ops=[SPLIT_OP]
    )
    mode = CUDAGraphMode.PIECEWISE
    model = ToyEagerModel(platform.device(), split).requires_grad_(False)
    wrapper = platform.static_graph_wrapper_cls()(
        model, config, mode, options=CUDAGraphOptions(breakable=True)
    )
    size = 4
    static_input = torch.randn(size, HIDDEN_SIZE, device=platform.device())
    forward(model, config, static_input, CUDAGraphMode.NONE)
    forward(wrapper, config, static_input, mode)  # the capture
    for seed in range(NUM_REPLAYS):
        static_input.copy_(torch.randn(size, HIDDEN_SIZE, generator=_generator(seed)))
        _split_calls[0] = 0
        replayed = forward(wrapper, config, static_input, mode).clone()
        if _split_calls[0] != _NUM_SPLIT_LAYERS:
            raise CheckFailed(
                f"the split op ran {_split_calls[0]} times in a replay, not once per layer "
                f"({_NUM_SPLIT_LAYERS}): it must run eagerly between segments"
            )
        _expect_equal(replayed, model(static_input), "breakable replay")
    return f"{_NUM_SPLIT_LAYERS + 1} segments; {NUM_REPLAYS} replays equal eager"
