"""The attention kernels compile for an sm_90 GPU, checked on the CPU.

The CPU suite runs Triton kernels under the interpreter (TRITON_INTERPRET=1), which executes them
as Python and never compiles them, so code that only the compiler rejects passes on the CPU and
fails on the GPU (session 9: atomics compiled against the dummy pointers of a one-split launch).
Triton's compiler itself needs no GPU. This test records the launches the attention ops make for
a set of shapes (decode with one split and with several, with and without the fused KV store,
bfloat16 and FP8 output; prefill; the KV store), and compiles each kernel for CUDA sm_90 with
exactly the arguments the launch passes, once as planned on the CPU and once with every
programmatic-dependent-launch switch it has turned on. The compiles run in a subprocess without
TRITON_INTERPRET, because the kernels in the test process may be interpreted. Skipped where this
Triton has no CUDA backend. Not covered: the GEMV and norm kernels (their launches are not
``KernelLaunch`` objects).

Run: PYTHONPATH=. python -m pytest tests/models/test_kernels_compile.py -q
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

TARGET = ("cuda", 90, 32)  # backend, compute capability (H100/H200), warp size
LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.float8_e4m3fn: "*fp8e4nv",
}


def _has_cuda_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(not _has_cuda_backend(), reason="this Triton has no CUDA backend")
def test_attention_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "compiled" in result.stdout, result.stdout


# ---------------------------------------------------------------- the subprocess side


@contextlib.contextmanager
def recording_launches():
    """Replace ``KernelLaunch.__call__`` so that launches are recorded, not run."""
    from pieceworks.models.attention.ops.launch import KernelLaunch

    recorded: list[tuple[KernelLaunch, tuple[torch.Tensor, ...]]] = []
    original = KernelLaunch.__call__
    KernelLaunch.__call__ = lambda self, *tensors: recorded.append((self, tensors))  # type: ignore[method-assign]
    try:
        yield recorded
    finally:
        KernelLaunch.__call__ = original  # type: ignore[method-assign]


def argument_type(value) -> str:
    """Triton's signature type of one launch argument."""
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, float):
        return "fp32"
    return "i32" if -(2**31) <= value < 2**31 else "i64"


def compile_launch(launch, tensors, **overrides) -> None:
    """Compile ``launch.kernel`` for TARGET with the launch's arguments and constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = launch.kernel
    options = {**launch.options, **overrides}
    constexprs = {k: v for k, v in options.items() if k not in LAUNCH_OPTIONS}
    values = iter((*tensors, *launch.scalars))
    signature = {
        name: "constexpr" if name in constexprs else argument_type(next(values))
        for name in kernel.arg_names
    }
    assert next(values, None) is None, f"{kernel.__name__}: more arguments than parameters"
    source = ASTSource(
        kernel,
        signature,
        constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
    )
    compile_options = {k: options[k] for k in LAUNCH_OPTIONS if k in options}
    triton.compile(source, target=GPUTarget(*TARGET), options=compile_options)


def attention_launches() -> list:
    """Every kernel launch of the attention ops over a set of shapes, recorded on the CPU."""
    from pieceworks.models.attention.ops import plan_paged_attention, plan_store_kv_cache

    num_seqs, num_heads, num_kv_heads, head_size, block_size = 2, 32, 8, 128, 16
    key_cache = torch.zeros(16, block_size, num_kv_heads, head_size, dtype=torch.bfloat16)
    block_tables = torch.zeros(num_seqs, 8, dtype=torch.int32)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), 20, dtype=torch.int32)
    scale = torch.tensor(0.5)
    with recording_launches() as recorded:
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
    return recorded


def main() -> None:
    count = 0
    for launch, tensors in attention_launches():
        switches = {k: True for k in ("PDL", "LAUNCH_REDUCE_EARLY") if k in launch.options}
        variants = [{}, {**switches, "launch_pdl": True}] if switches else [{}]
        for overrides in variants:
            compile_launch(launch, tensors, **overrides)
            count += 1
    print(f"compiled {count} kernel variants for {TARGET}")


if __name__ == "__main__":
    main()
