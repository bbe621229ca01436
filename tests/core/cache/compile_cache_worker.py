"""A fresh process for the compile-cache tests: build the toy, run it, save outputs and counters.

Builds ``ToyModel`` with Inductor (or ``--backend eager``) and the compile cache at ``--cache-root``
(``--max-model-len`` changes a config factor of its key) on ``--device``, runs it on fixed
inputs (token counts 4, 3, 1: the dynamic-shape artifact serves them all) and writes a
``torch.save`` file with the outputs, the compilation-counter deltas, the cache directory, the
directory the ``pieceworks`` package was imported from and Inductor's Triton-kernel counters.
Run (from the repository root):
    python -m tests.core.cache.compile_cache_worker --cache-root DIR --out F
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

import pieceworks
from pieceworks.config import EngineConfig, ModelConfig, SchedulerConfig
from pieceworks.core.config import CompilationConfig, CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.forward_context import set_forward_context
from tests.core.toy_model import SILLY_OP, ToyModel

TOKEN_COUNTS = (4, 3, 1)


def toy_config(
    cache_root: str, backend: str = "inductor", max_model_len: int | None = None
) -> EngineConfig:
    """The one config every compile-cache test uses (so processes agree on the cache key);
    ``max_model_len`` changes a config factor of the key."""
    compilation = CompilationConfig(
        backend=backend,
        splitting_ops=[SILLY_OP],
        cudagraph_mode=CUDAGraphMode.NONE,
        cudagraph_capture_sizes=[1, 2, 4],
        cache_dir=cache_root,
    )
    model = ModelConfig() if max_model_len is None else ModelConfig(max_model_len=max_model_len)
    return EngineConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=4),
        compilation_config=compilation,
    )


def toy_inputs(device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(n, 8, generator=generator).to(device) for n in TOKEN_COUNTS]


def inductor_counters() -> dict[str, int]:
    """Inductor's counts of Triton kernels its artifacts carried and of kernels it compiled."""
    from torch._dynamo.utils import counters

    prefixes = ("triton_bundler_", "async_compile_")
    return {k: v for k, v in counters["inductor"].items() if k.startswith(prefixes)}


@torch.inference_mode()
def run_toy(
    cache_root: str, num_layers: int, device: str = "cpu", **config_args: Any
) -> dict[str, Any]:
    """Build, run every input, return outputs, counter deltas and the cache directory."""
    config = toy_config(cache_root, **config_args)
    before = compilation_counter.clone()
    torch.manual_seed(0)
    model = ToyModel(config=config, num_layers=num_layers).requires_grad_(False).to(device)
    outputs = []
    for x in toy_inputs(device):
        with set_forward_context(None, config):
            outputs.append(model(x).clone().cpu())
    counters = {
        name: value - getattr(before, name) for name, value in vars(compilation_counter).items()
    }
    backend = model._pieceworks_compiler.piecewise_backend
    return {
        "outputs": outputs,
        "counters": counters,
        "cache_dir": backend.cache_dir,
        "package_dir": os.path.dirname(pieceworks.__file__),  # which copy was imported
        "inductor_counters": inductor_counters(),
    }


def assert_same_outputs(result: dict[str, Any], reference: dict[str, Any]) -> None:
    """Two ``run_toy`` results computed the same outputs, bit for bit."""
    for output, expected in zip(result["outputs"], reference["outputs"], strict=True):
        assert torch.equal(output, expected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    result = run_toy(
        args.cache_root,
        args.num_layers,
        args.device,
        backend=args.backend,
        max_model_len=args.max_model_len,
    )
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
