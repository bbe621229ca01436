"""The compile cache (SPEC §3): warm starts load, identical pieces compile once, the key follows
traced files, each of the 15 config factors and env, damage (a truncated file, a flipped byte of
the same length) is detected and repaired, racing processes agree.

A 12-layer toy splits into 13 pieces of 3 distinct structures (the first, 11 identical middle ones,
the last), so a cold compile is 3 Inductor compiles and 3 artifacts behind 13 index entries. One
module-scoped cold compile is shared; damage tests work on copies of its cache. Fresh processes
(``compile_cache_worker.py``) prove the warm start and the race. Key tests use the eager backend,
which computes the key but saves nothing. About a minute on 2 CPU cores.
Run: pytest tests/core/cache/test_compile_cache.py
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pieceworks import envs
from pieceworks.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pieceworks.core.cache.cache_key import cache_directory, cache_key_factors, traced_source_files
from pieceworks.core.cache.compile_cache import CompileCache, sha256_of
from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode, PassConfig
from pieceworks.core.counters import compilation_counter
from pieceworks.core.decorators import piecewise_backends, support_torch_compile
from pieceworks.core.forward_context import set_forward_context
from pieceworks.models.loading.presets import get_preset
from tests.core.cache.compile_cache_worker import assert_same_outputs, run_toy
from tests.core.toy_model import SILLY_OP, ToyModel

NUM_LAYERS = 12
NUM_PIECES = NUM_LAYERS + 1  # split at each layer's silly attention
NUM_DISTINCT = 3  # first piece, the 11 identical middle pieces, last piece
REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def cache_on(monkeypatch):
    """The test session turns the cache off (tests/conftest.py); these tests turn it on."""
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)


@pytest.fixture
def warnings_text(caplog, monkeypatch):
    """The text of the ``pieceworks`` warnings logged during the test (call it to read)."""
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="pieceworks")
    return lambda: caplog.text


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """The 12-layer toy compiled cold in this process into a fresh cache root."""
    root = tmp_path_factory.mktemp("cold_root")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
        result = run_toy(str(root), NUM_LAYERS)
    return root, result


def index_entries(cache_dir: str) -> dict[str, dict[str, str]]:
    with open(os.path.join(cache_dir, "index.json")) as file:
        return json.load(file)["entries"]


def assert_cache_intact(cache_dir: str) -> None:
    """Every index entry names an artifact whose checksum matches."""
    entries = index_entries(cache_dir)
    assert len(entries) == NUM_PIECES
    for entry in entries.values():
        assert sha256_of(os.path.join(cache_dir, entry["artifact"])) == entry["sha256"]


def copy_cold_cache(cold, tmp_path: Path) -> tuple[str, str, dict]:
    """A copy of the cold cache root to damage: (root, cache directory, cold run's result)."""
    root, reference = cold
    shutil.copytree(root, tmp_path / "root")
    cache_dir = reference["cache_dir"].replace(str(root), str(tmp_path / "root"))
    return str(tmp_path / "root"), cache_dir, reference


def run_worker(cache_root: Path, out: Path, **env: str) -> subprocess.Popen:
    """Start ``compile_cache_worker`` in a fresh process with the cache on."""
    environment = {k: v for k, v in os.environ.items() if k != "PIECEWORKS_DISABLE_COMPILE_CACHE"}
    command = [sys.executable, "-m", "tests.core.cache.compile_cache_worker"]
    command += ["--cache-root", str(cache_root), "--out", str(out)]
    return subprocess.Popen(command, cwd=REPO_ROOT, env={**environment, **env})


@pytest.mark.inductor
def test_cold_run_compiles_each_distinct_piece_once(cold):
    root, result = cold
    counters = result["counters"]
    assert counters["num_backend_compilations"] == NUM_PIECES
    assert counters["num_inductor_compiles"] == NUM_DISTINCT
    assert counters["num_compiled_artifacts_saved"] == NUM_DISTINCT
    assert counters["num_cache_entries_updated"] == NUM_PIECES  # one entry per piece
    assert counters["num_compiled_artifacts_loaded"] == 0
    cache_dir = result["cache_dir"]
    assert Path(cache_dir).relative_to(root).parts[::2] == ("torch_compile_cache", "rank_0")
    assert_cache_intact(cache_dir)
    assert len({entry["artifact"] for entry in index_entries(cache_dir).values()}) == NUM_DISTINCT
    with open(os.path.join(cache_dir, "cache_key_factors.json")) as file:
        factors = json.load(file)
    assert set(factors) == {"env", "config", "traced_files", "graph_passes", "compiler"}
    assert "tests/core/toy_model.py" in factors["traced_files"]  # package-relative, portable


@pytest.mark.inductor
def test_warm_start_in_a_fresh_process_loads_without_compiling(cold, tmp_path):
    root, reference = cold
    out = tmp_path / "warm.pt"
    # A fresh Inductor cache too: the artifacts alone must be enough.
    worker = run_worker(root, out, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    assert worker.wait(timeout=300) == 0
    result = torch.load(out)
    assert result["cache_dir"] == reference["cache_dir"]
    counters = result["counters"]
    assert counters["num_inductor_compiles"] == 0
    assert counters["num_compiled_artifacts_loaded"] == NUM_DISTINCT  # shared pieces load once
    assert counters["num_compiled_artifacts_saved"] == 0
    assert counters["num_cache_entries_updated"] == 0
    assert_same_outputs(result, reference)


@pytest.mark.inductor
def test_two_processes_racing_on_one_cache_both_succeed(cold, tmp_path, cache_on):
    root = tmp_path / "raced"
    workers = [run_worker(root, tmp_path / f"race_{i}.pt") for i in range(2)]
    assert [worker.wait(timeout=300) for worker in workers] == [0, 0]
    reference = cold[1]
    for i in range(2):
        assert_same_outputs(torch.load(tmp_path / f"race_{i}.pt"), reference)
    with compilation_counter.expect(
        num_inductor_compiles=0,
        num_compiled_artifacts_loaded=NUM_DISTINCT,
        num_cache_entries_updated=0,  # the index the racers left is complete and consistent
    ):
        result = run_toy(str(root), NUM_LAYERS)
    assert_cache_intact(result["cache_dir"])
    assert_same_outputs(result, reference)


@pytest.mark.inductor
def test_corrupt_artifact_is_recompiled_with_a_warning(cold, tmp_path, cache_on, warnings_text):
    root, cache_dir, reference = copy_cold_cache(cold, tmp_path)
    middle = os.path.join(cache_dir, index_entries(cache_dir)["piece_1/general"]["artifact"])
    with open(middle, "r+b") as file:
        file.truncate(os.path.getsize(middle) // 2)
    with compilation_counter.expect(
        num_inductor_compiles=1,  # the middle structure only
        num_compiled_artifacts_loaded=NUM_DISTINCT - 1,
        num_compiled_artifacts_saved=1,
    ):
        result = run_toy(root, NUM_LAYERS)
    assert "piece_1/general unusable" in warnings_text()
    assert_same_outputs(result, reference)
    assert_cache_intact(cache_dir)


@pytest.mark.inductor
def test_artifact_that_fails_to_load_is_replaced(cold, tmp_path, cache_on, warnings_text):
    """Garbage with a matching checksum: the loader fails, the piece is recompiled and saved."""
    root, cache_dir, reference = copy_cold_cache(cold, tmp_path)
    entries = index_entries(cache_dir)
    middle = entries["piece_1/general"]["artifact"]
    Path(cache_dir, middle).write_bytes(b"not an artifact")
    for entry in entries.values():
        if entry["artifact"] == middle:
            entry["sha256"] = sha256_of(os.path.join(cache_dir, middle))
    index = {"version": 1, "entries": entries}
    Path(cache_dir, "index.json").write_text(json.dumps(index))
    with compilation_counter.expect(num_inductor_compiles=1, num_compiled_artifacts_saved=1):
        run_toy(root, NUM_LAYERS)
    assert "loading failed" in warnings_text()
    with compilation_counter.expect(
        num_inductor_compiles=0, num_compiled_artifacts_loaded=NUM_DISTINCT
    ):
        result = run_toy(root, NUM_LAYERS)
    assert_same_outputs(result, reference)


@pytest.mark.inductor
def test_truncated_index_is_rebuilt_with_a_warning(cold, tmp_path, cache_on, warnings_text):
    root, cache_dir, reference = copy_cold_cache(cold, tmp_path)
    index = Path(cache_dir) / "index.json"
    index.write_bytes(index.read_bytes()[:40])
    with compilation_counter.expect(
        num_inductor_compiles=NUM_DISTINCT,
        num_compiled_artifacts_loaded=0,
        num_cache_entries_updated=NUM_PIECES,
    ):
        result = run_toy(root, NUM_LAYERS)
    assert "index.json is unreadable" in warnings_text()
    assert_same_outputs(result, reference)
    assert_cache_intact(cache_dir)


@pytest.mark.inductor
def test_disabled_cache_writes_nothing_but_still_shares_pieces(cold, tmp_path, monkeypatch):
    monkeypatch.setenv("PIECEWORKS_DISABLE_COMPILE_CACHE", "1")
    with compilation_counter.expect(
        num_inductor_compiles=NUM_DISTINCT,
        num_compiled_artifacts_saved=0,
        num_compiled_artifacts_loaded=0,
        num_cache_entries_updated=0,
    ):
        result = run_toy(str(tmp_path), NUM_LAYERS)
    assert not (tmp_path / "torch_compile_cache").exists()
    assert_same_outputs(result, cold[1])


# ---- the key (eager backend: the key is computed, nothing is compiled or saved) ----


@support_torch_compile
class HelperModel(nn.Module):
    """Calls a function of a helper module: Dynamo inlines it, so its file enters the key."""

    def __init__(self, *, config: EngineConfig, prefix: str = "", scale=None) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x) + 1.0


def eager_config(model_config: ModelConfig | None = None, **compilation) -> EngineConfig:
    compilation = {"backend": "eager", "splitting_ops": [SILLY_OP], **compilation}
    return EngineConfig(
        model_config=model_config or ModelConfig(),
        compilation_config=CompilationConfig(**compilation),
    )


def compiled_backend(model: nn.Module, config: EngineConfig):
    """Run ``model`` once (Dynamo traces, the backend computes the key); its backend."""
    with set_forward_context(None, config):
        model(torch.randn(4, 8))
    (backend,) = piecewise_backends(model)
    return backend


def toy_cache_dir(config: EngineConfig) -> str:
    return compiled_backend(ToyModel(config=config, num_layers=1), config).cache_dir


def load_helper(path: Path):
    """Import ``path`` as a module (outside ``sys.modules``: each load reads the file anew)."""
    spec = importlib.util.spec_from_file_location("scale_helper", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_editing_a_traced_helper_file_changes_the_cache_dir(tmp_path):
    helper_file = tmp_path / "scale_helper.py"
    helper_file.write_text("def scale(x):\n    return x * 0.5\n")
    config = eager_config()
    model = HelperModel(config=config, scale=load_helper(helper_file).scale)
    backend = compiled_backend(model, config)
    assert str(helper_file) in backend.cache_key_factors["traced_files"]  # inlined, so traced
    helper_file.write_text("def scale(x):\n    return x * 0.25\n")
    edited_model = HelperModel(config=config, scale=load_helper(helper_file).scale)
    assert compiled_backend(edited_model, config).cache_dir != backend.cache_dir


def test_config_fields_that_change_code_change_the_cache_dir():
    base = toy_cache_dir(eager_config())
    assert toy_cache_dir(eager_config(compile_sizes=[2])) != base
    assert toy_cache_dir(eager_config(ModelConfig(dtype="float16"))) != base
    # Graph modes and capture sizes change what is captured, not what is compiled.
    assert toy_cache_dir(eager_config(cudagraph_mode=CUDAGraphMode.NONE)) == base


class FixedCompiler:
    """A compiler whose own factors never change: only the config varies below."""

    def compute_hash_factors(self) -> dict[str, str]:
        return {"torch": "fixed", "inductor_config": "fixed"}


def keyed_directory(config: EngineConfig) -> str:
    traced_files = [str(REPO_ROOT / "tests/core/toy_model.py")]
    factors = cache_key_factors(config, FixedCompiler(), traced_files)
    return cache_directory(config, factors, "model")


# Every field EngineConfig.compute_factors() covers, each changed alone from its default.
KEY_FACTOR_CHANGES = {
    "hf_config": {
        "model_config": ModelConfig(
            hf_config=get_preset("llama-tiny"), dtype="bfloat16", max_model_len=128
        )
    },
    "dtype": {"model_config": ModelConfig(dtype="float16", max_model_len=128)},
    "quantization": {
        "model_config": ModelConfig(dtype="bfloat16", max_model_len=128, quantization="fp8")
    },
    "max_model_len": {"model_config": ModelConfig(dtype="bfloat16", max_model_len=512)},
    "block_size": {"cache_config": CacheConfig(block_size=32)},
    "kv_cache_dtype": {"cache_config": CacheConfig(kv_cache_dtype="fp8")},
    "mamba_ssm_cache_dtype": {"cache_config": CacheConfig(mamba_ssm_cache_dtype="auto")},
    "tensor_parallel_size": {"parallel_config": ParallelConfig(tensor_parallel_size=2)},
    "level": {"compilation": {"level": CompilationLevel.DYNAMO_ONCE}},
    "backend": {"compilation": {"backend": "inductor"}},
    "splitting_ops": {"compilation": {"splitting_ops": [SILLY_OP, "pieceworks::mamba_mixer2"]}},
    "compile_sizes": {"compilation": {"compile_sizes": [2]}},
    "custom_ops": {"compilation": {"custom_ops": ["none"]}},
    "pass_config": {"compilation": {"pass_config": PassConfig(enable_fusion=False)}},
    "inductor_compile_config": {"compilation": {"inductor_compile_config": {"max_autotune": True}}},
}


def config_with(change: dict) -> EngineConfig:
    compilation = {"backend": "eager", "splitting_ops": [SILLY_OP], **change.get("compilation", {})}
    parts = {name: part for name, part in change.items() if name != "compilation"}
    parts.setdefault("model_config", ModelConfig(dtype="bfloat16", max_model_len=128))
    return EngineConfig(compilation_config=CompilationConfig(**compilation), **parts)


def flat_factors(config: EngineConfig) -> dict:
    factors = config.compute_factors()
    return {**factors.pop("compilation"), **factors}


def test_every_key_factor_changes_the_cache_dir():
    base = config_with({})
    assert set(KEY_FACTOR_CHANGES) == set(flat_factors(base)) and len(KEY_FACTOR_CHANGES) == 15
    directories = {"base": keyed_directory(base)}
    for factor, change in KEY_FACTOR_CHANGES.items():
        config = config_with(change)
        changed = {k for k, v in flat_factors(config).items() if v != flat_factors(base)[k]}
        assert changed == {factor}  # the change touches this factor only
        assert config.compute_hash() != base.compute_hash(), factor
        directories[factor] = keyed_directory(config)
    assert len(set(directories.values())) == len(directories)  # 16 distinct directories
    assert keyed_directory(config_with({})) == directories["base"]  # and the key is stable


def test_a_flipped_byte_fails_the_checksum_with_a_warning(tmp_path, warnings_text):
    """Same length, loadable-looking content: only the SHA-256 can tell the artifact changed."""
    cache = CompileCache(str(tmp_path), {})
    cache.store("piece_0/general", "k0", lambda path: Path(path).write_bytes(b"artifact " * 100))
    path = cache.lookup("piece_0/general", "k0")
    assert path is not None
    content = bytearray(Path(path).read_bytes())
    content[len(content) // 2] ^= 0x01
    Path(path).write_bytes(bytes(content))
    assert CompileCache(str(tmp_path), {}).lookup("piece_0/general", "k0") is None
    assert "piece_0/general unusable" in warnings_text()
    assert "fails its checksum" in warnings_text()


def test_env_factor_changes_the_cache_dir(monkeypatch):
    base = toy_cache_dir(eager_config())
    factors = envs.compile_factors()
    monkeypatch.setattr(envs, "compile_factors", lambda: {**factors, "PIECEWORKS_PLATFORM": "x"})
    assert toy_cache_dir(eager_config()) != base


def test_cache_root_from_config_else_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PIECEWORKS_CACHE_ROOT", str(tmp_path / "env_root"))
    assert toy_cache_dir(eager_config()).startswith(str(tmp_path / "env_root"))
    config_root = str(tmp_path / "config_root")
    assert toy_cache_dir(eager_config(cache_dir=config_root)).startswith(config_root)


def test_eager_backend_saves_nothing(tmp_path, cache_on):
    config = eager_config(cache_dir=str(tmp_path))
    with compilation_counter.expect(num_eager_compiles=2, num_compiled_artifacts_saved=0):
        backend = compiled_backend(ToyModel(config=config, num_layers=1), config)
    assert backend.compile_cache is None
    assert backend.cache_off_reason == "not used (the eager backend has nothing to save)"
    # Only the traced graph is stored (warm starts skip the trace): no artifact directory.
    assert [p.name for p in (tmp_path / "torch_compile_cache").iterdir()] == ["traced_graphs"]


def test_interleaved_writers_keep_one_artifact_and_every_entry(tmp_path):
    """Two processes' views of one directory, interleaved by hand: both miss, both store."""
    first, second = CompileCache(str(tmp_path), {}), CompileCache(str(tmp_path), {})
    assert first.lookup("piece_0/general", "k0") is None
    assert second.lookup("piece_1/general", "k0") is None
    first.store("piece_0/general", "k0", lambda path: Path(path).write_bytes(b"first"))
    second.store("piece_1/general", "k0", lambda path: Path(path).write_bytes(b"second"))
    reread = CompileCache(str(tmp_path), {"config": {"dtype": "float16"}})
    assert set(reread.entries) == {"piece_0/general", "piece_1/general"}  # no lost update
    # The layout of docs/compile_cache.md: the index and the key factors inside the directory.
    assert set(json.loads((tmp_path / "index.json").read_text())["entries"]) == set(reread.entries)
    factors = json.loads((tmp_path / "cache_key_factors.json").read_text())
    assert factors == {"config": {"dtype": "float16"}}
    path = reread.lookup("piece_1/general", "k0")  # the first writer's artifact was kept
    assert path is not None and Path(path).read_bytes() == b"first"
    assert reread.lookup("piece_0/general", "k0") == path


def test_traced_files_unknown_outside_a_trace():
    assert traced_source_files() is None  # the backend then runs with the cache off
