"""A compile cache that travels, and says why it missed (SPEC §3 compile cache, §6 warm start).

Proves: a warm start in a fresh process with empty Inductor and Triton caches runs no Dynamo trace
and no Inductor compile (the stored graph and every artifact load); the same package copied under
another path keys the same caches and loads them (traced files are keyed by package-relative path
and content); a read-only cache (``chmod -R a-w``) is read, not ignored; an artifact damaged
under a stored graph is reported with a warning, traced and recompiled; a miss is logged with its
reason, and ``explain_miss`` names an edited source file, a torch version or a config change
(a value longer than 60 characters cut), from the nearest readable neighbour (not the cache
itself; the first by name of equally near ones), in a message whose every part is checked,
with the differences past six counted; factors are compared by dotted path. On a GPU, the
Triton kernels of a warm start come out of the artifacts (Inductor's Triton bundle).
One module-scoped cold compile of a 2-layer toy (3 pieces, 3 distinct structures: first, middle,
last) is shared; fresh processes (``compile_cache_worker.py``) do the warm starts. About three
minutes on 2 CPU cores (each warm process compiles Inductor's C++ kernels from the artifacts'
source again, see docs/compile_cache.md).
Run: pytest tests/core/warm_start/test_warm_start.py
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pieceworks.core.cache.cache_miss import differences, explain_miss, flatten
from pieceworks.core.cache.compile_cache import KEY_FACTORS_FILE
from tests.core.cache.compile_cache_worker import run_toy
from tests.core.cache.test_compile_cache import (
    HelperModel,
    compiled_backend,
    eager_config,
    load_helper,
)

NUM_LAYERS = 2
NUM_DISTINCT = 3  # first piece, the one middle piece, last piece
REPO_ROOT = Path(__file__).resolve().parents[3]
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


class LogRecords(logging.Handler):
    """The messages logged to it, as text."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """The toy compiled cold in this process into a fresh cache root: (root, result), the result
    holding what the backend logged."""
    root = tmp_path_factory.mktemp("cold_root")
    logger = logging.getLogger("pieceworks.core.backend")
    records = LogRecords()
    logger.addHandler(records)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
            result = run_toy(str(root), NUM_LAYERS)
    finally:
        logger.removeHandler(records)
    assert result["counters"]["num_inductor_compiles"] == NUM_DISTINCT
    return root, {**result, "log": records.messages}


def copy_package(destination: Path) -> Path:
    """``pieceworks`` and ``tests`` copied under ``destination`` (another install path)."""
    shutil.copytree(REPO_ROOT / "pieceworks", destination / "pieceworks", ignore=IGNORED)
    shutil.copytree(REPO_ROOT / "tests", destination / "tests", ignore=IGNORED)
    return destination


def run_worker(
    source_root: Path,
    cache_root: Path,
    tmp_path: Path,
    prefix: list[str] | None = None,
    device: str = "cpu",
) -> tuple[dict, str]:
    """The worker from ``source_root`` in a fresh process with empty Inductor and Triton caches:
    (its result, its log)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    environment = {k: v for k, v in os.environ.items() if k != "PIECEWORKS_DISABLE_COMPILE_CACHE"}
    environment.update(
        PYTHONPATH=str(source_root),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        TRITON_CACHE_DIR=str(tmp_path / "triton"),
        PIECEWORKS_LOGGING_LEVEL="INFO",
    )
    out = tmp_path / "result.pt"
    command = [*(prefix or []), sys.executable, "-m", "tests.core.cache.compile_cache_worker"]
    command += ["--cache-root", str(cache_root), "--out", str(out)]
    command += ["--num-layers", str(NUM_LAYERS), "--device", device]
    done = subprocess.run(
        command, cwd=source_root, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return torch.load(out), done.stderr


def assert_warm(result: dict, reference: dict) -> None:
    """Loaded the stored graph and every distinct artifact, traced, compiled and wrote nothing,
    computed the same outputs."""
    counters = result["counters"]
    assert counters["num_dynamo_traces"] == 0
    assert counters["num_traced_graphs_loaded"] == 1
    assert counters["num_graphs_seen"] == 0  # Dynamo handed the backend nothing
    assert counters["num_inductor_compiles"] == 0
    assert counters["num_compiled_artifacts_loaded"] == NUM_DISTINCT
    assert counters["num_compiled_artifacts_saved"] == 0
    assert counters["num_cache_entries_updated"] == 0
    for output, expected in zip(result["outputs"], reference["outputs"], strict=True):
        assert torch.equal(output, expected)


@pytest.mark.inductor
def test_cold_start_stores_the_traced_graph(cold):
    _, result = cold
    assert result["counters"]["num_dynamo_traces"] == 1
    assert result["counters"]["num_traced_graphs_saved"] == 1


@pytest.mark.inductor
def test_warm_start_in_a_fresh_process_neither_traces_nor_compiles(cold, tmp_path):
    root, reference = cold
    result, log = run_worker(REPO_ROOT, root, tmp_path)
    assert "warm start: traced graph loaded" in log
    assert_warm(result, reference)


@pytest.mark.inductor
def test_damaged_artifact_under_a_stored_graph_is_recompiled_with_a_warning(cold, tmp_path):
    root, reference = cold
    shutil.copytree(root, tmp_path / "root")
    cache_dir = Path(reference["cache_dir"].replace(str(root), str(tmp_path / "root")))
    index = json.loads((cache_dir / "index.json").read_text())["entries"]
    middle = cache_dir / index["piece_1/general"]["artifact"]
    middle.write_bytes(middle.read_bytes()[: middle.stat().st_size // 2])
    result, log = run_worker(REPO_ROOT, tmp_path / "root", tmp_path)
    assert "the artifact of piece_1/general" in log and "fails its checksum" in log
    assert "piece_1/general unusable" in log  # the trace's compile cache repairs it
    counters = result["counters"]
    assert counters["num_dynamo_traces"] == 1
    assert counters["num_inductor_compiles"] == 1  # the middle structure only
    assert counters["num_compiled_artifacts_loaded"] == NUM_DISTINCT - 1  # nothing loaded twice
    for output, expected in zip(result["outputs"], reference["outputs"], strict=True):
        assert torch.equal(output, expected)
    repaired, _ = run_worker(REPO_ROOT, tmp_path / "root", tmp_path / "again")
    assert_warm(repaired, reference)


@pytest.mark.gpu
@pytest.mark.inductor
def test_triton_binaries_of_a_warm_start_come_from_the_artifacts(tmp_path):
    """Cold and warm on the GPU, each with empty Inductor and Triton caches: the warm run's
    kernels are written into Triton's cache from the artifacts' Triton bundle, and Triton's
    cache holds nothing else afterwards (a kernel Triton compiled would add its own files)."""
    root = tmp_path / "root"
    cold_result, _ = run_worker(REPO_ROOT, root, tmp_path / "cold", device="cuda")
    assert cold_result["inductor_counters"].get("triton_bundler_save_kernel", 0) > 0
    warm, _ = run_worker(REPO_ROOT, root, tmp_path / "warm", device="cuda")
    assert_warm(warm, cold_result)
    assert warm["inductor_counters"].get("triton_bundler_read_and_emit_kernel", 0) > 0
    cache = tmp_path / "warm" / "triton"
    files = sorted(str(path.relative_to(cache)) for path in cache.rglob("*") if path.is_file())
    # The counter counts files. Triton's driver also builds its own helper module into this
    # cache on first use (cuda_utils.cpython-312-x86_64-linux-gnu.so, hip_utils...): not a
    # kernel, in no bundle.
    emitted = warm["inductor_counters"]["triton_bundler_read_and_emit_kernel"]
    driver_modules = ("cuda_utils.", "hip_utils.")
    kernel_files = [name for name in files if not Path(name).name.startswith(driver_modules)]
    assert len(kernel_files) == emitted, f"{emitted} files from the bundle; Triton's cache: {files}"


@pytest.mark.inductor
def test_same_package_under_another_path_loads_the_cache(cold, tmp_path):
    root, reference = cold
    source_root = copy_package(tmp_path / "elsewhere")
    result, _ = run_worker(source_root, root, tmp_path)
    assert result["package_dir"] == str(source_root / "pieceworks")  # the copy ran
    assert result["cache_dir"] == reference["cache_dir"]
    assert_warm(result, reference)


def read_only_prefix() -> list[str]:
    """What makes a root process obey file modes (drop the capabilities that bypass them)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: chmod cannot make a directory read-only")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]


@pytest.mark.inductor
def test_read_only_cache_is_read(cold, tmp_path):
    root, reference = cold
    shutil.copytree(root, tmp_path / "root")
    read_only_root = tmp_path / "root"
    subprocess.run(["chmod", "-R", "a-w", str(read_only_root)], check=True)
    try:
        result, log = run_worker(REPO_ROOT, read_only_root, tmp_path, read_only_prefix())
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(read_only_root)], check=True)
    assert "is read-only" in log
    assert "cannot write" not in log  # the cache was not turned off
    assert_warm(result, reference)


@pytest.mark.inductor
def test_a_first_compile_logs_the_miss(cold):
    _, result = cold
    assert any(
        "compile cache miss (compiling every piece): no other compile cache" in message
        for message in result["log"]
    )


def test_an_edited_source_file_is_named_as_the_reason(tmp_path):
    helper_file = tmp_path / "scale_helper.py"
    helper_file.write_text("def scale(x):\n    return x * 0.5\n")
    config = eager_config(cache_dir=str(tmp_path / "root"))
    backend = compiled_backend(
        HelperModel(config=config, scale=load_helper(helper_file).scale), config
    )
    write_neighbour(Path(backend.cache_dir), backend.cache_key_factors)
    helper_file.write_text("def scale(x):\n    return x * 0.25\n")
    edited = compiled_backend(
        HelperModel(config=config, scale=load_helper(helper_file).scale), config
    )
    reason = explain_miss(edited.cache_dir, edited.cache_key_factors)
    assert f"differs in 1 factor(s): traced_files.{helper_file}: changed" in reason


def write_neighbour(cache_dir: Path, factors: dict) -> None:
    cache_dir.mkdir(parents=True)
    (cache_dir / KEY_FACTORS_FILE).write_text(json.dumps(factors, default=str))


FACTORS = {
    "env": {"PIECEWORKS_X": "1"},
    "config": {"max_model_len": 2048, "dtype": "torch.bfloat16"},
    "traced_files": {"pieceworks/models/llama.py": "aa"},
    "compiler": {"torch": "2.13.0", "triton": "3.6.0"},
}


def cache_dir_of(root: Path, key: str) -> Path:
    return root / "torch_compile_cache" / key / "rank_0" / "model"


def test_a_torch_version_change_is_named_as_the_reason(tmp_path):
    write_neighbour(cache_dir_of(tmp_path, "old"), {**FACTORS, "compiler": {"torch": "2.11.0"}})
    reason = explain_miss(str(cache_dir_of(tmp_path, "new")), FACTORS)
    assert "differs in 2 factor(s)" in reason
    assert "compiler.torch: '2.11.0' -> '2.13.0'" in reason
    assert "compiler.triton: added" in reason


def test_the_nearest_of_several_caches_is_reported(tmp_path):
    far = {**FACTORS, "config": {"max_model_len": 4096, "dtype": "torch.float16"}}
    near = {**FACTORS, "config": {"max_model_len": 4096, "dtype": "torch.bfloat16"}}
    write_neighbour(cache_dir_of(tmp_path, "far"), far)
    write_neighbour(cache_dir_of(tmp_path, "near"), near)
    reason = explain_miss(str(cache_dir_of(tmp_path, "new")), FACTORS)
    assert f"{cache_dir_of(tmp_path, 'near')}, differs in 1 factor(s)" in reason
    assert "config.max_model_len: 4096 -> 2048" in reason


def test_an_unreadable_neighbour_is_passed_over_for_the_next(tmp_path):
    # "a" sorts first and holds no JSON: it explains nothing, and the search goes on to "b".
    write_neighbour(cache_dir_of(tmp_path, "a"), {})
    (cache_dir_of(tmp_path, "a") / KEY_FACTORS_FILE).write_text("not json")
    write_neighbour(cache_dir_of(tmp_path, "b"), {**FACTORS, "env": {"PIECEWORKS_X": "0"}})
    reason = explain_miss(str(cache_dir_of(tmp_path, "new")), FACTORS)
    assert f"{cache_dir_of(tmp_path, 'b')}, differs in 1 factor(s)" in reason


def test_a_first_compile_says_so(tmp_path):
    write_neighbour(tmp_path / "torch_compile_cache" / "k" / "rank_1" / "model", FACTORS)
    reason = explain_miss(str(cache_dir_of(tmp_path, "new")), FACTORS)  # rank 0: no neighbour
    assert reason.startswith("no other compile cache of model")


def test_source_digests_are_not_printed():
    changed = {**FACTORS, "traced_files": {"pieceworks/models/llama.py": "bb", "b.py": "cc"}}
    assert differences(FACTORS, changed) == [
        "traced_files.b.py: added",
        "traced_files.pieceworks/models/llama.py: changed",
    ]


def test_a_value_is_shown_whole_up_to_sixty_characters_and_cut_beyond():
    whole, cut = "x" * 58, "x" * 59  # reprs of 60 and 61 characters, quotes included
    assert differences({"a": whole, "b": cut}, {"a": 1, "b": 1}) == [
        f"a: '{whole}' -> 1",
        f"b: '{cut[:56]}... -> 1",
    ]


def test_the_miss_message_in_full_with_the_differences_past_six_counted(tmp_path):
    old = {"config": {f"field_{i}": i for i in range(8)}, "gone": 1}
    new = {"config": {f"field_{i}": i + 1 for i in range(7)}, "added": {"x": True}}
    write_neighbour(cache_dir_of(tmp_path, "old"), old)
    reason = explain_miss(str(cache_dir_of(tmp_path, "new")), new)
    # 2 + 7 + 1 + 1 = 10 factors differ: added, 7 changed fields, one removed field, gone.
    assert reason == (
        f"the nearest cache, {cache_dir_of(tmp_path, 'old')}, differs in 10 factor(s): "
        "added.x: added; config.field_0: 0 -> 1; config.field_1: 1 -> 2; config.field_2: 2 -> 3; "
        "config.field_3: 3 -> 4; config.field_4: 4 -> 5; and 4 more"
    )


def test_six_differences_are_all_shown(tmp_path):
    old = {"config": {f"field_{i}": i for i in range(6)}}
    write_neighbour(cache_dir_of(tmp_path, "old"), old)
    new = {"config": {f"field_{i}": -i - 1 for i in range(6)}}
    reason = explain_miss(str(cache_dir_of(tmp_path, "new")), new)
    assert reason.endswith("config.field_5: 5 -> -6")
    assert "more" not in reason


def test_the_cache_itself_and_ties_do_not_change_the_nearest(tmp_path):
    # The cache's own factors file is no neighbour; of two equally near, the first by name wins.
    write_neighbour(cache_dir_of(tmp_path, "new"), FACTORS)
    write_neighbour(cache_dir_of(tmp_path, "b"), {**FACTORS, "env": {"PIECEWORKS_X": "0"}})
    write_neighbour(cache_dir_of(tmp_path, "c"), {**FACTORS, "env": {"PIECEWORKS_X": "2"}})
    reason = explain_miss(str(cache_dir_of(tmp_path, "new")), FACTORS)
    assert reason == (
        f"the nearest cache, {cache_dir_of(tmp_path, 'b')}, differs in 1 factor(s): "
        "env.PIECEWORKS_X: '0' -> '1'"
    )


def test_a_first_compile_names_the_model_and_the_root(tmp_path):
    reason = explain_miss(str(cache_dir_of(tmp_path, "new")), FACTORS)
    root = tmp_path / "torch_compile_cache"
    assert reason == f"no other compile cache of model under {root} (a first compile)"


def test_factors_are_compared_by_dotted_path_empty_dicts_as_values():
    assert flatten({"a": {"b": 1, "c": {}}, "d": [1]}) == {"a.b": 1, "a.c": {}, "d": [1]}
    assert flatten(3) == {"": 3}
    assert differences({"a": {"b": 1}, "gone": 2}, {"a": {"b": 1}}) == ["gone: removed"]
    assert differences({"a": {}}, {"a": {"b": 1}}) == ["a: removed", "a.b: added"]
