"""Conformance checks of a platform's device, custom-op key, FP8 formats, kernel seam and
distributed backend: the members every platform has, whatever it declares about graphs."""

from __future__ import annotations

import socket
from typing import Any

import torch

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.entrypoints.platform_check.report import (
    CheckFailed,
    CheckOptions,
    CheckSkipped,
    check_library,
)

_KERNEL_PROBE = "pieceworks_check_probe"


def check_device_memory(platform: Any, options: CheckOptions) -> str:
    """Allocate on the device, copy host to device, device to device and back; seeds repeat."""
    device = platform.device()
    host = torch.arange(4096, dtype=torch.float32)
    on_device = host.to(device)
    copy = torch.empty_like(on_device)
    copy.copy_(on_device)
    platform.synchronize()
    if on_device.device.type != platform.device_type:
        raise CheckFailed(f"a tensor for {device} landed on {on_device.device}")
    if not torch.equal(copy.cpu(), host):
        raise CheckFailed("a host -> device -> device -> host round trip changed the values")
    free, total = platform.mem_get_info()
    if not 0 <= free <= total:
        raise CheckFailed(f"mem_get_info() gave free {free} > total {total} bytes")
    draws = []
    for _ in range(2):
        platform.manual_seed(7)
        draws.append(torch.randn(16, device=device).cpu())
    if not torch.equal(*draws):
        raise CheckFailed("manual_seed() did not make device random numbers repeat")
    platform.empty_cache()
    return f"{device}: {total / 1024**3:.1f} GiB total; seeds repeat"


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _double_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def check_dispatch_key(platform: Any, options: CheckOptions) -> str:
    """A toy op registered for the declared dispatch key runs on the platform's device tensors."""
    key = platform.capabilities().dispatch_key
    name = f"double_{key.lower()}"
    op = direct_register_custom_op(
        name, _double, [], _double_fake, target_lib=check_library(), dispatch_key=key
    )
    x = torch.arange(8, dtype=torch.float32, device=platform.device())
    try:
        result = op(x)
    except NotImplementedError as error:
        first = str(error).splitlines()[0]
        raise CheckFailed(
            f"an op registered for dispatch key {key!r} does not run on {x.device} tensors "
            f"({first}); declare the key torch dispatches this device's tensors to"
        ) from error
    if not torch.equal(result.cpu(), torch.arange(8, dtype=torch.float32) * 2):
        raise CheckFailed("the op registered for the dispatch key returned wrong values")
    return f"pieceworks_check::{name} ran under {key}"


def check_fp8_formats(platform: Any, options: CheckOptions) -> str:
    """The device's FP8 format is among the declared ones, and tensors convert to it."""
    declared = platform.capabilities().fp8_formats
    if not declared:
        raise CheckSkipped("no FP8 format declared")
    dtype = platform.device_capability().fp8_dtype
    if dtype not in declared:
        raise CheckFailed(f"the device converts {dtype}, not among the declared {declared}")
    x = torch.tensor([0.5, -1.0, 2.0, 16.0], device=platform.device())
    if not torch.equal(x.to(dtype).to(torch.float32), x):
        raise CheckFailed(f"values exact in {dtype} changed in a round trip through it")
    return f"device format {str(dtype).removeprefix('torch.')}"


def check_kernel_seam(platform: Any, options: CheckOptions) -> str:
    """A kernel registered for this platform is chosen here and only here; every op has one."""
    from pieceworks.kernels import register_kernel, unregister_kernel
    from pieceworks.kernels.chooser import KernelChooser
    from pieceworks.kernels.registry import known_ops

    for op in known_ops():
        KernelChooser.for_platform(platform).choose(op)  # raises where nothing runs here
    register_kernel(
        "rms_norm",
        lambda x, weight, eps: x,
        name=_KERNEL_PROBE,
        platform=platform.name,
        priority=10**6,
    )
    try:
        here = KernelChooser.for_platform(platform).choose("rms_norm").impl.name
        elsewhere = KernelChooser(f"not-{platform.name}", platform.device_capability())
        fallback = elsewhere.choose("rms_norm").impl.name
    finally:
        unregister_kernel("rms_norm", _KERNEL_PROBE)
    if here != _KERNEL_PROBE:
        raise CheckFailed(f"a kernel registered for {platform.name!r} lost to {here!r}")
    if fallback == _KERNEL_PROBE:
        raise CheckFailed("a kernel registered for one platform was chosen on another")
    return f"{len(known_ops())} ops have an implementation; a vendor kernel wins only here"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_rank(rank: int, world_size: int, platform_cls: type, port: int) -> None:
    from pieceworks import platforms

    _all_reduce_on_rank(rank, world_size, platforms.use_platform(platform_cls), port)


def _all_reduce_on_rank(rank: int, world_size: int, platform: Any, port: int) -> None:
    """One rank: join the group, all-reduce ``rank + 1``, expect the sum over ranks."""
    from pieceworks.distributed import parallel_state

    parallel_state.init_distributed_environment(
        world_size, rank, init_method=f"tcp://127.0.0.1:{port}"
    )
    try:
        x = torch.full((8,), float(rank + 1), device=platform.device(rank))
        result = parallel_state.all_reduce(x)
        platform.synchronize()
        expected = world_size * (world_size + 1) / 2
        if not torch.equal(result.cpu(), torch.full((8,), expected)):
            raise CheckFailed(f"all-reduce at world size {world_size} gave {result.tolist()}")
    finally:
        parallel_state.destroy_distributed_environment()


def check_distributed(platform: Any, options: CheckOptions) -> str:
    """The declared backend initialises and all-reduces at world size 1, and 2 where the
    platform has two devices (two processes)."""
    backend = platform.capabilities().dist_backend
    _all_reduce_on_rank(0, 1, platform, _free_port())
    if platform.device_count() < 2:
        return f"{backend}: world size 1 (world size 2 needs 2 devices; {platform.device_count()})"
    import torch.multiprocessing as mp

    mp.spawn(_spawned_rank, args=(2, type(platform), _free_port()), nprocs=2, join=True)
    return f"{backend}: world sizes 1 and 2"
