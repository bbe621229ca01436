"""The small-M Triton GEMV: the kernel is right, the op routes and traces, Llama decodes the same.

Proves that (1) the kernel's ``x @ W^T`` equals a float64 reference for 1, 3, 8 and 16 tokens,
bfloat16, float16 and float32, with N and K off the block grid and with several K chunks whose
last is partial, and reads nothing past K of rows padded with NaN; (2) ``small_m_linear`` runs
the kernel up to 16 tokens and ``F.linear`` from 17 on (the launcher is replaced by one that
raises), adds a bias, and on a device the kernel is not built for (the CPU) always calls
``F.linear``; (3) the op ``pieceworks::small_m_linear`` traces under ``torch.compile(backend=
"eager", fullgraph=True)`` with a dynamic token count, once for two token counts; (4) llama-tiny
(float32, compiled with the eager backend) decodes the same greedy tokens with the GEMV as
without, eager engines never call it, the flag enters the compile-cache factors, and the qkv
launch carries the rotary epilogue while the graph traces no rotation of its own (the kernel's
rotary mode itself: ``test_gemv_rope.py``); (5) the GEMV
is the default exactly where the platform runs pieceworks' Triton kernels, and the variable wins;
(6) launch configs per shape class, fitted to the device's shared memory.

What runs where: where no GPU is visible the kernel runs in Triton's interpreter on CPU tensors
(this module sets TRITON_INTERPRET=1 before the kernel is imported, like
``test_attention_kernels.py``). The engine itself never sends CPU tensors to the kernel, so (2)'s
routing tests and (4) declare the CPU a kernel device (``triton_device.kernel_runs_on`` patched to
True): in (4) every decode step's linear layers (<= 16 tokens) then run the interpreted kernel
inside the real engine, and the prefill step (29 tokens) runs ``F.linear``. The interpreter cannot
multiply bfloat16 in ``tl.dot`` (triton-lang/triton#11584), so there the kernel widens bfloat16
operands to float32 first (exact) and its float32 -> bfloat16 store truncates instead of rounding:
the bfloat16 tolerance is one bfloat16 step (2^-7 relative), not half of one. On a GPU machine
(variable unset) the same tests run compiled, on the GPU.

Run: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_triton_gemv.py -p no:cacheprovider
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel below is decorated

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pieceworks import envs  # noqa: E402
from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE, static_scaled_fp8_quant  # noqa: E402
from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.kernels import triton_device  # noqa: E402
from pieceworks.kernels.gemv import resident_gemv, triton_gemv, triton_gemv_rope  # noqa: E402
from pieceworks.kernels.gemv import small_m_fp8 as fp8  # noqa: E402
from pieceworks.kernels.gemv.triton_gemv import (  # noqa: E402
    MAX_GEMV_TOKENS,
    MAX_KERNEL_TOKENS,
    SMALL_WEIGHT_BYTES,
    GemvConfig,
    gemv_config,
    launch_gemv,
    max_gemv_tokens,
    small_m_linear,
    small_m_linear_op,
)
from pieceworks.models.layers.activation import silu_and_mul  # noqa: E402
from pieceworks.platforms import current_platform  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402

INTERPRETED = isinstance(triton_gemv._gemv_kernel, InterpretedFunction)
ON_GPU = not INTERPRETED and torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
requires_triton = pytest.mark.skipif(
    not INTERPRETED and not ON_GPU,
    reason="the Triton GEMV was imported compiled before TRITON_INTERPRET=1 was set and no GPU "
    "is visible: run with TRITON_INTERPRET=1 in the environment",
)
# float32: float32 accumulation over K <= 256; bfloat16: one bfloat16 step (see the docstring);
# float16: half a float16 step (rounded to nearest), 2^-11, with slack for the accumulation.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-3),
    torch.float16: dict(rtol=2**-10, atol=1e-3),
}
# (N, K, config): default configs with N and K off the grid; then 4 K chunks, the last of 8.
SHAPES = [(96, 256, None), (50, 100, None), (33, 200, GemvConfig(block_n=16, block_k=64))]


def operands(num_tokens: int, out_features: int, in_features: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(num_tokens * 1000 + out_features + in_features)
    x = torch.randn(num_tokens, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype)


@pytest.fixture
def kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Treat this device as a kernel device; the list collects the token count of every launch."""
    launches: list[int] = []

    def counted_launch(x: torch.Tensor, weight: torch.Tensor, config=None, **epilogue):
        launches.append(x.shape[0])
        EPILOGUES.append(epilogue)
        return launch_gemv(x, weight, config, **epilogue)

    EPILOGUES.clear()
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    monkeypatch.setattr(triton_gemv, "launch_gemv", counted_launch)
    monkeypatch.setattr(triton_gemv_rope, "launch_gemv", counted_launch)
    monkeypatch.setattr(fp8, "launch_gemv", counted_launch)
    monkeypatch.setattr(resident_gemv, "launch_gemv", counted_launch)  # its fallback, on CPU
    return launches


EPILOGUES: list[dict] = []  # kernel_on_cpu: the keyword arguments of every launch


@pytest.fixture
def traced_rotations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Collects one entry per q or k the model rotates as torch ops (``rotate_heads``, the form
    ``RotaryEmbedding`` takes without the op; compiled, counted while Dynamo traces it)."""
    from pieceworks.models.layers.rotary_embedding import RotaryEmbedding

    rotations: list[int] = []
    rotate = RotaryEmbedding.rotate_heads

    def counted_rotate(self, positions, heads):
        rotations.append(heads.shape[-1] // self.head_size)
        return rotate(self, positions, heads)

    monkeypatch.setattr(RotaryEmbedding, "rotate_heads", counted_rotate)
    return rotations


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 16])
@pytest.mark.parametrize("out_features,in_features,config", SHAPES)
def test_kernel_matches_float64_reference(dtype, num_tokens, out_features, in_features, config):
    x, weight = operands(num_tokens, out_features, in_features, dtype)
    output = launch_gemv(x, weight, config)
    assert output.dtype == dtype and output.shape == (num_tokens, out_features)
    expected = x.double() @ weight.double().t()
    torch.testing.assert_close(output.double(), expected, **TOLERANCES[dtype])


@requires_triton
@pytest.mark.parametrize("num_tokens", [17, 40, 64])
def test_kernel_pads_up_to_64_tokens(num_tokens):
    """Beyond 16 tokens the kernel pads to 32 or 64 rows (measured by the benchmark, not routed
    by ``small_m_linear`` yet); more than 64, or more than an explicit config's rows, is refused."""
    x, weight = operands(num_tokens, 50, 100, torch.float32)
    output = launch_gemv(x, weight)
    expected = x.double() @ weight.double().t()
    torch.testing.assert_close(output.double(), expected, **TOLERANCES[torch.float32])
    with pytest.raises(ValueError, match="block_m=16"):
        launch_gemv(x, weight, GemvConfig(block_n=16, block_k=64))
    too_many, _ = operands(MAX_KERNEL_TOKENS + 1, 50, 100, torch.float32)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        launch_gemv(too_many, weight)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_nothing_past_k_in_strided_rows(dtype):
    """Rows of x and W longer than K, padded with NaN: an unmasked read past K poisons y."""
    num_tokens, out_features, in_features = 3, 33, 200
    x, weight = operands(num_tokens, out_features, in_features, dtype)
    padded_x = torch.full((num_tokens, in_features + 8), float("nan"), dtype=dtype, device=DEVICE)
    padded_weight = torch.full_like(padded_x, float("nan"))[:1].repeat(out_features, 1)
    padded_x[:, :in_features], padded_weight[:, :in_features] = x, weight
    config = GemvConfig(block_n=16, block_k=64)  # 4 K chunks, the last ends 56 past K
    output = launch_gemv(padded_x[:, :in_features], padded_weight[:, :in_features], config)
    expected = x.double() @ weight.double().t()
    torch.testing.assert_close(output.double(), expected, **TOLERANCES[dtype])


@requires_triton
def test_up_to_16_tokens_run_the_kernel(kernel_on_cpu):
    x, weight = operands(MAX_GEMV_TOKENS, 40, 64, torch.float32)
    bias = torch.randn(40, device=DEVICE)
    output = small_m_linear(x, weight, bias)
    assert kernel_on_cpu == [MAX_GEMV_TOKENS]
    torch.testing.assert_close(output, F.linear(x, weight, bias), **TOLERANCES[torch.float32])


def test_past_16_tokens_a_large_weight_falls_back_to_f_linear(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("the kernel was launched for more than 16 tokens")

    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    monkeypatch.setattr(triton_gemv, "SMALL_WEIGHT_BYTES", 0)  # the test's weight counts as large
    monkeypatch.setattr(triton_gemv, "launch_gemv", no_launch)
    x, weight = operands(MAX_GEMV_TOKENS + 1, 40, 64, torch.float32)
    assert torch.equal(small_m_linear(x, weight), F.linear(x, weight))
    with pytest.raises(AssertionError, match="launched"):  # the patch is live: 16 tokens launch
        small_m_linear(x[:MAX_GEMV_TOKENS], weight)


@requires_triton
def test_a_small_weight_takes_the_kernel_up_to_64_tokens(kernel_on_cpu):
    x, weight = operands(MAX_KERNEL_TOKENS + 1, 40, 64, torch.float32)
    output = small_m_linear(x[:MAX_KERNEL_TOKENS], weight)
    assert kernel_on_cpu == [MAX_KERNEL_TOKENS]
    torch.testing.assert_close(
        output, F.linear(x[:MAX_KERNEL_TOKENS], weight), **TOLERANCES[torch.float32]
    )
    assert torch.equal(small_m_linear(x, weight), F.linear(x, weight))  # 65 tokens: F.linear
    assert kernel_on_cpu == [MAX_KERNEL_TOKENS]


@pytest.mark.parametrize(
    ("shape", "dtype", "limit"),
    [
        ((6144, 768), torch.bfloat16, 64),  # llama-125m gate_up, 9 MiB
        ((3072, 576), torch.bfloat16, 64),  # SmolLM2-135M gate_up
        ((4096, 4096), torch.bfloat16, 16),  # Llama-3.1-8B o_proj, 32 MiB
        ((4096, 4096), torch.float8_e4m3fn, 16),  # its FP8 form, 16 MiB
        ((SMALL_WEIGHT_BYTES // 2 // 1024, 1024), torch.bfloat16, 64),  # the line itself
        ((SMALL_WEIGHT_BYTES // 2 // 1024 + 1, 1024), torch.bfloat16, 16),  # one row past it
    ],
)
def test_the_token_limit_follows_the_weight_size(shape, dtype, limit):
    assert max_gemv_tokens(torch.empty(shape, dtype=dtype, device="meta")) == limit


def test_cpu_tensors_never_reach_the_kernel(monkeypatch):
    monkeypatch.setattr(triton_gemv, "launch_gemv", lambda *args: pytest.fail("kernel launched"))
    x, weight = torch.randn(1, 64), torch.randn(40, 64)
    assert torch.equal(small_m_linear(x, weight), F.linear(x, weight))


def test_op_traces_with_dynamic_token_count():
    from torch._dynamo.testing import CompileCounterWithBackend

    op = small_m_linear_op()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda x, w: op(x, w) * 2, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    weight = torch.randn(24, 32, device=DEVICE)  # the op is registered for the platform's device
    for num_tokens in (3, 5):
        x = torch.randn(num_tokens, 32, device=DEVICE)
        torch._dynamo.mark_dynamic(x, 0)
        expected = 2 * F.linear(x, weight)
        torch.testing.assert_close(compiled(x, weight), expected, **TOLERANCES[torch.float32])
    assert counter.frame_count == 1  # one trace serves both token counts
    (graph,) = counter.graphs
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert op in targets  # torch.ops.pieceworks.small_m_linear, traced as the op itself
    torch._dynamo.reset()


def greedy_decode(
    num_tokens: int, level: int, quantization: str | None = None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of three prompts, and every step's logits (llama-tiny, float32), with no
    static graphs on any platform: each forward calls the ops, so ``kernel_on_cpu`` counts every
    step's launches on a GPU machine too (a replayed graph calls none)."""
    llm = LLM(
        "llama-tiny",
        compilation_config={"level": level, "backend": "eager", "cudagraph_mode": "NONE"},
        dtype="float32",
        max_num_seqs=4,
        quantization=quantization,
    )
    recorded: list[torch.Tensor] = []
    model = llm.engine.runner.model
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: recorded.append(compute_logits(hidden)) or recorded[-1]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (3, 9, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    llm.shutdown()
    return [output.outputs[0].token_ids for output in outputs], recorded


@requires_triton
def test_llama_decodes_the_same_tokens_through_the_gemv(
    kernel_on_cpu, traced_rotations, monkeypatch
):
    """Compiled (level 3, eager backend: Dynamo traces the op), the decode steps' linear layers
    run the kernel and decode what cuBLAS decodes; eager (level 0) runs the plain ops (the GEMV
    without epilogues, the activation and rotary ops after it), so it calls the kernel as often
    and decodes the same tokens. Compiled, the fusion passes give the qkv launch the rotation and
    the gate/up launch the activation as epilogues, and the graph holds no rotation of its own."""
    monkeypatch.setenv("PIECEWORKS_SMALL_M_GEMV", "0")
    assert envs.compile_factors()["PIECEWORKS_SMALL_M_GEMV"] is False  # enters the cache hash
    tokens, logits = greedy_decode(num_tokens=4, level=3)
    assert kernel_on_cpu == []
    assert traced_rotations  # without the GEMV the graph rotates q and k itself
    monkeypatch.setenv("PIECEWORKS_SMALL_M_GEMV", "1")
    eager_tokens, _ = greedy_decode(num_tokens=4, level=0)
    eager_launches = list(kernel_on_cpu)
    assert eager_launches  # eager (level 0) runs the GEMV ops, as compiled code does
    assert eager_tokens == tokens
    eager_epilogues = list(EPILOGUES)
    assert not any(epilogue.get("rope") is not None or epilogue.get("gated")
                   for epilogue in eager_epilogues)  # fmt: skip
    kernel_on_cpu.clear()
    EPILOGUES.clear()
    traced_rotations.clear()
    gemv_tokens, gemv_logits = greedy_decode(num_tokens=4, level=3)
    assert kernel_on_cpu == eager_launches  # the same launches, token count for token count
    # 2 layers x (qkv, o, gate_up, down) per forward; llama-tiny's weights are small, so the
    # prefill's 29 tokens take the kernel too (max_gemv_tokens)
    assert kernel_on_cpu and len(kernel_on_cpu) % 8 == 0
    assert 29 in kernel_on_cpu and max(kernel_on_cpu) <= MAX_KERNEL_TOKENS
    rope = [epilogue["rope"] for epilogue in EPILOGUES if epilogue.get("rope") is not None]
    assert len(rope) == len(EPILOGUES) // 4  # qkv: one of the 4 launches per layer
    assert all(epilogue.num_rotary_heads == 4 + 2 for epilogue in rope)  # llama-tiny's q and k
    assert len([e for e in EPILOGUES if e.get("gated")]) == len(EPILOGUES) // 4  # gate_up
    assert traced_rotations == []  # the rotary op, fused into the qkv GEMV by the rope pass
    assert gemv_tokens == tokens
    for actual, expected in zip(gemv_logits, logits, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@requires_triton
def test_fp8_llama_decodes_through_the_fp8_gemv(kernel_on_cpu, traced_rotations, monkeypatch):
    """FP8 llama-tiny compiled: every decode step runs qkv (with the rotary epilogue), o and down
    as the FP8 GEMV and gate_up as the gated GEMV that hands down_proj FP8 values; the logits are
    those of the ``fp8_gemm`` path up to float32 accumulation order (same FP8 operands, same
    roundings), and the compiled graph holds no rotation of its own."""
    monkeypatch.setenv("PIECEWORKS_SMALL_M_GEMV", "0")
    tokens, logits = greedy_decode(num_tokens=4, level=3, quantization="fp8")
    assert kernel_on_cpu == []
    assert traced_rotations  # without the GEMV the graph rotates q and k itself
    traced_rotations.clear()
    monkeypatch.setenv("PIECEWORKS_SMALL_M_GEMV", "1")
    gemv_tokens, gemv_logits = greedy_decode(num_tokens=4, level=3, quantization="fp8")
    assert kernel_on_cpu and len(kernel_on_cpu) % 8 == 0  # 2 layers x 4 launches per forward
    gated = [epilogue for epilogue in EPILOGUES if epilogue.get("gated")]
    assert len(gated) == len(EPILOGUES) // 4  # one gated launch per MLP, with the FP8 output
    assert all(epilogue["out_scale"] is not None for epilogue in gated)
    assert all(epilogue["scales"] is not None for epilogue in EPILOGUES)
    rope = [epilogue for epilogue in EPILOGUES if epilogue.get("rope") is not None]
    assert len(rope) == len(EPILOGUES) // 4  # one qkv launch per layer, rotating q and k
    assert traced_rotations == []
    assert gemv_tokens == tokens
    tolerance = 5e-3 if ON_GPU else 1e-4  # GPU: cuBLAS and the FP8 MMA each round their sums
    for actual, expected in zip(gemv_logits, logits, strict=True):
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


def fp8_tolerance(out_dtype: torch.dtype) -> dict[str, float]:
    """FP8 products are exact in float32, but Hopper's FP8 MMA adds them in reduced precision
    (fast accumulation, the kernel's choice: ``triton_gemv.py``): up to 2e-3 on outputs near 1
    measured on an H200, which is below a bfloat16 rounding of the result but not a float32 one."""
    if ON_GPU:
        return dict(rtol=4e-3, atol=4e-3)
    return TOLERANCES[out_dtype]


def fp8_operands(num_tokens: int, out_features: int, in_features: int):
    """FP8 x and W with per-tensor scales; values spread over the e4m3 range."""
    x, weight = operands(num_tokens, out_features, in_features, torch.float32)
    x_scale = torch.tensor(0.02, device=DEVICE)
    weight_scale = weight.abs().max() / 448
    return (
        static_scaled_fp8_quant(x, x_scale),
        static_scaled_fp8_quant(weight, weight_scale),
        x_scale,
        weight_scale,
    )


@requires_triton
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("out_features,in_features,config", SHAPES)
def test_fp8_kernel_matches_the_reference_gemm(
    out_dtype, num_tokens, out_features, in_features, config
):
    x_fp8, weight, x_scale, weight_scale = fp8_operands(num_tokens, out_features, in_features)
    output = launch_gemv(x_fp8, weight, config, scales=(x_scale, weight_scale), out_dtype=out_dtype)
    assert output.dtype == out_dtype and output.shape == (num_tokens, out_features)
    expected = (x_fp8.double() @ weight.double().t()) * (x_scale * weight_scale).double()
    torch.testing.assert_close(output.double(), expected, **fp8_tolerance(out_dtype))


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_gated_kernel_is_silu_and_mul_of_the_product(dtype, num_tokens):
    """[gate; up] weight (2N, K): the epilogue gives silu(gate) * up, with N off the block grid."""
    x, weight = operands(num_tokens, 2 * 45, 200, dtype)
    output = launch_gemv(x, weight, GemvConfig(block_n=16, block_k=64), gated=True)
    assert output.shape == (num_tokens, 45) and output.dtype == dtype
    gate_up = (x.double() @ weight.double().t()).to(dtype)  # what an unfused GEMM stores
    expected = silu_and_mul(gate_up.double())
    torch.testing.assert_close(output.double(), expected, **TOLERANCES[dtype])


@requires_triton
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 16])
def test_fp8_gated_kernel_quantizes_like_the_unfused_layers(model_dtype, num_tokens):
    """The FP8 gated epilogue: gate and up rounded to the model dtype as the unfused GEMM stores
    them, silu(gate) * up in float32 (as Inductor computes the compiled chain, with no rounding
    in between), quantized with the next layer's scale. Its bytes equal that chain's except where
    float32 accumulation order moves a value across a rounding boundary."""
    x_fp8, weight, x_scale, weight_scale = fp8_operands(num_tokens, 2 * 80, 256)
    out_scale = torch.tensor(0.01, device=DEVICE)
    output = launch_gemv(
        x_fp8,
        weight,
        scales=(x_scale, weight_scale),
        gated=True,
        out_dtype=model_dtype,
        out_scale=out_scale,
    )
    assert output.dtype == KERNEL_FP8_DTYPE and output.shape == (num_tokens, 80)
    gate_up = fp8.fp8_gemm(x_fp8, weight, x_scale, weight_scale, model_dtype, None, False)
    expected = static_scaled_fp8_quant(silu_and_mul(gate_up.float()), out_scale)
    same = output.view(torch.uint8) == expected.view(torch.uint8)
    assert same.float().mean() >= 0.98, f"{(~same).sum()} of {same.numel()} FP8 bytes differ"
    # where they differ: by one e4m3 step (2^-3 relative), or near zero, where silu(gate) * up
    # magnifies a rounding of gate, by a few steps of the smallest values (1% of the largest)
    largest = expected.float().abs().max().item()
    torch.testing.assert_close(output.float(), expected.float(), rtol=2**-3, atol=0.01 * largest)


@requires_triton
@pytest.mark.parametrize("quantize", [False, True])
def test_silu_and_mul_epilogue_kernel_matches_torch(quantize, monkeypatch):
    """The gated GEMV's epilogue alone (token counts the GEMV does not take): one kernel, the
    torch values."""
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    gate_up = torch.randn(MAX_GEMV_TOKENS + 3, 2 * 1100, device=DEVICE) * 3  # 2 column blocks
    out_scale = torch.tensor(0.02, device=DEVICE) if quantize else None
    output = triton_gemv.silu_and_mul_epilogue(gate_up, out_scale)
    expected = silu_and_mul(gate_up)
    if quantize:
        expected = static_scaled_fp8_quant(expected, out_scale)
        same = (output.view(torch.uint8) == expected.view(torch.uint8)).float().mean()
        assert output.dtype == KERNEL_FP8_DTYPE and same >= 0.99  # exp's last bit may round across
    rtol = 2**-3 if quantize else 1e-5  # quantized: one e4m3 step where the bytes differ
    torch.testing.assert_close(output.float(), expected.float(), rtol=rtol, atol=1e-5)
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: False)
    torch.testing.assert_close(triton_gemv.silu_and_mul_epilogue(gate_up, out_scale), expected)


def test_fp8_ops_fall_back_to_the_fp8_gemm_past_16_tokens(monkeypatch):
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    monkeypatch.setattr(triton_gemv, "SMALL_WEIGHT_BYTES", 0)  # the test's weight counts as large
    monkeypatch.setattr(fp8, "launch_gemv", lambda *a, **k: pytest.fail("kernel launched"))
    x_fp8, weight, x_scale, weight_scale = fp8_operands(MAX_GEMV_TOKENS + 1, 2 * 24, 64)
    args = (x_fp8, weight, x_scale, weight_scale)
    expected = fp8.fp8_gemm(*args, torch.float32, None, False)
    assert torch.equal(fp8.small_m_fp8_linear(*args, None, torch.float32, False), expected)
    gated = fp8.small_m_fp8_silu_and_mul(*args, x_scale, torch.float32, False)
    assert torch.equal(gated, static_scaled_fp8_quant(silu_and_mul(expected), x_scale))


def test_gemv_is_on_by_default_where_the_platform_runs_triton_kernels(monkeypatch):
    from pieceworks.kernels.chooser import KernelChooser
    from pieceworks.models.layers.quantization import UnquantizedLinearMethod
    from pieceworks.platforms.capability import TRITON
    from tests.kernels.test_programmatic_launch import with_capability

    def built_method() -> UnquantizedLinearMethod:
        """A method whose kernels an engine on the current platform chose."""
        method = UnquantizedLinearMethod()
        method.choose_kernels(KernelChooser.for_current_platform())
        return method

    monkeypatch.delenv("PIECEWORKS_SMALL_M_GEMV", raising=False)
    assert envs.PIECEWORKS_SMALL_M_GEMV is None
    platform = type(current_platform())
    with_capability(monkeypatch, platform, set())
    assert built_method().small_m_gemv is False
    with_capability(monkeypatch, platform, {TRITON})
    assert built_method().small_m_gemv is True
    monkeypatch.setenv("PIECEWORKS_SMALL_M_GEMV", "0")
    assert built_method().small_m_gemv is False  # the variable wins
    with_capability(monkeypatch, platform, set())
    monkeypatch.setenv("PIECEWORKS_SMALL_M_GEMV", "1")
    assert built_method().small_m_gemv is True


def test_gemv_config_follows_the_h200_sweep_and_fits_smaller_shared_memory() -> None:
    """Tiles per shape class (qkv/o, gate_up, down); less shared memory: fewer stages, shorter K."""
    assert gemv_config(1, 6144, 4096) == GemvConfig(block_n=64, block_k=256, num_stages=4)
    assert gemv_config(16, 6144, 4096).block_m == 16 and gemv_config(17, 6144, 4096).block_m == 32
    assert gemv_config(1, 28672, 4096) == GemvConfig(block_n=64, block_k=128, num_stages=4)
    assert gemv_config(1, 4096, 14336) == GemvConfig(block_n=32, block_k=512, num_stages=4)
    assert gemv_config(1, 4096, 4096, element_size=4).block_k == 128  # same bytes per chunk
    assert gemv_config(1, 4096, 100).block_k == 128  # no wider than K needs
    h200 = 232448
    assert gemv_config(1, 4096, 4096, max_shared_bytes=h200).num_stages == 4
    small = 100 * 1024  # e.g. a consumer GPU
    config = gemv_config(1, 4096, 4096, max_shared_bytes=small)
    stage_bytes = (config.block_n + 16) * config.block_k * 2
    assert config.num_stages >= 2 and config.num_stages * stage_bytes <= small
    assert config.block_k == 256 and config.num_stages == 2  # 2 x 40 KiB fits without shrinking K
    tiny = 32 * 1024
    config = gemv_config(1, 4096, 4096, max_shared_bytes=tiny)
    assert config.num_stages == 2 and 2 * (config.block_n + 16) * config.block_k * 2 <= tiny


def test_fp8_and_gated_configs_follow_their_sweeps() -> None:
    """FP8: 64 x 256 bytes of K everywhere, 6 stages except for gate_up (4) and down (8); gated:
    half the columns per program, so the stacked gate and up rows are the plain tile's 64."""
    for n, k, stages in ((6144, 4096, 6), (4096, 4096, 6), (4096, 14336, 8), (28672, 4096, 4)):
        assert gemv_config(1, n, k, element_size=1) == GemvConfig(
            block_k=256, block_n=64, num_stages=stages
        )
    gated = gemv_config(1, 28672, 4096, element_size=1, gated=True)
    assert gated.block_n == 32 and gated.block_k == 256
    assert gemv_config(1, 28672, 4096, gated=True) == GemvConfig(block_n=32, block_k=128)
    # the stacked rows count toward the shared memory: 6 stages of (64 + 16) x 256 bytes fit 120 KiB
    config = gemv_config(1, 4096, 4096, 1, max_shared_bytes=100 * 1024)
    assert config.num_stages * (64 + 16) * config.block_k <= 100 * 1024
