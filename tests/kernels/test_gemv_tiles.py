"""The GEMV's tuned tiles are data: the H200 file plus the shape rule give the tiles the H200
numbers were measured with, for the Llama-3.1-8B and llama-125m projections, and a device
without a file (or a shape the file does not list) gets the rule.
Run: PYTHONPATH=. PIECEWORKS_PLATFORM=cpu python -m pytest tests/kernels/test_gemv_tiles.py -q
"""

from __future__ import annotations

import pytest

from pieceworks.kernels.gemv import triton_gemv_config
from pieceworks.kernels.gemv.triton_gemv_config import GemvConfig, gemv_config, tuned_tiles

H200 = "NVIDIA H200"
H200_SHARED_BYTES = 232448  # Triton's max_shared_mem on an H200
# (n, k, gated, element_size) -> (block_n, block_k, num_stages) at M = 1 and 16, as launched on
# an H200 before the tiles became data
EXPECTED = {
    # Llama-3.1-8B: qkv, o, gate_up (gated), down; qkv also stacked for the rotary epilogue
    (6144, 4096, False, 2): (64, 256, 4),
    (6144, 4096, True, 2): (32, 256, 4),
    (4096, 4096, False, 2): (64, 256, 4),
    (28672, 4096, True, 2): (32, 128, 4),
    (4096, 14336, False, 2): (32, 512, 4),
    (6144, 4096, False, 1): (64, 256, 6),
    (4096, 4096, False, 1): (64, 256, 6),
    (28672, 4096, True, 1): (32, 256, 4),
    (4096, 14336, False, 1): (64, 256, 8),
    # llama-125m: qkv, o, gate_up (gated), down
    (2304, 768, False, 2): (64, 256, 4),
    (768, 768, False, 2): (64, 256, 4),
    (6144, 768, True, 2): (32, 256, 4),
    (768, 3072, False, 2): (64, 256, 4),
    (2304, 768, False, 1): (64, 256, 6),
    (768, 768, False, 1): (64, 256, 6),
    (6144, 768, True, 1): (32, 256, 6),
    (768, 3072, False, 1): (64, 256, 6),
}


@pytest.mark.parametrize("shape", list(EXPECTED), ids=lambda s: f"{s[0]}x{s[1]}-g{s[2]}-b{s[3]}")
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_h200_file_and_rule_give_the_measured_tiles(shape, num_tokens):
    n, k, gated, element_size = shape
    block_n, block_k, num_stages = EXPECTED[shape]
    expected = GemvConfig(block_n=block_n, block_k=block_k, num_stages=num_stages)
    for device in (H200, None):  # the file, and the rule alone
        config = gemv_config(num_tokens, n, k, element_size, H200_SHARED_BYTES, gated, device)
        assert config == expected, device


def test_the_h200_file_lists_every_measured_shape():
    tiles = tuned_tiles(H200)
    for n, k, _, element_size in EXPECTED:
        assert f"{n}x{k}" in tiles["8bit" if element_size == 1 else "16bit"]


def test_the_file_is_read_and_other_devices_take_the_rule(monkeypatch):
    """A tile in the file wins over the rule; a device without a file and an unlisted shape
    get the rule."""
    assert tuned_tiles("Some GPU 9000") == {}
    assert gemv_config(1, 4096, 4096, 2, None, False, "Some GPU 9000") == gemv_config(1, 4096, 4096)
    assert gemv_config(1, 1024, 512, 2, None, False, H200) == gemv_config(1, 1024, 512)
    tile = {"block_n": 16, "block_k": 64, "num_stages": 3}
    monkeypatch.setattr(
        triton_gemv_config, "tuned_tiles", lambda name: {"16bit": {"4096x4096": tile}}
    )
    assert gemv_config(1, 4096, 4096, 2, None, False, "Tuned GPU") == GemvConfig(
        block_n=16, block_k=64, num_stages=3
    )
