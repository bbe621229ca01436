"""pieceworks' decode kernels compile for an sm_90 GPU, checked on the CPU.

The CPU suite runs Triton kernels under the interpreter (TRITON_INTERPRET=1), which executes them
as Python and never compiles them, so code that only the compiler rejects passes on the CPU and
fails on the GPU (e.g. atomics compiled against the dummy pointers of a one-split launch).
Triton's compiler itself needs no GPU. This test records the kernel launches (`kernel[grid](...)`)
that the ops make for a set of shapes: paged attention (decode with one split and with several,
with and without the fused KV store, bfloat16 and FP8 output; prefill) and the KV store; the GEMV
(bfloat16 and FP8, plain, gated (SiLU; GELU in bfloat16), rotary, FP8 output); RMSNorm + FP8 quant
(plain and residual form); the SiLU-and-mul and rotary kernels that follow a GEMM past 16 tokens;
the Mamba2 mixer's conv1d, chunked scan and state update; the sampler's greedy argmax. It compiles
each kernel for CUDA sm_90 with exactly the arguments the launch passes (those divisible by 16
specialized as a launch does), once as planned on the CPU and once with its
programmatic-dependent-launch switches on, and checks that it fits sm_90's shared memory (a kernel
over it compiles but fails at launch, as a GEMV variant once did); with PDL, that the GEMVs and the
norm read their scales, norm weight and rotary factors before the wait. The compiles run in a
subprocess without TRITON_INTERPRET, because the kernels in the test process may be interpreted.
Skipped where this Triton has no CUDA backend.

Run: PYTHONPATH=. python -m pytest tests/kernels/test_kernels_compile.py -q
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch

TARGET = ("cuda", 90, 32)  # backend, compute capability (H100/H200), warp size
MAX_SHARED_BYTES = 232448  # shared memory one block may use on sm_90 (227 KiB)
LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.bool: "*i1",
}


def _has_cuda_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(not _has_cuda_backend(), reason="this Triton has no CUDA backend")
def test_decode_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "compiled" in result.stdout, result.stdout


# ---------------------------------------------------------------- the subprocess side


@contextlib.contextmanager
def recording_launches():
    """Record ``kernel[grid](*args, **kwargs)`` launches instead of running them."""
    from triton.runtime.jit import JITFunction

    recorded: list[tuple[JITFunction, tuple, dict]] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        recorded.append((self, args, kwargs))

    JITFunction.run = record  # type: ignore[method-assign]
    try:
        yield recorded
    finally:
        JITFunction.run = original  # type: ignore[method-assign]


def argument_type(value) -> str:
    """Triton's signature type of one launch argument."""
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, float):
        return "fp32"
    return "i32" if -(2**31) <= value < 2**31 else "i64"


def divisible_by_16(value) -> bool:
    """Whether a launch would specialize this argument as divisible by 16 (an aligned pointer,
    an integer multiple of 16)."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def compile_kernel(kernel, args, kwargs, **overrides) -> None:
    """Compile ``kernel`` for TARGET with a launch's positional arguments and its keyword
    constexprs and options (every constexpr in pieceworks is passed by keyword)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {**kwargs, **overrides}
    constexprs = {  # a Gluon kernel may take num_warps as a parameter too
        k: v for k, v in options.items() if k not in LAUNCH_OPTIONS or k in kernel.arg_names
    }
    values = iter(args)
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name not in constexprs:
            value = next(values)
            if value is None:  # an absent optional operand: Triton makes it a constexpr
                constexprs[name] = None
            else:
                signature[name] = argument_type(value)
                if divisible_by_16(value):  # as a launch specializes it (pipelining needs it)
                    attrs[(index,)] = [["tt.divisibility", 16]]
        signature.setdefault(name, "constexpr")
    assert next(values, None) is None, f"{kernel.__name__}: more arguments than parameters"
    source_class = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source_class
    source = source_class(
        kernel,
        signature,
        constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )
    compile_options = {k: options[k] for k in LAUNCH_OPTIONS if k in options}
    compiled = triton.compile(source, target=GPUTarget(*TARGET), options=compile_options)
    shared = compiled.metadata.shared
    assert shared <= MAX_SHARED_BYTES, (
        f"{kernel.__name__} {overrides}: {shared} bytes of shared memory, more than sm_90's "
        f"{MAX_SHARED_BYTES}; it would fail at launch (OutOfResources)"
    )
    if options.get("launch_pdl"):
        check_reads_before_wait(kernel.__name__, options, compiled.asm["ptx"])


def check_reads_before_wait(name: str, options: dict, ptx: str) -> None:
    """Kernels launched with PDL read what no kernel of the step writes (scales, the norm
    weight, the rotary factors at the step's positions) before ``griddepcontrol.wait``, so that
    no load round trip follows the kernel before: at least that many global loads precede the
    wait in the PTX (the asm of the wait has side effects, so the compiler keeps the order)."""
    if name in ("_gemv_kernel", "_resident_gemv_kernel"):
        scaled = options.get("SCALED", True)  # the resident GEMV is always FP8
        expected = 2 * scaled + options.get("QUANT_OUT", False) + 3 * options.get("ROPE", False)
    elif name == "_rms_norm_quant_kernel":
        expected = 2  # weight, scale
    else:
        return
    assert ptx.count("griddepcontrol.wait") == 1, f"{name}: one wait expected"
    loads = re.findall(r"\bld\.global", ptx.split("griddepcontrol.wait")[0])
    assert len(loads) >= expected, (
        f"{name} {options}: {len(loads)} global loads before the PDL wait, {expected} expected"
    )


def record_attention() -> None:
    """The attention ops' launches over a set of shapes (inside ``recording_launches``)."""
    from pieceworks.models.attention.ops import plan_paged_attention, plan_store_kv_cache

    num_seqs, num_heads, num_kv_heads, head_size, block_size = 2, 32, 8, 128, 16
    key_cache = torch.zeros(16, block_size, num_kv_heads, head_size, dtype=torch.bfloat16)
    block_tables = torch.zeros(num_seqs, 8, dtype=torch.int32)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), 20, dtype=torch.int32)
    scale = torch.tensor(0.5)
    for max_query_len, splits, store, fp8 in [
        (1, 1, False, False), (1, 1, True, True), (1, 4, False, False), (1, 4, True, False),
        (1, 4, True, True), (4, None, False, False), (4, None, False, True),
    ]:  # fmt: skip
        num_tokens = num_seqs * max_query_len
        query = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.bfloat16)
        key = torch.zeros(num_tokens, num_kv_heads, head_size, dtype=torch.bfloat16)
        output = torch.zeros_like(query, dtype=torch.float8_e4m3fn if fp8 else query.dtype)
        launch = plan_paged_attention(
            query, key_cache, key_cache, output, block_tables=block_tables,
            scale=head_size**-0.5, max_query_len=max_query_len, num_kv_splits=splits,
            new_kv=(key, key) if store else None, quantize_output=fp8,
        )  # fmt: skip
        args = (query, key_cache, key_cache, output, query_start_loc, seq_lens, block_tables)
        extra = {"output_scale": scale} if fp8 else {}
        if store and max_query_len == 1:
            extra["new_kv"] = (key, key, torch.zeros(num_tokens, dtype=torch.int64))
        launch(*args, **extra)
    key = torch.zeros(num_seqs, num_kv_heads, head_size, dtype=torch.bfloat16)
    slot_mapping = torch.zeros(num_seqs, dtype=torch.int64)  # (T,), -1 = padded token
    plan_store_kv_cache(key, key, key_cache, key_cache, slot_mapping)(
        key, key, key_cache, key_cache, slot_mapping
    )


def record_linear_and_norm() -> None:
    """The GEMV's, the norm + quant's and the past-16-token epilogues' launches."""
    from pieceworks.kernels import triton_device
    from pieceworks.kernels.activation.triton_silu_and_mul import silu_and_mul_epilogue
    from pieceworks.kernels.gemv import triton_gemv_config
    from pieceworks.kernels.gemv.resident_gemv import launch_resident_gemv
    from pieceworks.kernels.gemv.triton_gemv import launch_gemv
    from pieceworks.kernels.gemv.triton_gemv_config import RopeEpilogue
    from pieceworks.kernels.gemv.triton_gemv_rope import rotate_qk_heads
    from pieceworks.kernels.norm_quant.triton_norm_quant import (
        fused_add_rms_norm_static_fp8_quant,
        rms_norm_static_fp8_quant,
    )

    triton_device.kernel_runs_on = lambda x: True  # the tensors are CPU tensors; nothing runs
    # tiles as on an sm_90 GPU, whose shared memory bounds the GEMV's stages
    triton_gemv_config.max_shared_bytes = lambda device: MAX_SHARED_BYTES
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    hidden, head_size, num_heads, num_kv_heads = 256, 32, 4, 2
    scale = torch.tensor(0.5)
    qkv_rows = (num_heads + 2 * num_kv_heads) * head_size
    cos_sin = torch.zeros(16, head_size, dtype=bf16)
    for num_tokens in (1, 16):
        positions = torch.zeros(num_tokens, dtype=torch.int64)
        rope = RopeEpilogue(positions, cos_sin, head_size, num_heads + num_kv_heads)
        for dtype in (bf16, fp8):
            x = torch.zeros(num_tokens, hidden, dtype=dtype)
            weight = torch.zeros(2 * hidden, hidden, dtype=dtype)
            qkv_weight = torch.zeros(qkv_rows, hidden, dtype=dtype)
            fp8_args = {"scales": (scale, scale), "out_dtype": bf16} if dtype == fp8 else {}
            launch_gemv(x, weight, **fp8_args)
            launch_gemv(x, weight, gated=True, **fp8_args)
            launch_gemv(x, qkv_weight, rope=rope, **fp8_args)
            launch_gemv(x, weight, gated=True, out_scale=scale, **fp8_args)
        launch_gemv(x.to(bf16), weight.to(bf16), gated=True, activation="gelu_tanh")  # GeGLU
        normed = torch.zeros(num_tokens, hidden, dtype=fp8)
        rows = [torch.zeros(num_tokens, hidden, dtype=bf16) for _ in range(3)]
        rms_norm_static_fp8_quant(normed, rows[0], rows[1][0], scale, 1e-5)
        fused_add_rms_norm_static_fp8_quant(normed, rows[2], rows[0], rows[1], rows[1][0], scale,
                                            1e-5)  # fmt: skip
    # 4 of 16 chunks streamed; none; three chunks (x's rows rounded up to a power of two)
    for num_tokens, in_features in ((1, 4096), (16, 512), (3, 768)):
        x = torch.zeros(num_tokens, in_features, dtype=fp8)
        launch_resident_gemv(x, torch.zeros(128, in_features, dtype=fp8), (scale, scale), bf16)
        # the rotary form: 128-wide heads, 2 rotated of 3 (a v head as it is)
        positions = torch.zeros(num_tokens, dtype=torch.int64)
        rope = RopeEpilogue(positions, torch.zeros(16, 128, dtype=bf16), 128, 2)
        qkv_weight = torch.zeros(3 * 128, in_features, dtype=fp8)
        launch_resident_gemv(x, qkv_weight, (scale, scale), bf16, rope)
    gate_up = torch.zeros(20, 2 * hidden, dtype=bf16)
    silu_and_mul_epilogue(gate_up, None)
    silu_and_mul_epilogue(gate_up, scale)
    qkv = torch.zeros(20, qkv_rows, dtype=bf16)
    rotate_qk_heads(torch.zeros(20, dtype=torch.int64), qkv, cos_sin, head_size, num_heads + 2)


def record_mamba() -> None:
    """The Mamba2 mixer's kernels: prefill conv and scan, decode conv and state update."""
    from pieceworks.kernels.mamba.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
    from pieceworks.kernels.mamba.selective_state_update import selective_state_update
    from pieceworks.kernels.mamba.ssd_scan import mamba_chunk_scan_varlen

    bf16, f32 = torch.bfloat16, torch.float32
    num_heads, head_dim, dstate, d_conv, num_seqs, num_tokens = 4, 16, 16, 4, 2, 8
    conv_dim = num_heads * head_dim + 2 * dstate  # x, B and C of one group
    conv_weight, conv_bias = torch.zeros(conv_dim, d_conv, dtype=bf16), torch.zeros(conv_dim)
    conv_state = torch.zeros(4, conv_dim, d_conv - 1, dtype=bf16)
    ssm_state = torch.zeros(4, num_heads, head_dim, dstate, dtype=f32)
    query_start_loc = torch.tensor([0, 3, num_tokens], dtype=torch.int32)
    slots = torch.arange(num_seqs, dtype=torch.int32)
    has_initial_state = torch.ones(num_seqs, dtype=torch.bool)
    A, D, dt_bias = torch.zeros(num_heads), torch.zeros(num_heads), torch.zeros(num_heads)
    for bias in (conv_bias, None):
        xBC = torch.zeros(num_tokens, conv_dim, dtype=bf16)
        causal_conv1d_varlen(xBC, conv_weight, bias, conv_state, query_start_loc, slots,
                             has_initial_state)  # fmt: skip
        causal_conv1d_update(xBC[:num_seqs], conv_state, conv_weight, bias, slots)
    for rows in (num_tokens, num_seqs):
        x = torch.zeros(rows, num_heads, head_dim, dtype=bf16)
        dt = torch.zeros(rows, num_heads, dtype=bf16)
        B = C = torch.zeros(rows, 1, dstate, dtype=bf16)
        if rows == num_tokens:
            mamba_chunk_scan_varlen(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc,
                                    slots, has_initial_state, chunk_size=16)  # fmt: skip
        else:
            selective_state_update(ssm_state, x, dt, A, B, C, D, dt_bias, slots)
            selective_state_update(ssm_state, x, dt, A, B, C, None, None, slots)


def record_sampling() -> None:
    """The greedy argmax's two stages at the 8B vocabulary, bfloat16 and float32 logits."""
    from pieceworks.kernels.sampling.triton_argmax import launch_row_argmax

    for dtype in (torch.bfloat16, torch.float32):
        launch_row_argmax(torch.zeros(2, 128256, dtype=dtype))


def main() -> None:
    with recording_launches() as recorded:
        record_attention()
        record_linear_and_norm()
        record_mamba()
        record_sampling()
    count = 0
    for kernel, args, kwargs in recorded:
        switches = {k: True for k in ("PDL", "RELEASE_AT_START", "PEEL_FIRST_TILE") if k in kwargs}
        variants = [{}, {**switches, "launch_pdl": True}] if switches else [{}]
        for overrides in variants:
            compile_kernel(kernel, args, kwargs, **overrides)
            count += 1
    print(f"compiled {count} kernel variants for {TARGET}")


if __name__ == "__main__":
    main()
