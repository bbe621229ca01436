"""Whether pieceworks launches its kernels with programmatic dependent launch (PDL).

With PDL a kernel may be scheduled while the kernel before it on the stream still runs; it waits
for that kernel inside (``griddepcontrol.wait``) before it reads its inputs or writes anything, so
its launch and set-up overlap the previous kernel (``kernels/triton_launch.py``). Inductor's
kernels take part through its own switch (``triton.enable_pdl``), which the engine puts into the
compilation config from this decision (``inductor_launch_options``), so a whole decode graph is
chained.

The decision is the platform's capability (``Platform.device_capability()`` has
``programmatic_launch``) and ``PIECEWORKS_PDL``: unset means ``PDL_BY_DEFAULT``; 1 asks for it (a
warning where the platform has none), 0 turns it off. Resolved once per process."""

from __future__ import annotations

import functools
from typing import Any

from pieceworks import envs
from pieceworks.logger import init_logger
from pieceworks.platforms import current_platform
from pieceworks.platforms.capability import PROGRAMMATIC_LAUNCH

logger = init_logger(__name__)

# On: with decode attention launched early, PDL makes 8B decode faster at batch 1 and changes
# batch 64 by about 1% (measured on an H200: docs/performance.md).
PDL_BY_DEFAULT = True


@functools.lru_cache(maxsize=1)
def programmatic_launch_enabled() -> bool:
    """Whether pieceworks' and Inductor's kernels use PDL in this process."""
    platform = current_platform()
    supported = platform.device_capability().has(PROGRAMMATIC_LAUNCH)
    requested = envs.PIECEWORKS_PDL
    if requested is True and not supported:
        logger.warning(
            "PIECEWORKS_PDL=1 is ignored: platform %s has no programmatic dependent launch "
            "(NVIDIA compute capability 9.0 and newer); unset it to silence this",
            platform.name,
        )
    return supported and (PDL_BY_DEFAULT if requested is None else requested)


def inductor_launch_options() -> dict[str, Any]:
    """Inductor's side of the decision: ``{"triton.enable_pdl": True}`` where pieceworks' kernels
    use PDL (and this Inductor has the switch), so the whole decode graph is chained. The engine
    puts it into ``CompilationConfig.inductor_compile_config`` (``engine/arg_utils.py``), which
    enters the compile-cache key."""
    from torch._inductor import config as inductor_config

    if programmatic_launch_enabled() and hasattr(inductor_config.triton, "enable_pdl"):
        return {"triton.enable_pdl": True}
    return {}
