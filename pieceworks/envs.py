"""Every environment variable pieceworks reads, typed and documented, read in one place.

Its own are ``PIECEWORKS_*`` (``environment_variables``); the third-party ones it reads under their
own names are Triton's (``TRITON_CACHE_DIR``, ``TRITON_PTXAS_PATH``), torch's
(``TORCH_COMPILE_DISABLE``) and torchrun's (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``) (``third_party_variables``). Variables are read lazily, each time
they are asked for (``envs.PIECEWORKS_PLATFORM``), so tests can change them with
``monkeypatch.setenv``. Importing this module writes nothing; ``export_variables`` is the one
writer of ``os.environ``, called once per engine start-up, before any kernel compiles
(``core/cache/triton_cache.py``). ``compile_factors()`` names the variables that change compiled
code: only they enter the cache hash. See ``docs/envs.md`` for the user-facing table.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    PIECEWORKS_PLATFORM: str | None
    PIECEWORKS_PLUGINS: list[str] | None
    PIECEWORKS_CACHE_ROOT: str
    PIECEWORKS_DISABLE_COMPILE_CACHE: bool
    PIECEWORKS_LOGGING_LEVEL: str
    PIECEWORKS_DEBUG_DUMP_PATH: str | None
    PIECEWORKS_DEFAULT_MODEL: str
    PIECEWORKS_DIST_TIMEOUT_S: float
    PIECEWORKS_SMALL_M_GEMV: bool | None
    PIECEWORKS_PDL: bool | None
    PIECEWORKS_BOUND_TRITON_LAUNCH: bool
    PIECEWORKS_PRECOMPILE_KERNELS: bool
    TRITON_CACHE_DIR: str | None
    TRITON_PTXAS_PATH: str | None
    TORCH_COMPILE_DISABLE: bool
    RANK: int | None
    WORLD_SIZE: int | None
    LOCAL_RANK: int | None


def _optional_str(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


def _flag(name: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _flag_on_by_default(name: str) -> Callable[[], bool]:
    """Unset or empty: on; else a flag as ``_flag`` reads it."""
    return lambda: _flag(name)() if os.environ.get(name, "").strip() else True


def _optional_flag(name: str) -> Callable[[], bool | None]:
    """Unset or empty: None (the code's own default); else a flag as ``_flag`` reads it."""
    return lambda: _flag(name)() if os.environ.get(name, "").strip() else None


def _optional_int(name: str) -> Callable[[], int | None]:
    """Unset or empty: None; else the integer."""
    return lambda: int(os.environ[name]) if os.environ.get(name, "").strip() else None


def _plugins() -> list[str] | None:
    """Unset: every plugin is allowed (None). Set but empty: none. ``a,b``: only those."""
    value = os.environ.get("PIECEWORKS_PLUGINS")
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _cache_root() -> str:
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "pieceworks")
    return os.path.expanduser(os.environ.get("PIECEWORKS_CACHE_ROOT", default))


environment_variables: dict[str, Callable[[], Any]] = {
    # Force a platform by name (cuda, rocm, cpu, or an out-of-tree plugin's name).
    "PIECEWORKS_PLATFORM": _optional_str("PIECEWORKS_PLATFORM"),
    # Allow-list of out-of-tree platform entry-point names, comma separated.
    "PIECEWORKS_PLUGINS": _plugins,
    # Root of pieceworks' on-disk caches (compile cache under <root>/torch_compile_cache).
    "PIECEWORKS_CACHE_ROOT": _cache_root,
    # 1: never read or write the compile cache.
    "PIECEWORKS_DISABLE_COMPILE_CACHE": _flag("PIECEWORKS_DISABLE_COMPILE_CACHE"),
    # Level of the ``pieceworks`` logger (DEBUG, INFO, WARNING, ERROR).
    "PIECEWORKS_LOGGING_LEVEL": lambda: os.environ.get("PIECEWORKS_LOGGING_LEVEL", "INFO").upper(),
    # Default for CompilationConfig.debug_dump_path when the config leaves it unset.
    "PIECEWORKS_DEBUG_DUMP_PATH": _optional_str("PIECEWORKS_DEBUG_DUMP_PATH"),
    # The model `pieceworks run` builds when given none.
    "PIECEWORKS_DEFAULT_MODEL": lambda: os.environ.get("PIECEWORKS_DEFAULT_MODEL", "llama-tiny"),
    # Seconds a tensor-parallel rank waits in a collective (start-up rendezvous included) before
    # giving up, so that a lost rank ends the run instead of hanging it.
    "PIECEWORKS_DIST_TIMEOUT_S": lambda: float(os.environ.get("PIECEWORKS_DIST_TIMEOUT_S", "300")),
    # Compiled graphs run unquantized linear layers with <= 16 tokens (64 for a weight of at most
    # 12 MiB, triton_gemv.max_gemv_tokens) through the Triton GEMV
    # (pieceworks/kernels/gemv/triton_gemv.py) instead of cuBLAS. Unset: where the platform runs
    # pieceworks' Triton kernels (CUDA, ROCm); 0: never; 1: always.
    "PIECEWORKS_SMALL_M_GEMV": _optional_flag("PIECEWORKS_SMALL_M_GEMV"),
    # Programmatic dependent launch for pieceworks' decode kernels and Inductor's (a kernel may
    # start while the one before it ends, and waits for it inside), where the platform supports
    # it (NVIDIA Hopper and newer): 1 or unset on, 0 off (PDL_BY_DEFAULT in
    # pieceworks/kernels/programmatic_launch.py; what it changes: docs/performance.md).
    "PIECEWORKS_PDL": _optional_flag("PIECEWORKS_PDL"),
    # A launch that pieceworks repeats with the same shapes (the attention layer's, once per
    # shape) calls the Triton binary its first launch compiled, skipping Triton's per-call
    # argument binding (pieceworks/kernels/bound_launch.py): unset or 1 on, 0 off.
    "PIECEWORKS_BOUND_TRITON_LAUNCH": _flag_on_by_default("PIECEWORKS_BOUND_TRITON_LAUNCH"),
    # Before the profiling run, compile every pieceworks Triton kernel the start-up will launch,
    # in a pool of threads, instead of one after another at first launch
    # (pieceworks/kernels/precompile.py): unset or 1 on, 0 off.
    "PIECEWORKS_PRECOMPILE_KERNELS": _flag_on_by_default("PIECEWORKS_PRECOMPILE_KERNELS"),
}

# Third-party variables read under their own names (docs/envs.md, "Other variables").
third_party_variables: dict[str, Callable[[], Any]] = {
    # Triton's kernel-binary directory; unset: the engine points it under the cache root.
    "TRITON_CACHE_DIR": _optional_str("TRITON_CACHE_DIR"),
    # The ptxas Triton assembles with; unset: the platform's choice (CUDA: torch's own).
    "TRITON_PTXAS_PATH": _optional_str("TRITON_PTXAS_PATH"),
    # torch's switch for its compiler, read as torch reads it (exactly "1"): the engine then runs
    # the model uncompiled (``torch_compile_disabled``).
    "TORCH_COMPILE_DISABLE": lambda: os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1",
    # torchrun's rank of this process, the number of ranks, and the rank on this host.
    "RANK": _optional_int("RANK"),
    "WORLD_SIZE": _optional_int("WORLD_SIZE"),
    "LOCAL_RANK": _optional_int("LOCAL_RANK"),
}

# Variables whose value changes the code pieceworks compiles; they enter the compile-cache hash.
# The platform decides dispatch keys, kernels and graph wrappers, so it is one; logging is not.
# The small-M GEMV puts its own op into the traced graph in place of every unquantized linear;
# programmatic launch changes the kernels Inductor generates.
_COMPILE_FACTORS = ("PIECEWORKS_PLATFORM", "PIECEWORKS_SMALL_M_GEMV", "PIECEWORKS_PDL")


def compile_factors() -> dict[str, Any]:
    """The env variables (name -> value) that change compiled code."""
    return {name: environment_variables[name]() for name in _COMPILE_FACTORS}


def torch_compile_disabled() -> bool:
    """Whether torch's compiler is off in this process: ``TORCH_COMPILE_DISABLE=1`` now (set
    before or after torch was imported), or ``torch._dynamo.config.disable`` set. Torch's config is
    read only where it is already imported: this module imports no torch."""
    dynamo_config = sys.modules.get("torch._dynamo.config")
    disabled_in_torch = bool(getattr(dynamo_config, "disable", False))
    return bool(third_party_variables["TORCH_COMPILE_DISABLE"]()) or disabled_in_torch


def export_variables(variables: Mapping[str, str]) -> None:
    """Set third-party ``variables`` in this process's environment, which the processes it starts
    inherit (Inductor's compile workers, tensor-parallel ranks). Called by engine start-up only,
    before any kernel compiles; a variable already set is the caller's to keep."""
    os.environ.update(variables)


def environment() -> dict[str, str]:
    """A copy of this process's whole environment, for a child process started with changes."""
    return dict(os.environ)


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    if name in third_party_variables:
        return third_party_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*environment_variables, *third_party_variables]
