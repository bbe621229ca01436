"""The qkv GEMV's rotary epilogue: the kernel rotates q and k right, the ops route and fall back.

Proves that (1) the GEMV's ``ROPE`` mode equals a float64 reference (the GEMM rounded to the
output dtype as an unfused GEMM stores it, then q and k heads rotated with the cache at each
token's own position, v heads as they are) for float32, bfloat16 and FP8 operands, 1, 5 and 16
tokens, GQA head counts with head sizes 32 and 64, default tiles and a tile of several K chunks
whose last is partial; (2) its ``block_n`` divides ``head_size / 2`` (a program's pairs lie in one
head), and what does not fit is refused with a ValueError that says so; (3)
``small_m_rope_linear`` and its FP8 form run the kernel up to 16 tokens and from 17 on (or on a
device the kernel is not built for) return the unfused GEMM rotated by ``rotate_leading_heads``,
which equals ``RotaryEmbedding.rotate_heads`` on the q and k heads; (4) the linear methods route
to the fused op only in a compiled graph, for neox rotary on every dim (Bamba's partial rotary
keeps the unfused path). Llama decoding through it: ``test_triton_gemv.py``.

What runs where: as in ``test_triton_gemv.py`` (its operands and tolerances are reused): the
kernel runs in Triton's interpreter on CPU tensors where no GPU is visible.

Run: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_gemv_rope.py -p no:cacheprovider
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel below is decorated

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE  # noqa: E402
from pieceworks.kernels import triton_device  # noqa: E402
from pieceworks.kernels.chooser import KernelChooser  # noqa: E402
from pieceworks.kernels.gemv import small_m_fp8 as fp8  # noqa: E402
from pieceworks.kernels.gemv import triton_gemv, triton_gemv_rope  # noqa: E402
from pieceworks.kernels.gemv.triton_gemv import (  # noqa: E402
    MAX_GEMV_TOKENS,
    GemvConfig,
    RopeEpilogue,
    launch_gemv,
    rope_config,
)
from pieceworks.kernels.gemv.triton_gemv_rope import small_m_rope_linear  # noqa: E402
from pieceworks.models.layers.rotary_embedding import (  # noqa: E402
    RotaryEmbedding,
    get_rope,
    rotate_leading_heads,
)
from tests.kernels.test_triton_gemv import (  # noqa: E402
    DEVICE,
    ON_GPU,
    TOLERANCES,
    fp8_operands,
    operands,
    requires_triton,
)

MAX_POSITION = 4096
# (num_heads, num_kv_heads, head_size, in_features, config): GQA with default tiles (block_n 32
# for D = 64, 16 for D = 32), then 4 K chunks whose last is partial
HEADS = [
    (4, 2, 64, 96, None),
    (4, 2, 32, 96, None),
    (4, 2, 32, 200, GemvConfig(block_n=16, block_k=64)),
]


def rope_operands(num_tokens: int, head_size: int, dtype: torch.dtype):
    """``(rotary_emb, positions)``: a cache in ``dtype``, a different position for every token."""
    rotary_emb = get_rope(head_size, head_size, MAX_POSITION, 10000.0, None, True, dtype)
    generator = torch.Generator().manual_seed(num_tokens + head_size)
    positions = torch.randperm(MAX_POSITION, generator=generator)[:num_tokens]
    return rotary_emb.to(DEVICE), positions.to(DEVICE)


def reference(qkv: torch.Tensor, positions, rotary_emb: RotaryEmbedding, num_rotary_heads: int):
    """``qkv`` (float64, already rounded as stored) rotated in float64 with the cache's values."""
    cache = rotary_emb.cos_sin_cache.double()
    return rotate_leading_heads(
        positions, qkv, cache, rotary_emb.head_size, num_rotary_heads, is_neox_style=True
    )


def assert_rotated_like(output: torch.Tensor, expected: torch.Tensor, stored: torch.Tensor):
    """float32: ``expected`` up to float32 accumulation. bfloat16: ``expected`` rounded once,
    bytes equal except where float32 accumulation order moved a GEMM value across a rounding of
    the stored qkv (then by at most one step of it, carried through the rotation)."""
    if output.dtype == torch.float32:
        torch.testing.assert_close(output.double(), expected, **TOLERANCES[torch.float32])
        return
    same = (output == expected.to(output.dtype)).float().mean().item()
    assert same >= 0.99, f"only {same:.2%} of the values equal the reference rounded once"
    atol = 2**-7 * stored.abs().max().item()  # one bfloat16 step of the largest stored value
    torch.testing.assert_close(output.double(), expected, rtol=2**-7, atol=atol)


def check_rope_kernel(output, stored, positions, rotary_emb, num_heads, num_kv_heads):
    """``output`` against the reference: q and k heads rotated, v heads as stored."""
    num_rotary_heads = num_heads + num_kv_heads
    expected = reference(stored.double(), positions, rotary_emb, num_rotary_heads)
    v_columns = num_rotary_heads * rotary_emb.head_size
    assert output.shape == stored.shape and output.dtype == stored.dtype
    assert not torch.allclose(output[:, :v_columns], stored[:, :v_columns])  # q, k: rotated
    assert_rotated_like(output[:, v_columns:], stored[:, v_columns:].double(), stored)  # v: not
    assert_rotated_like(output, expected, stored)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,in_features,config", HEADS)
def test_rope_kernel_matches_float64_reference(
    dtype, num_tokens, num_heads, num_kv_heads, head_size, in_features, config
):
    out_features = (num_heads + 2 * num_kv_heads) * head_size
    x, weight = operands(num_tokens, out_features, in_features, dtype)
    rotary_emb, positions = rope_operands(num_tokens, head_size, dtype)
    num_rotary_heads = num_heads + num_kv_heads
    rope = RopeEpilogue(positions, rotary_emb.cos_sin_cache, head_size, num_rotary_heads)
    output = launch_gemv(x, weight, config, rope=rope)
    stored = (x.double() @ weight.double().t()).to(dtype)  # what an unfused GEMM stores
    check_rope_kernel(output, stored, positions, rotary_emb, num_heads, num_kv_heads)


@pytest.mark.parametrize("pdl", [True, False])
def test_rope_gemv_releases_decode_attention_at_its_start_under_pdl(monkeypatch, pdl):
    # The rotary GEMV comes right before decode attention: under PDL it lets the split kernel be
    # scheduled at its own start; the other GEMVs here release the next kernel after their K loop
    # (the SM count is made unknown, as on the CPU, so no grid counts as one wave with SMs to
    # spare).
    from pieceworks.kernels.gemv import triton_gemv

    launches: list[dict] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(triton_gemv, "_gemv_kernel", Recorder())
    monkeypatch.setattr(triton_gemv, "programmatic_launch", lambda device: pdl)
    monkeypatch.setattr(triton_gemv.triton_gemv_config, "num_sms", lambda device: None)
    x, weight = operands(1, 4 * 64, 96, torch.float32)
    rotary_emb, positions = rope_operands(1, 64, torch.float32)
    launch_gemv(x, weight, rope=RopeEpilogue(positions, rotary_emb.cos_sin_cache, 64, 3))
    launch_gemv(x, weight)
    launch_gemv(x, weight, gated=True)
    assert [launch["RELEASE_AT_START"] for launch in launches] == [pdl, False, False]
    assert [launch["PDL"] for launch in launches] == [pdl, pdl, pdl]


def test_a_gemv_of_one_wave_with_sms_to_spare_releases_at_its_start(monkeypatch):
    # Such a GEMV (the 8B down_proj: 64 programs on 132 SMs) lets the norm and the next qkv GEMV
    # settle on its idle SMs; a GEMV of more programs than SMs releases after its K loop, so that
    # nothing scheduled early takes the SMs of its later waves (releases_at_start).
    from pieceworks.kernels.gemv import triton_gemv

    launches: list[tuple[tuple, dict]] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(triton_gemv, "_gemv_kernel", Recorder())
    monkeypatch.setattr(triton_gemv, "programmatic_launch", lambda device: True)
    x, weight = operands(1, 4 * 64, 96, torch.float32)
    for num_sms in (None, 4, 5):  # None: not a GPU the kernels run compiled on
        monkeypatch.setattr(triton_gemv.triton_gemv_config, "num_sms", lambda d, n=num_sms: n)
        launch_gemv(x, weight)  # 4 programs of 64 columns
    grids = {grid for grid, _ in launches}
    assert grids == {(4,)}, grids
    assert [launch["RELEASE_AT_START"] for _, launch in launches] == [False, False, True]
    assert triton_gemv.releases_at_start(200, True, x.device)  # the rotary form: always


@requires_triton
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,in_features,config", HEADS)
def test_fp8_rope_kernel_matches_float64_reference(
    out_dtype, num_tokens, num_heads, num_kv_heads, head_size, in_features, config
):
    """FP8 operands: the product scaled first, rounded to the output dtype, then rotated."""
    out_features = (num_heads + 2 * num_kv_heads) * head_size
    x_fp8, weight, x_scale, weight_scale = fp8_operands(num_tokens, out_features, in_features)
    rotary_emb, positions = rope_operands(num_tokens, head_size, out_dtype)
    num_rotary_heads = num_heads + num_kv_heads
    rope = RopeEpilogue(positions, rotary_emb.cos_sin_cache, head_size, num_rotary_heads)
    scales = (x_scale, weight_scale)
    output = launch_gemv(x_fp8, weight, config, scales=scales, rope=rope, out_dtype=out_dtype)
    product = (x_fp8.double() @ weight.double().t()) * (x_scale * weight_scale).double()
    stored = product.to(out_dtype)
    if ON_GPU:  # fast accumulation: compare with the tolerance of test_triton_gemv's FP8 tests
        expected = reference(stored.double(), positions, rotary_emb, num_rotary_heads)
        # ... plus, in bfloat16, a product that fast accumulation rounded to the neighbouring
        # bfloat16 value: each of a pair's two values may be one step (2^-7 relative) off
        atol = 2**-6 * float(stored.abs().max()) if out_dtype == torch.bfloat16 else 4e-3
        torch.testing.assert_close(output.double(), expected, rtol=4e-3, atol=atol)
        return
    check_rope_kernel(output, stored, positions, rotary_emb, num_heads, num_kv_heads)


def test_rope_tiles_hold_whole_pairs_of_one_head():
    """block_n: the gated rule's (half the plain tile), narrowed until it divides D / 2."""
    assert rope_config(GemvConfig(block_n=32), 128) == GemvConfig(block_n=32)
    assert rope_config(GemvConfig(block_n=32), 32) == GemvConfig(block_n=16)
    assert rope_config(GemvConfig(block_n=32), 16) == GemvConfig(block_n=8)  # llama-tiny
    assert rope_config(GemvConfig(block_n=32), 48) == GemvConfig(block_n=8)
    assert rope_config(GemvConfig(block_n=32), 24) is None  # pairs of 12: no tile of 8 fits


def test_rope_launch_refuses_what_it_cannot_rotate():
    x, weight = operands(2, 3 * 24, 32, torch.float32)
    rotary_emb, positions = rope_operands(2, 24, torch.float32)
    with pytest.raises(ValueError, match="head_size=24 is not a multiple of 16"):
        launch_gemv(x, weight, rope=RopeEpilogue(positions, rotary_emb.cos_sin_cache, 24, 2))
    partial = get_rope(32, 16, MAX_POSITION, 10000.0, None, True, torch.float32).to(DEVICE)
    x, weight = operands(2, 3 * 32, 32, torch.float32)
    with pytest.raises(ValueError, match="cos_sin_cache width 16"):
        launch_gemv(x, weight, rope=RopeEpilogue(positions, partial.cos_sin_cache, 32, 2))
    with pytest.raises(ValueError, match="neither gated"):
        launch_gemv(
            x, weight, gated=True, rope=RopeEpilogue(positions, partial.cos_sin_cache, 32, 2)
        )


def unfused(x, weight, positions, rotary_emb, num_heads, num_kv_heads):
    """The GEMM, then ``rotate_heads`` on the q and k heads, as the Llama layer did before."""
    qkv = F.linear(x, weight)
    qk_size = (num_heads + num_kv_heads) * rotary_emb.head_size
    rotated = rotary_emb.rotate_heads(positions, qkv[:, :qk_size])
    return torch.cat((rotated, qkv[:, qk_size:]), dim=-1)


def assert_same_rotation(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The fallback's Triton rotation against torch's: the same float32 arithmetic, so equal on
    CPU (interpreted); a GPU build may fuse a multiply and an add, one rounding apart."""
    if ON_GPU:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(actual, expected)


def no_launch(*args, **kwargs):
    raise AssertionError("the kernel was launched")


@requires_triton
def test_rope_op_falls_back_to_the_unfused_rotation_past_16_tokens(monkeypatch):
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    monkeypatch.setattr(triton_gemv, "SMALL_WEIGHT_BYTES", 0)  # the test's weight counts as large
    monkeypatch.setattr(triton_gemv_rope, "launch_gemv", no_launch)
    num_heads, num_kv_heads, head_size = 4, 2, 32
    x, weight = operands(MAX_GEMV_TOKENS + 1, 8 * head_size, 64, torch.float32)
    rotary_emb, positions = rope_operands(MAX_GEMV_TOKENS + 1, head_size, torch.float32)
    args = (positions, rotary_emb.cos_sin_cache, head_size, num_heads + num_kv_heads)
    expected = unfused(x, weight, positions, rotary_emb, num_heads, num_kv_heads)
    assert_same_rotation(small_m_rope_linear(x, weight, *args), expected)
    with pytest.raises(AssertionError, match="launched"):  # the patch is live: 16 tokens launch
        small_m_rope_linear(x[:MAX_GEMV_TOKENS], weight, positions[:MAX_GEMV_TOKENS], *args[1:])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fallback_rotation_is_one_in_place_kernel(dtype, monkeypatch):
    """Past 16 tokens the rotation runs as one Triton launch on the GEMM's result (eager torch
    ops would be about ten launches inside the opaque op): q and k heads rotated at each token's
    position, v heads untouched, rounded once like the float64 reference."""
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    num_tokens, num_heads, num_kv_heads, head_size = MAX_GEMV_TOKENS + 3, 4, 2, 32
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size).to(DEVICE, dtype)
    rotary_emb, positions = rope_operands(num_tokens, head_size, dtype)
    expected = reference(qkv.double(), positions, rotary_emb, num_heads + num_kv_heads)
    rotated = triton_gemv_rope.rotate_qk_heads(
        positions, qkv.clone(), rotary_emb.cos_sin_cache, head_size, num_heads + num_kv_heads
    )
    torch.testing.assert_close(rotated.double(), expected.to(dtype).double(), **TOLERANCES[dtype])
    v_columns = (num_heads + num_kv_heads) * head_size
    assert torch.equal(rotated[:, v_columns:], qkv[:, v_columns:])


def test_rope_ops_never_launch_on_cpu_tensors(monkeypatch):
    monkeypatch.setattr(triton_gemv_rope, "launch_gemv", no_launch)
    monkeypatch.setattr(fp8, "launch_gemv", no_launch)
    x, weight = operands(3, 8 * 32, 64, torch.float32)
    rotary_emb, positions = rope_operands(3, 32, torch.float32)
    args = (positions.cpu(), rotary_emb.cos_sin_cache.cpu(), 32, 6)
    output = small_m_rope_linear(x.cpu(), weight.cpu(), *args)
    expected = unfused(x.cpu(), weight.cpu(), positions.cpu(), rotary_emb.cpu(), 4, 2)
    assert torch.equal(output, expected)


def test_fp8_rope_op_falls_back_to_the_fp8_gemm_past_16_tokens(monkeypatch):
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    monkeypatch.setattr(triton_gemv, "SMALL_WEIGHT_BYTES", 0)  # the test's weight counts as large
    monkeypatch.setattr(fp8, "launch_gemv", no_launch)
    num_tokens, head_size = MAX_GEMV_TOKENS + 1, 32
    x_fp8, weight, x_scale, weight_scale = fp8_operands(num_tokens, 8 * head_size, 64)
    rotary_emb, positions = rope_operands(num_tokens, head_size, torch.float32)
    output = fp8.small_m_fp8_rope_linear(
        x_fp8,
        weight,
        x_scale,
        weight_scale,
        positions,
        rotary_emb.cos_sin_cache,
        head_size,
        6,
        torch.float32,
        False,
    )
    qkv = fp8.fp8_gemm(x_fp8, weight, x_scale, weight_scale, torch.float32, None, False)
    assert_same_rotation(output, rotary_emb.rotate_leading_heads(positions, qkv, 6))
    assert x_fp8.dtype == KERNEL_FP8_DTYPE


@pytest.mark.parametrize("rotary_dim,op_form", [(32, True), (16, False)], ids=["full", "partial"])
def test_rotary_takes_the_op_form_only_for_full_neox(rotary_dim, op_form, monkeypatch):
    """With the GEMV ops on, a full neox rotary calls ``pieceworks::rotary_embedding`` (what the
    rope fusion pass folds into the qkv GEMV); a partial rotary (Bamba's) stays plain ATen. Both
    rotate q and k as ``rotate_heads`` does, bit for bit."""

    def built_rope():
        """The rotary with its form chosen by an engine on the current platform."""
        rope = get_rope(32, rotary_dim, MAX_POSITION, 10000.0, None, True, torch.float32)
        rope.choose_kernels(KernelChooser.for_current_platform())
        return rope

    monkeypatch.setenv("PIECEWORKS_SMALL_M_GEMV", "1")
    rotary_emb = built_rope().to(DEVICE)
    assert rotary_emb.uses_op is op_form
    positions = torch.tensor([0, 7, 300], device=DEVICE)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4 * 32, generator=generator).to(DEVICE)
    key = torch.randn(3, 2 * 32, generator=generator).to(DEVICE)
    rotated_query, rotated_key = rotary_emb(positions, query, key)
    torch.testing.assert_close(
        rotated_query, rotary_emb.rotate_heads(positions, query), rtol=0, atol=0
    )
    torch.testing.assert_close(rotated_key, rotary_emb.rotate_heads(positions, key), rtol=0, atol=0)
    monkeypatch.setenv("PIECEWORKS_SMALL_M_GEMV", "0")
    assert not built_rope().uses_op
