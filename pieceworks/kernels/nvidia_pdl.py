"""NVIDIA's programmatic dependent launch inside a kernel: ``griddepcontrol`` through Triton.

NVIDIA-only code (``tl.extra.cuda``), called by kernels only under their ``PDL`` constexpr, which
``triton_launch.programmatic_launch`` sets only where the device capability has
``programmatic_launch`` (NVIDIA compute capability 9.0 and newer): on another vendor the branch
is never compiled. ``gdc_wait`` waits until the kernel before on the stream has finished and its
writes are visible; ``gdc_launch_dependents`` lets the next kernel be scheduled now (it waits
for this one in turn); ``pdl_start`` does both, in that order, at a kernel's start.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gdc_wait():
    """Wait for the previous kernel on the stream (``griddepcontrol.wait``)."""
    tl.extra.cuda.gdc_wait()


@triton.jit
def gdc_launch_dependents():
    """Let the next kernel on the stream be scheduled (``griddepcontrol.launch_dependents``)."""
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_start():
    """Let the next kernel be scheduled, then wait for the previous one (kernels launched with
    PDL call this before touching memory that another kernel reads or writes)."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
