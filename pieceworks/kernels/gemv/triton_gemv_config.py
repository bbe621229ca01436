"""Launch configurations of the small-M GEMV (``triton_gemv.py``), from shapes and the GPU.

``gemv_config`` takes a base tile from the device's tuned tiles (``tiles/NVIDIA_H200.json``) or
the shape rule measured on an H200 (``rule_tile``; ``gemv_config``'s docstring gives the sweeps);
``rope_config`` narrows a tile for the rotary epilogue; ``launch_config`` resolves and checks the
configuration of one launch (tokens, epilogue), raising a ValueError that says what does not fit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import torch
import triton

from pieceworks.kernels import triton_device

TILES_DIR = Path(__file__).parent / "tiles"
MAX_KERNEL_TOKENS = 64  # what the kernel takes (benchmarks measure 32 and 64 against cuBLAS)
MIN_BLOCK_M = 16  # tokens padded to at least the smallest tensor-core tile


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch configuration: padded tokens, output columns and K chunk per program, warps,
    pipeline stages."""

    block_m: int = MIN_BLOCK_M
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@functools.lru_cache(maxsize=256)
def gemv_config(
    m: int,
    n: int,
    k: int,
    element_size: int = 2,
    max_shared_bytes: int | None = None,
    gated: bool = False,
    device_name: str | None = None,
) -> GemvConfig:
    """The launch configuration for an (m, k) x (n, k)^T product, from its shapes and the GPU.

    The base tile comes from the device's tuned tiles (``tiles/<device name>.json``, spaces as
    underscores) where its shape is listed, else from ``rule_tile``; the adjustments below apply
    to either.

    From H200 sweeps (``benchmarks/gemv_decode.py``, bfloat16, the four 8B shapes, M 1 to 16,
    block_n 16/32/64 x block_k 128/256/512 x warps/stages 4x3, 4x4, 8x4, then the tiles again
    inside a CUDA graph): 4 warps and 4 stages were best or within 5% of it on every shape, and
    the tile depended on the shape, not on M:
    - N >= 16384 (gate_up_proj, 28672 x 4096): 64 x 128;
    - K >= 8192 (down_proj, 4096 x 14336): 32 x 512;
    - otherwise (qkv_proj, o_proj): 64 x 256.
    The first guess (16 columns per program) ran o_proj at half the speed of these. Tokens are
    padded to ``block_m``, the next power of two from 16 (32 and 64 tokens: not swept yet).
    Widths are for 16-bit types; float32 halves ``block_k`` to keep the bytes per chunk. A GPU
    with less shared memory per SM than ``stages x (block_n + 16) x block_k`` elements (smaller
    than an H200's 228 KiB) gets fewer stages, then narrower K chunks, instead of a launch error.
    FP8 (one byte) has its own tiles, chosen by a sweep on an H200 (in a graph, one token): 64 x
    256 bytes of K, with 8 stages for ``down_proj``, 6 for qkv and o, 4 for gate_up.
    ``gated`` (``n`` counts the gate and the up rows): a program stacks ``block_n`` rows of each,
    so ``block_n`` is halved to keep the rows per program (one tensor-core tile) of the plain one.
    The rotary epilogue stacks the two halves of a head the same way and passes ``gated=True``
    (``rope_config`` then narrows ``block_n`` to divide half a head).
    """
    block_n, block_k, num_stages = base_tile(n, k, element_size, device_name)
    weight_rows = block_n
    if gated:
        block_n //= 2
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(m))
    block_k = min(block_k * 2 // element_size, max(triton.next_power_of_2(k), 16))
    if max_shared_bytes is not None:
        stage_bytes = lambda: (weight_rows + block_m) * block_k * element_size  # W and x chunks
        while num_stages > 2 and num_stages * stage_bytes() > max_shared_bytes:
            num_stages -= 1
        while block_k > 16 and num_stages * stage_bytes() > max_shared_bytes:
            block_k //= 2
    return GemvConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_stages=num_stages)


def rule_tile(n: int, k: int, element_size: int) -> tuple[int, int, int]:
    """``(block_n, block_k, num_stages)`` by shape rule (the H200 sweeps' findings, above):
    ``block_k`` in 16-bit elements, before ``gemv_config`` scales it to the element size."""
    if element_size == 1:  # FP8: 64 x 256 everywhere; 4 stages for gate_up, 8 for down, else 6
        return 64, 128, 4 if n >= 16384 else 8 if k >= 8192 else 6
    if n >= 16384:
        return 64, 128, 4
    if k >= 8192:
        return 32, 512, 4
    return 64, 256, 4


def base_tile(n: int, k: int, element_size: int, device_name: str | None) -> tuple[int, int, int]:
    """The device's tuned tile for an (n, k) weight, else ``rule_tile``'s."""
    width = "8bit" if element_size == 1 else "16bit"
    tile = tuned_tiles(device_name).get(width, {}).get(f"{n}x{k}") if device_name else None
    if tile is None:
        return rule_tile(n, k, element_size)
    return tile["block_n"], tile["block_k"], tile["num_stages"]


@functools.cache
def tuned_tiles(device_name: str) -> dict[str, dict[str, dict[str, int]]]:
    """``{"16bit" | "8bit": {"NxK": tile}}`` from ``tiles/<device name>.json``; empty where the
    device has no file."""
    path = TILES_DIR / f"{device_name.replace(' ', '_')}.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text())["tiles"]


def device_name(device: torch.device) -> str | None:
    """The name of ``device``'s GPU (what names its tiles file), or None where the kernels do not
    run compiled on it."""
    if not triton_device.compiled_kernels_run_on(device):
        return None
    return _device_name(device.index or 0)


@functools.lru_cache(maxsize=16)
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def max_shared_bytes(device: torch.device) -> int | None:
    """Shared memory per block on ``device``'s GPU, or None where the kernels do not run compiled
    on it."""
    if not triton_device.compiled_kernels_run_on(device):
        return None
    return int(_device_properties(device.index or 0)["max_shared_mem"])


def num_sms(device: torch.device) -> int | None:
    """Streaming multiprocessors (compute units) of ``device``'s GPU, or None where the kernels do
    not run compiled on it."""
    if not triton_device.compiled_kernels_run_on(device):
        return None
    return int(_device_properties(device.index or 0)["multiprocessor_count"])


@functools.lru_cache(maxsize=16)
def _device_properties(device_index: int) -> dict:
    """Triton's view of a GPU (a GPU tensor's device always has its index)."""
    return dict(triton.runtime.driver.active.utils.get_device_properties(device_index))


@dataclasses.dataclass(frozen=True)
class RopeEpilogue:
    """The rotary epilogue's operands: ``positions (T,)``, one per token; ``cos_sin_cache (P, D)``
    in the output dtype, cos in the first half of each row and sin in the second; the head size
    D; and how many leading heads of the qkv weight (q and k) are rotated."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    head_size: int
    num_rotary_heads: int


MIN_ROPE_BLOCK_N = 8  # 2 x 8 stacked rows: the smallest tensor-core tile tl.dot takes


def rope_config(config: GemvConfig, head_size: int) -> GemvConfig | None:
    """``config`` for the rotary epilogue: the widest ``block_n`` up to its own that divides
    ``head_size / 2``, so a program's pairs lie in one head; None where that is below 8 (a head
    size that is not a multiple of 16)."""
    block_n = config.block_n
    while block_n >= MIN_ROPE_BLOCK_N and (head_size // 2) % block_n:
        block_n //= 2
    if head_size % 2 or block_n < MIN_ROPE_BLOCK_N:
        return None
    return dataclasses.replace(config, block_n=block_n)


def checked_rope_config(
    config: GemvConfig, weight: torch.Tensor, rope: RopeEpilogue, num_tokens: int
) -> GemvConfig:
    """``rope_config`` for a merged qkv weight, or a ValueError saying what does not fit."""
    head_size = rope.head_size
    if weight.shape[0] % head_size or rope.cos_sin_cache.shape[1] != head_size:
        raise ValueError(
            f"the rotary epilogue needs whole heads of head_size={head_size} rotated on every dim: "
            f"weight rows {weight.shape[0]}, cos_sin_cache width {rope.cos_sin_cache.shape[1]}; "
            "rotate partial rotary after an unfused GEMM"
        )
    if rope.positions.shape != (num_tokens,):
        raise ValueError(
            f"positions {tuple(rope.positions.shape)} need one per token: {num_tokens}"
        )
    fitted = rope_config(config, head_size)
    if fitted is None:
        raise ValueError(
            f"head_size={head_size} is not a multiple of 16: no tile of whole pairs fits; use "
            "the unfused GEMM and rotation"
        )
    return fitted


def launch_config(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None,
    stacked: bool,
    rope: RopeEpilogue | None,
) -> GemvConfig:
    """``config``, else ``gemv_config``'s for these shapes (``stacked``: two weight rows per
    program column), narrowed for the rotary epilogue; a ValueError if the tokens do not fit."""
    num_tokens, in_features = x.shape
    if num_tokens > MAX_KERNEL_TOKENS:
        raise ValueError(f"the GEMV takes at most {MAX_KERNEL_TOKENS} tokens, got {num_tokens}")
    if config is None:
        shared = max_shared_bytes(x.device)
        element_size = x.element_size()
        name = device_name(x.device)
        config = gemv_config(
            num_tokens, weight.shape[0], in_features, element_size, shared, stacked, name
        )
    if rope is not None:
        config = checked_rope_config(config, weight, rope, num_tokens)
    if num_tokens > config.block_m:
        raise ValueError(f"{num_tokens} tokens do not fit block_m={config.block_m}")
    return config
