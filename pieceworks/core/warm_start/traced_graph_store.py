"""``TracedGraphStore``: the split graph Dynamo traced, kept on disk so warm starts skip the trace.

Layout of ``<cache_root>/torch_compile_cache/traced_graphs/<hash>/rank_<r>/<prefix>/``::

    cache_key_factors.json   what <hash> covers (see ``warm_start_factors``)
    manifest.json            the traced source files (path inside its package -> SHA-256) and
                             the graph file's name and SHA-256
    graph-<sha>.pkl          the split graph, each piece's artifact keys, the ``GraphCall``

The compile cache's directory hashes the source files Dynamo traced, which only a trace can name;
this store is keyed by what is known before one (env, config, compiler, torch and Triton versions,
the module's class and state layout, the first call's arguments), and its manifest lists the files
the trace read. A warm start re-hashes those files: all unchanged, and the compile-cache directory
is the one the traced start used (``cache_key.py``), so its artifacts load. Every reason not to use
a stored graph is returned as text: a factor that differs from the nearest stored graph
(``cache_miss.py``), an edited traced file, or damage (a manifest or graph file that does not parse
or fails its checksum, which the caller warns about). Files are written atomically; the graph file
is named by its content, so a manifest never names a graph another writer half replaced.

The graph is pickled (``torch.fx.GraphModule`` pickles as its generated Python code); loading it
runs that code, so a cache directory deserves the trust of the code it was made from, as
Inductor's own artifacts do.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import platform
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from pieceworks.core.cache.cache_key import module_files
from pieceworks.core.cache.cache_miss import differences, explain_miss
from pieceworks.core.cache.compile_cache import KEY_FACTORS_FILE, sha256_of, write_atomic
from pieceworks.core.compiler_interface import triton_version
from pieceworks.core.graph_call import named_state
from pieceworks.utils import hash_factors

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig
    from pieceworks.core.compiler_interface import CompilerInterface

TRACED_GRAPH_VERSION = 1
MANIFEST_FILE = "manifest.json"


class TracedGraphDamaged(Exception):
    """A stored graph exists but cannot be used (unparsable, failed checksum); says why."""


def state_layout_hash(module: torch.nn.Module) -> str:
    """Hash of every parameter's and buffer's name, dtype, shape and device type."""
    lines = [f"{n} {t.dtype} {tuple(t.shape)} {t.device.type}" for n, t in named_state(module)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def describe_arguments(arguments: dict[str, Any], dynamic_dims: dict[str, Any]) -> dict[str, str]:
    """What the trace specialised on in each argument: tensor dtype, device and the static dims
    (dynamic ones as ``*``), or a constant's repr."""
    described = {}
    for name, value in sorted(arguments.items()):
        if isinstance(value, torch.Tensor):
            dims = dynamic_dims.get(name, [])
            dynamic = {dims} if isinstance(dims, int) else set(dims)
            shape = ["*" if d in dynamic else str(s) for d, s in enumerate(value.shape)]
            described[name] = f"{value.dtype} {value.device.type} ({', '.join(shape)})"
        else:
            described[name] = repr(value)[:200]
    return described


def warm_start_factors(
    config: EngineConfig,
    compiler: CompilerInterface,
    module: torch.nn.Module,
    arguments: dict[str, str],
) -> dict[str, Any]:
    """Every factor of the stored graph's key known before a trace, JSON-ready."""
    from pieceworks import envs

    cls = type(module)
    return {
        "format": TRACED_GRAPH_VERSION,
        "env": envs.compile_factors(),
        "config": config.compute_factors(),
        "compiler": compiler.compute_hash_factors(),
        "versions": {
            "torch": str(torch.__version__),
            "torch_git": torch.version.git_version,
            "triton": triton_version(),
            "python": platform.python_version(),
        },
        "module": {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "state": state_layout_hash(module),
            "training": module.training,
        },
        "call": {
            "arguments": arguments,
            "grad_enabled": torch.is_grad_enabled(),
            "inference_mode": torch.is_inference_mode_enabled(),
        },
    }


def portable_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` that pickles: a fresh graph, and only the attributes its nodes use
    (Dynamo's graph modules carry a shape environment and other unpicklable state)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    root: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            # Through ``_modules``: the backend shadows a compiled piece on the instance.
            module = _registered_submodule(gm, node.target)
            if isinstance(module, torch.fx.GraphModule):
                module = portable_graph_module(module)
            root[node.target] = module
        elif node.op == "get_attr":
            root[node.target] = getattr(gm, node.target)
    return torch.fx.GraphModule(root, graph)


def _registered_submodule(module: torch.nn.Module, target: str) -> torch.nn.Module:
    for name in target.split("."):
        module = module._modules[name]  # type: ignore[assignment]
    return module


def resolve_traced_files(relative_paths: list[str]) -> list[str] | str:
    """This process's file of each package-relative path; a reason when one has none."""
    by_relative = {relative: file for file, relative in module_files()}
    files = []
    for path in relative_paths:
        file = by_relative.get(path, path if os.path.isabs(path) else None)
        real = None if file is None else os.path.realpath(file)
        if real is None or not os.path.isfile(real):
            return f"traced file {path} is not imported in this process"
        files.append(real)
    return files


class TracedGraphStore:
    """The stored graph of one module, rank and set of pre-trace factors."""

    def __init__(self, config: EngineConfig, factors: dict[str, Any], prefix: str) -> None:
        from pieceworks import envs

        root = config.compilation_config.cache_dir or envs.PIECEWORKS_CACHE_ROOT
        self.factors = factors
        self.directory = os.path.join(
            os.path.expanduser(root),
            "torch_compile_cache",
            "traced_graphs",
            hash_factors(factors),
            f"rank_{config.parallel_config.rank}",
            (prefix or "model").replace(os.sep, "_"),
        )
        self.manifest_path = os.path.join(self.directory, MANIFEST_FILE)

    def read_manifest(self) -> dict[str, Any] | str:
        """The manifest, or why there is none (the factors that differ from the nearest)."""
        if not os.path.isfile(self.manifest_path):
            return explain_miss(self.directory, self.factors)
        try:
            with open(self.manifest_path, encoding="utf-8") as file:
                manifest = json.load(file)
            if manifest.get("version") != TRACED_GRAPH_VERSION:
                raise ValueError(f"not a version-{TRACED_GRAPH_VERSION} manifest")
            manifest["traced_files"].items()
            manifest["graph"], manifest["graph_sha256"]  # noqa: B018 (presence check)
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as error:
            raise TracedGraphDamaged(f"{self.manifest_path} is unreadable ({error})") from None
        return manifest

    @staticmethod
    def changed_files(manifest: dict[str, Any], digests: dict[str, str]) -> str | None:
        """Which traced files differ from those the stored graph was traced from; None if none."""
        lines = differences({"traced_files": manifest["traced_files"]}, {"traced_files": digests})
        return "; ".join(lines) if lines else None

    def load_graph(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """The pickled record the manifest names, checked against its SHA-256."""
        path = os.path.join(self.directory, os.path.basename(manifest["graph"]))
        if not os.path.isfile(path) or sha256_of(path) != manifest["graph_sha256"]:
            raise TracedGraphDamaged(f"{path} is missing or fails its checksum")
        try:
            with open(path, "rb") as file:
                record = pickle.load(file)
        except Exception as error:  # a damaged pickle surfaces as any error of its code
            raise TracedGraphDamaged(f"{path} does not load ({error!r})") from None
        if not isinstance(record, dict) or record.get("version") != TRACED_GRAPH_VERSION:
            raise TracedGraphDamaged(f"{path} is not a version-{TRACED_GRAPH_VERSION} graph")
        return record

    def save(self, record: dict[str, Any], traced_files: dict[str, str]) -> None:
        """Write the graph file, then the manifest naming it (raises OSError if unwritable)."""
        data = pickle.dumps({"version": TRACED_GRAPH_VERSION, **record})
        checksum = hashlib.sha256(data).hexdigest()
        name = f"graph-{checksum[:16]}.pkl"
        os.makedirs(self.directory, exist_ok=True)
        factors = json.dumps(self.factors, indent=2, sort_keys=True, default=str).encode()
        write_atomic(os.path.join(self.directory, KEY_FACTORS_FILE), factors)
        write_atomic(os.path.join(self.directory, name), data)
        manifest = {
            "version": TRACED_GRAPH_VERSION,
            "traced_files": traced_files,
            "graph": name,
            "graph_sha256": checksum,
        }
        write_atomic(self.manifest_path, json.dumps(manifest, indent=1, sort_keys=True).encode())
