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

Triton's key also holds the version of the ``ptxas`` that assembles the binary, and Inductor
changes which one mid-process: the first time it compiles a Triton kernel in a process it points
``TRITON_PTXAS_PATH`` at the ``ptxas`` torch ships (``torch/bin/ptxas``;
``torch._inductor.runtime.compile_tasks._set_triton_ptxas_path``), where Triton would use its own.
A cold start compiles with Inductor; a warm start only loads. On the H200 a warm start of
``llama-125m`` compiled 25 kernels the cold start had built (pieceworks' own and 4 of Inductor's;
4.9 s of its 13.5 s), and a second warm start compiled none: the two kinds of process keyed the
same kernels differently, which the ``ptxas`` switch explains. So the engine makes Inductor's
choice up front, before any kernel compiles (``use_torch_ptxas``), and every process assembles
with the same ``ptxas``. A ``TRITON_PTXAS_PATH`` the user set is kept; a torch without its own
``ptxas`` (CPU and ROCm builds) changes nothing. That this removes the warm start's compiles is
still to be measured on the H200 (``docs/performance.md``, "Startup").
"""

from __future__ import annotations

import os
from pathlib import Path

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


def use_torch_ptxas(torch_dir: str | None = None) -> str | None:
    """Point ``TRITON_PTXAS_PATH`` at torch's own ``ptxas`` (``<torch_dir>/bin/ptxas``; the
    installed torch's by default), as Inductor does when it first compiles, unless the user set
    the variable or torch ships none; the path now used, or None when left alone."""
    if "TRITON_PTXAS_PATH" in os.environ:
        return None
    if torch_dir is None:
        import torch

        torch_dir = os.path.dirname(torch.__file__)
    ptxas = Path(torch_dir) / "bin" / "ptxas"
    if not (ptxas.is_file() and os.access(ptxas, os.X_OK)):
        return None
    os.environ["TRITON_PTXAS_PATH"] = str(ptxas)
    logger.debug("Triton assembles with torch's ptxas: %s", ptxas)
    return str(ptxas)
