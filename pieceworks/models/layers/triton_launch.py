"""How pieceworks' decode kernels are launched: programmatic dependent launch (PDL) and L2
prefetch.

Under PDL (``platforms/programmatic_launch.py`` decides where) a kernel may be scheduled while the
kernel before it on the stream still runs. Each such kernel opens with ``pdl_start``: it lets the
kernel after it be scheduled too, then waits until the kernel before it has finished and its
writes are visible; only then does it read its inputs or write anything. What comes before the
wait overlaps the previous kernel: the launch, and for the GEMV the L2 prefetch of its weights
(``prefetch_to_l2``), which never depend on that kernel (``triton_gemv.py``). The kernels that
take part: the GEMV, the fused RMSNorm + FP8 quant, decode attention's split and reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pieceworks.platforms.programmatic_launch import programmatic_launch_enabled

L2_LINE_BYTES = 128  # what one prefetch instruction covers


@triton.jit
def pdl_start():
    """Let the next kernel be scheduled, then wait for the previous one (kernels launched with
    PDL call this before touching memory that another kernel reads or writes)."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_to_l2(pointers):
    """Prefetch the 128-byte line of each pointer in ``pointers`` (any shape) into L2: a hint
    that loads nothing into registers and never faults (NVIDIA PTX; only reached under PDL)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [pointers],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


INTERPRETED = type(pdl_start).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with PDL: where the process uses it, never on
    the CPU or when interpreted."""
    if INTERPRETED or device.type == "cpu":
        return False
    return programmatic_launch_enabled()


def launch_options(pdl: bool) -> dict[str, Any]:
    """The Triton launch options that go with a kernel's ``PDL`` constexpr."""
    return {"launch_pdl": True} if pdl else {}
