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
"""

from __future__ import annotations

import os

from pieceworks import envs
from pieceworks.config import EngineConfig
from pieceworks.logger import init_logger

logger = init_logger(__name__)

TRITON_CACHE_SUBDIR = "triton"


def use_pieceworks_triton_cache(config: EngineConfig) -> str | None:
    """Point ``TRITON_CACHE_DIR`` under pieceworks' cache root unless the user set it or the
    compile cache is disabled; the directory Triton now uses, or None when left alone."""
    if "TRITON_CACHE_DIR" in os.environ or envs.PIECEWORKS_DISABLE_COMPILE_CACHE:
        return None
    root = config.compilation_config.cache_dir or envs.PIECEWORKS_CACHE_ROOT
    path = os.path.join(root, TRITON_CACHE_SUBDIR)
    os.environ["TRITON_CACHE_DIR"] = path
    logger.debug("Triton kernel binaries: %s", path)
    return path
