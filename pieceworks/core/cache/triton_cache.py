"""The binaries of Triton kernels live in pieceworks' cache, so a warm start loads them.

Triton compiles a kernel the first time a process launches it with a new specialisation and keeps
the binary in its own cache directory (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``).
pieceworks' own kernels (attention, the small-M GEMVs, norm + quant, the argmax) compile in the
uncaptured warm-up before capture, once per distinct shape; with Triton's cache empty, a warm start
compiles every one of them again although the graph and every Inductor artifact load. So unless the
user chose a directory (``TRITON_CACHE_DIR`` set), the engine points Triton at ``triton/`` under
pieceworks' cache root (``CompilationConfig.cache_dir`` or ``PIECEWORKS_CACHE_ROOT``), as vLLM keeps
Inductor's and Triton's caches under its own. Triton keys each binary by the kernel's source, its
specialisation, the Triton version and the target device, so one directory serves every model and
every pieceworks version. With the compile cache disabled (``PIECEWORKS_DISABLE_COMPILE_CACHE=1``)
Triton keeps its own default.

The platform adds what its toolchain needs (``Platform.prepare_kernel_compiler``: on CUDA, the
``ptxas`` Inductor would switch to). ``kernel_compiler_environment`` computes the variables and
reads only; ``use_kernel_compiler_environment`` sets them, once per engine start-up before any
kernel compiles (``worker/executor.make_executor``). They are environment variables rather than
``triton.knobs`` settings because Inductor's compile workers are processes that inherit them.
"""

from __future__ import annotations

import os

from pieceworks import envs
from pieceworks.config import EngineConfig
from pieceworks.logger import init_logger
from pieceworks.platforms.interface import Platform

logger = init_logger(__name__)

TRITON_CACHE_SUBDIR = "triton"


def triton_cache_dir(config: EngineConfig) -> str | None:
    """``triton/`` under pieceworks' cache root, or None where Triton keeps its own directory
    (the user set ``TRITON_CACHE_DIR``, or the compile cache is disabled)."""
    if envs.TRITON_CACHE_DIR is not None or envs.PIECEWORKS_DISABLE_COMPILE_CACHE:
        return None
    root = config.compilation_config.cache_dir or envs.PIECEWORKS_CACHE_ROOT
    return os.path.join(root, TRITON_CACHE_SUBDIR)


def kernel_compiler_environment(
    config: EngineConfig, platform: Platform | None = None
) -> dict[str, str]:
    """The variables an engine sets before its kernels compile: what ``platform`` (the current
    one by default) asks for with ``triton_cache_dir(config)``, less every variable the user
    set already. Sets nothing."""
    if platform is None:
        from pieceworks.platforms import current_platform

        platform = current_platform()
    wanted = platform.prepare_kernel_compiler(triton_cache_dir(config))
    return {name: value for name, value in wanted.items() if name not in envs.environment()}


def use_kernel_compiler_environment(config: EngineConfig) -> dict[str, str]:
    """Set ``kernel_compiler_environment(config)`` in this process (and the processes it starts);
    returns what was set. Engine start-up calls it before its runner is built."""
    environment = kernel_compiler_environment(config)
    if "TRITON_CACHE_DIR" in environment:
        logger.debug("Triton kernel binaries: %s", environment["TRITON_CACHE_DIR"])
    envs.export_variables(environment)
    return environment
