"""What a platform can do: ``PlatformCapabilities`` (declared) and ``DeviceCapability`` (probed).

``PlatformCapabilities`` is the one record of what a platform declares it supports (static graphs,
one graph pool shared by every capture, breakable capture, the custom-op dispatch key, its FP8
formats, the distributed backend); ``Platform.capabilities()`` builds it once from the class's
declarations, and the engine and the conformance check read it instead of trying.

``DeviceCapability`` is what a platform's device is, as facts rather than one flag per kernel.

A platform answers ``device_capability()`` once per process; kernels and layers read it (an
implementation's ``supports`` check, the FP8 format a layer quantizes to) instead of asking the
platform a question of their own. Facts: the vendor, the architecture (NVIDIA compute capability
or AMD's gfx number as a tuple, with its name), compute units and shared memory where known,
named features and the FP8 format the hardware converts natively.

Features (``FEATURES`` lists them): ``triton`` (pieceworks' Triton kernels run compiled here),
``warpgroup_mma`` (Hopper's ``wgmma``), ``programmatic_launch`` (NVIDIA's programmatic dependent
launch, ``griddepcontrol``), ``fp8_gemm`` (FP8 GEMMs run natively, ``torch._scaled_mm``).
"""

from __future__ import annotations

import dataclasses
import re

import torch

TRITON = "triton"
WARPGROUP_MMA = "warpgroup_mma"
PROGRAMMATIC_LAUNCH = "programmatic_launch"
FP8_GEMM = "fp8_gemm"
FEATURES = (TRITON, WARPGROUP_MMA, PROGRAMMATIC_LAUNCH, FP8_GEMM)


@dataclasses.dataclass(frozen=True)
class DeviceCapability:
    """One device kind's facts. ``arch`` is (major, minor) for NVIDIA (compute capability) and
    AMD (gfx942 is (9, 4)); ``fp8_dtype`` is the e4m3 flavour the hardware converts (NVIDIA and
    OCP: ``float8_e4m3fn``; AMD MI300: ``float8_e4m3fnuz``); None where nothing is known."""

    vendor: str  # "nvidia", "amd", "cpu", or an out-of-tree vendor's name
    arch: tuple[int, int] | None = None
    arch_name: str = ""  # "sm_90", "gfx942", ...
    num_compute_units: int | None = None  # SMs (NVIDIA), CUs (AMD)
    shared_memory_per_block: int | None = None  # bytes a block may opt in to
    features: frozenset[str] = frozenset()
    fp8_dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self) -> None:
        unknown = sorted(set(self.features) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown device features {unknown}; known: {', '.join(FEATURES)}")

    def has(self, feature: str) -> bool:
        """Whether the device has ``feature`` (one of ``FEATURES``)."""
        return feature in self.features

    def describe(self) -> str:
        """One line for reports: vendor, architecture, features."""
        arch = self.arch_name or (f"{self.arch[0]}.{self.arch[1]}" if self.arch else "?")
        features = ", ".join(sorted(self.features)) or "none"
        fp8 = str(self.fp8_dtype).removeprefix("torch.")
        return f"{self.vendor} {arch}; features: {features}; fp8: {fp8}"


@dataclasses.dataclass(frozen=True)
class PlatformCapabilities:
    """What a platform declares it supports; the engine reads this, never probes by trying.

    ``static_graphs``: it names a static-graph wrapper; ``graph_pool_sharing``: every graph it
    captures takes memory from one process-wide pool (``Platform.graph_pool()``);
    ``breakable_capture``: its wrapper captures segments (breakable graphs at level 0);
    ``dispatch_key``: the ``torch.library`` key pieceworks' custom ops register under;
    ``fp8_formats``: the FP8 dtypes its devices may convert (the device's own one is
    ``DeviceCapability.fp8_dtype``); ``dist_backend``: the ``torch.distributed`` backend."""

    static_graphs: bool
    graph_pool_sharing: bool
    breakable_capture: bool
    dispatch_key: str
    fp8_formats: tuple[torch.dtype, ...]
    dist_backend: str

    def describe(self) -> str:
        """One line for reports."""
        fp8 = ", ".join(str(dtype).removeprefix("torch.") for dtype in self.fp8_formats)
        return (
            f"static graphs: {'yes' if self.static_graphs else 'no'}; "
            f"shared pool: {'yes' if self.graph_pool_sharing else 'no'}; "
            f"breakable: {'yes' if self.breakable_capture else 'no'}; "
            f"dispatch key: {self.dispatch_key}; fp8: {fp8 or 'none'}; "
            f"distributed: {self.dist_backend}"
        )


CPU_CAPABILITY = DeviceCapability(vendor="cpu", arch_name="cpu")


def nvidia_capability(major: int, minor: int, **facts: object) -> DeviceCapability:
    """An NVIDIA GPU of compute capability ``major.minor``: Triton everywhere, PDL from 9.0,
    ``wgmma`` on 9.x only (Blackwell has its own MMA), native FP8 GEMMs from 8.9."""
    features = {TRITON}
    if (major, minor) >= (9, 0):
        features.add(PROGRAMMATIC_LAUNCH)
    if major == 9:
        features.add(WARPGROUP_MMA)
    if (major, minor) >= (8, 9):
        features.add(FP8_GEMM)
    return DeviceCapability(
        vendor="nvidia",
        arch=(major, minor),
        arch_name=f"sm_{major}{minor}",
        features=frozenset(features),
        fp8_dtype=torch.float8_e4m3fn,
        **facts,  # type: ignore[arg-type]
    )


def amd_capability(gcn_arch_name: str, **facts: object) -> DeviceCapability:
    """An AMD GPU named by its gfx architecture (``gfx942:sramecc+:xnack-``): Triton, no NVIDIA
    features; FP8 in e4m3fnuz on the MI300 family (gfx94x), e4m3fn (OCP) on later ones; native
    FP8 GEMMs (``torch._scaled_mm`` through hipBLASLt) on gfx94x and gfx95x."""
    arch_name = gcn_arch_name.split(":")[0]
    fnuz = arch_name.startswith("gfx94")
    features = {TRITON}
    if arch_name.startswith(("gfx94", "gfx95")):
        features.add(FP8_GEMM)
    return DeviceCapability(
        vendor="amd",
        arch=_gfx_arch(arch_name),
        arch_name=arch_name,
        features=frozenset(features),
        fp8_dtype=torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn,
        **facts,  # type: ignore[arg-type]
    )


def _gfx_arch(arch_name: str) -> tuple[int, int] | None:
    """(major, minor) of a gfx name: gfx942 is (9, 4), gfx90a (9, 0), gfx1100 (11, 0); None for
    a name that is not one (a device without ``gcnArchName`` reports "unknown")."""
    match = re.fullmatch(r"gfx(\d+)(\d)[0-9a-z]", arch_name)  # major, minor, stepping
    return (int(match[1]), int(match[2])) if match else None
