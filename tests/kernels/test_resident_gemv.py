"""The resident-weight FP8 GEMV's host side, on the CPU (``kernels/gemv/resident_gemv.py``).

Gluon kernels do not run under Triton's interpreter: the kernel itself is checked by the GPU tests
(``test_resident_gemv_gpu.py``) and compiled for sm_90 by ``test_kernels_compile.py``. Here: the
copy-group count each iteration waits for, against a simulation of the kernel's commit order for
every resident/streamed split (too small a count reads a chunk still in flight, too large one
waits for copies it does not need); how many chunks stay resident at the 8B shapes, plain and
rotary, and how the rotary form's programs are laid out; that CPU operands never take the kernel;
and that a kernel variant that fails to compile is reported once and the Triton GEMV runs its
products instead.
Run: PYTHONPATH=. python -m pytest tests/kernels/test_resident_gemv.py -q
"""

from __future__ import annotations

import logging

import pytest
import torch

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE
from pieceworks.kernels.gemv import resident_gemv
from pieceworks.kernels.gemv.resident_gemv import (
    copies_align,
    fp8_decode_gemv,
    launch_resident_gemv,
    resident_chunks,
    uses_resident_gemv,
)
from pieceworks.kernels.gemv.resident_gemv_kernel import newer_copy_groups
from pieceworks.kernels.gemv.triton_gemv_config import RopeEpilogue


def committed_groups(chunk: int, resident: int, num_chunks: int) -> list[str]:
    """The copy groups the kernel has committed when iteration ``chunk`` waits, oldest first."""
    groups = [f"w{c}" for c in range(resident)] + ["x"]
    for iteration in range(1, chunk):  # at the end of iteration i: chunk i - 1 + resident
        streamed = iteration - 1 + resident
        if streamed < num_chunks:
            groups.append(f"w{streamed}")
    return groups


@pytest.mark.parametrize("num_chunks", [2, 3, 5, 16, 17])
def test_each_iteration_waits_for_exactly_the_copies_it_reads(num_chunks):
    for resident in range(2, num_chunks + 1):
        for chunk in range(num_chunks):
            groups = committed_groups(chunk, resident, num_chunks)
            needed = max(groups.index(f"w{chunk}"), groups.index("x"))
            assert newer_copy_groups(chunk, resident, num_chunks) == len(groups) - 1 - needed, (
                chunk,
                resident,
                groups,
            )


@pytest.mark.parametrize("num_chunks", [2, 3, 5, 16, 17])
def test_every_mma_reads_its_chunk_and_no_copy_overwrites_a_slot_in_use(num_chunks):
    """Slot contents over the kernel's iterations: MMA i reads slot i % resident, and the copy
    at the end of iteration i (chunk i - 1 + resident) goes to the slot MMA i - 1 read, never
    to the one MMA i may still read (the kernel waits for all but one MMA)."""
    for resident in range(2, num_chunks + 1):
        slots = list(range(resident))  # chunk held by each slot: the resident ones first
        for chunk in range(num_chunks):
            assert slots[chunk % resident] == chunk, (resident, chunk, slots)
            streamed = chunk - 1 + resident
            if chunk >= 1 and streamed < num_chunks:
                target = (chunk - 1) % resident
                assert target != chunk % resident
                slots[target] = streamed


def test_resident_chunks_at_the_8b_o_proj_shape():
    sm90_shared = 232448
    assert resident_chunks(1, 4096, sm90_shared) == 12  # 8 padded tokens: 32 KB of x
    assert resident_chunks(16, 4096, sm90_shared) == 10  # 16 padded tokens: 64 KB of x
    assert resident_chunks(1, 4096, sm90_shared, rope=True) == 12  # and a 2 KB float32 scratch
    assert resident_chunks(1, 4096, sm90_shared - 1, rope=True) == 11


def test_the_rotary_form_copies_fewer_chunks_and_stacks_pairs(monkeypatch):
    """At the 8B qkv shape the rotary form copies ROPE_RESIDENT_CHUNKS of its 16 chunks before
    the wait (room for decode attention's programs), the plain form 12; a program owns 32 pairs
    (64 stacked rows), so qkv's 6144 rows take 96 programs."""
    launches: list[tuple[tuple, dict]] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(resident_gemv.resident_gemv_kernel, "_resident_gemv_kernel", Recorder())
    monkeypatch.setattr(resident_gemv.triton_gemv_config, "max_shared_bytes", lambda d: 232448)
    monkeypatch.setattr(resident_gemv, "programmatic_launch", lambda device: True)
    x = torch.zeros(1, 4096, dtype=KERNEL_FP8_DTYPE)
    scales = (torch.tensor(1.0), torch.tensor(1.0))
    rope = RopeEpilogue(torch.zeros(1, dtype=torch.int64), torch.zeros(8, 128), 128, 40)
    launch_resident_gemv(
        x, torch.zeros(6144, 4096, dtype=KERNEL_FP8_DTYPE), scales, torch.bfloat16, rope
    )
    launch_resident_gemv(x, torch.zeros(4096, 4096, dtype=KERNEL_FP8_DTYPE), scales, torch.bfloat16)
    (rope_grid, rope_launch), (plain_grid, plain_launch) = launches
    assert rope_launch["RESIDENT"] == resident_gemv.ROPE_RESIDENT_CHUNKS == 8
    assert rope_launch["ROPE"] and rope_grid == (96,)
    assert plain_launch["RESIDENT"] == 12 and not plain_launch["ROPE"] and plain_grid == (64,)


def test_copies_must_start_16_byte_aligned():
    """A launch whose x or W rows do not start on 16 bytes does not compile (Triton 3.6: seen
    on the H200 in an FP8 model); such operands take the Triton GEMV."""
    buffer = torch.zeros(2, 4096 + 32, dtype=KERNEL_FP8_DTYPE)
    weight = torch.zeros(64, 4096, dtype=KERNEL_FP8_DTYPE)
    assert copies_align(buffer[:, :4096], weight)  # a row stride of 4128 bytes
    assert not copies_align(buffer[:, 1:4097], weight)  # starts one byte in
    assert not copies_align(
        torch.zeros(2, 4104, dtype=KERNEL_FP8_DTYPE)[:, :4096], weight
    )  # stride 4104
    assert not copies_align(buffer[:, :4096], weight.t().contiguous().t())  # column-major W


def test_cpu_operands_never_take_the_kernel():
    x = torch.zeros(1, 4096, dtype=KERNEL_FP8_DTYPE)
    assert not uses_resident_gemv(x, torch.zeros(4096, 4096, dtype=KERNEL_FP8_DTYPE))


def test_a_variant_that_does_not_compile_is_reported_once_and_replaced(monkeypatch, caplog):
    """A launch that raises is recorded for its variant (K, padded tokens, epilogue, output
    dtype) with one warning; later products of that variant go straight to the Triton GEMV,
    while other variants still take the resident kernel."""
    monkeypatch.setattr(resident_gemv, "_COMPILE_FAILURES", {})
    monkeypatch.setattr(resident_gemv, "uses_resident_gemv", lambda x, w, rope: True)
    tried: list[int] = []

    def kernel_failing_at_k_512(x, weight, scales, out_dtype, rope):
        tried.append(x.shape[1])
        if x.shape[1] == 512:
            raise RuntimeError("PassManager::run failed")
        return "resident"

    monkeypatch.setattr(resident_gemv, "launch_resident_gemv", kernel_failing_at_k_512)
    monkeypatch.setattr(resident_gemv, "launch_gemv", lambda *a, **k: "triton")
    scales = (torch.tensor(1.0), torch.tensor(1.0))

    def gemv(num_tokens: int, in_features: int) -> str:
        x = torch.zeros(num_tokens, in_features, dtype=KERNEL_FP8_DTYPE)
        weight = torch.zeros(64, in_features, dtype=KERNEL_FP8_DTYPE)
        return fp8_decode_gemv(x, weight, scales, torch.bfloat16)

    with caplog.at_level(logging.WARNING):
        assert gemv(1, 512) == "triton"  # tried, failed, replaced
        assert gemv(3, 512) == "triton"  # the same variant (8 padded tokens): not tried again
        assert gemv(1, 1024) == "resident"  # another variant still runs
        assert gemv(12, 512) == "triton"  # 16 padded tokens: a variant of its own, tried
    assert tried == [512, 1024, 512]
    failed = [(512, 8, False, torch.bfloat16), (512, 16, False, torch.bfloat16)]
    assert list(resident_gemv._COMPILE_FAILURES) == failed
    assert all("PassManager" in why for why in resident_gemv._COMPILE_FAILURES.values())
    warnings = [r.getMessage() for r in caplog.records if "does not run with" in r.getMessage()]
    assert len(warnings) == 2 and "K = 512, 8 padded tokens, plain" in warnings[0], warnings
