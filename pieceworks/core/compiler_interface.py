"""Compiler adaptors behind one interface: ``eager`` (the FX graph as is) and ``inductor``.

Inductor goes through ``torch._inductor.standalone_compile``: a compile whose artifact can be saved
and loaded, which is what the compile cache (``compile_cache.py``) stores. Autotuning is turned on
only for static sizes, where its cost is paid once for a shape that is reused on every step. Every
piece compiles with pieceworks' post-grad pass manager installed (``core/passes``). Each adaptor
names the factors of its own that change compiled code (for Inductor: the pass manager's uuid
among them); they enter the cache key.
"""

from __future__ import annotations

import platform
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.fx

from pieceworks.core.config import PassConfig
from pieceworks.core.counters import compilation_counter
from pieceworks.utils import hash_factors

if TYPE_CHECKING:
    from pieceworks.core.passes.pass_manager import PostGradPassManager

# Inductor options for a piece compiled for one static token count.
STATIC_SIZE_OPTIONS = {"max_autotune": True, "coordinate_descent_tuning": True}


class CompilerInterface:
    """Compile one piece for the dynamic shape (``runtime_shape=None``) or a static size.

    A compiler whose ``saves_artifacts`` is True can also save a compiled piece to a file and load
    it back; the compile cache uses that. Others are rebuilt every run.
    """

    name = "base"
    saves_artifacts = False

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        options: dict[str, Any],
        runtime_shape: int | None,
    ) -> Callable[..., Any]:
        raise NotImplementedError

    def start_workers(self) -> None:
        """Start what this compiler compiles with in the background, ahead of its first compile
        (called before Dynamo traces, seconds before the first piece compiles)."""

    def compute_hash_factors(self) -> dict[str, Any]:
        """What of this compiler changes the code it produces (enters the cache key)."""
        return {"name": self.name}

    def save_artifact(self, compiled: Callable[..., Any], path: str) -> None:
        raise NotImplementedError(f"the {self.name} compiler saves no artifacts")

    def load_artifact(self, path: str, graph: torch.fx.GraphModule) -> Callable[..., Any]:
        """The artifact at ``path``, callable like the compiled ``graph`` it was saved from."""
        raise NotImplementedError(f"the {self.name} compiler loads no artifacts")


class EagerAdaptor(CompilerInterface):
    """Runs the FX graph as is: fast to build, used by most tests. Nothing to save."""

    name = "eager"

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        options: dict[str, Any],
        runtime_shape: int | None,
    ) -> Callable[..., Any]:
        compilation_counter.num_eager_compiles += 1
        return graph


class InductorAdaptor(CompilerInterface):
    """Inductor through ``standalone_compile`` with pieceworks' passes; binary artifacts."""

    name = "inductor"
    saves_artifacts = True

    def __init__(self, pass_config: PassConfig | None = None) -> None:
        from pieceworks.core.passes.pass_manager import PostGradPassManager

        self.pass_manager: PostGradPassManager = PostGradPassManager(pass_config or PassConfig())

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        options: dict[str, Any],
        runtime_shape: int | None,
    ) -> Callable[..., Any]:
        from torch._inductor import standalone_compile

        config_patches = {
            **options,
            **self.pass_manager.config_patches(),
        }
        if runtime_shape is not None:
            config_patches.update(STATIC_SIZE_OPTIONS)
        dynamic_shapes: Literal["from_tracing_context", "from_example_inputs"] = (
            "from_tracing_context" if runtime_shape is None else "from_example_inputs"
        )
        compilation_counter.num_inductor_compiles += 1
        return standalone_compile(
            graph,
            list(example_inputs),
            dynamic_shapes=dynamic_shapes,
            options={"config_patches": config_patches},
        )

    def start_workers(self) -> None:
        """Start Inductor's pool of compile processes. Until the pool is ready (seconds: each
        process imports torch), Inductor compiles every kernel, and builds its launcher, on the
        calling thread; it starts the pool at its first compile. ``torch.compile``'s own
        ``inductor`` backend starts it when Dynamo begins; ``standalone_compile`` does not, so
        the first pieces of a cold start compiled their kernels one by one on the main thread."""
        try:
            from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool
        except ImportError:  # a torch without it starts the pool at its first compile
            return
        maybe_warm_pool()
        # Inductor sends the pool a no-op job at its first compile and compiles in-process
        # until that job is back; sent now, it is back by then.
        AsyncCompile.use_process_pool()

    def compute_hash_factors(self) -> dict[str, Any]:
        """torch, Triton and Python versions, the target device, Inductor's config, our passes."""
        from pieceworks.platforms import current_platform

        return {
            "name": self.name,
            "torch": torch.__version__,
            "torch_git": torch.version.git_version,
            "triton": triton_version(),
            "python": platform.python_version(),
            "device": current_platform().device_name(),
            "inductor_config": _inductor_config_hash(),
            "static_size_options": STATIC_SIZE_OPTIONS,
            "pass_manager_uuid": self.pass_manager.uuid(),
            "auto_functionalized_v2": False,  # turned off for every piece (config_patches)
        }

    def save_artifact(self, compiled: Callable[..., Any], path: str) -> None:
        compiled.save(path=path, format="binary")  # type: ignore[attr-defined]

    def load_artifact(self, path: str, graph: torch.fx.GraphModule) -> Callable[..., Any]:
        from torch._inductor import CompiledArtifact
        from torch._inductor.compile_fx import graph_returns_tuple

        loaded = CompiledArtifact.load(path=path, format="binary")
        if graph_returns_tuple(graph):
            return lambda *args: tuple(loaded(*args))
        # A loaded artifact returns its outputs as a list even where the graph returns one value
        # (split_module's pieces do); the freshly compiled one unwraps it.
        return lambda *args: loaded(*args)[0]


def triton_version() -> str | None:
    """The installed Triton's version (its kernels' binaries are in the artifacts); None if none."""
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def _inductor_config_hash() -> str:
    """Hash of Inductor's portable config: private, path and cache-control fields left out."""
    from torch._inductor import config

    return hash_factors(config.save_config_portable())


def make_compiler(backend: str, pass_config: PassConfig | None = None) -> CompilerInterface:
    """The adaptor for ``backend``; Inductor runs the passes ``pass_config`` enables."""
    if backend == "inductor":
        return InductorAdaptor(pass_config)
    if backend == "eager":
        return EagerAdaptor()
    raise ValueError(f"compile backend {backend!r} unknown; use one of ['eager', 'inductor']")


def check_inductor_cache_dir() -> None:
    """Refuse an Inductor cache directory that cannot be written (``TORCHINDUCTOR_CACHE_DIR``,
    or Inductor's default) before compiling starts, rather than deep inside the first compile."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    try:
        path = cache_dir()  # it creates the directory
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        path = error.filename or "(unknown)"
        raise ValueError(
            f"Inductor's cache directory {path} is not writable ({error.strerror or error}); "
            "set TORCHINDUCTOR_CACHE_DIR to a writable directory, or compile nothing (-O 0)"
        ) from None
