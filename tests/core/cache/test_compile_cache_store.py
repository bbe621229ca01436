"""``CompileCache`` on its own, without a compiler: the index, the checksums and their warnings.

Proves: a stored artifact is found again at ``<dir>/artifacts/<key>.bin`` by a fresh instance and
its entry records its SHA-256; the first writer of a key wins unless ``replace`` is asked for,
and a file no index entry vouches for (a crashed writer's, a damaged one) is overwritten;
``record`` points another entry at an artifact this process already has, writes the index only
when the entry changes, and does nothing for an artifact it never saved or verified; a save that
raises leaves no file behind; an entry that points to another piece's artifact, a missing
artifact and an unreadable or malformed index are each reported with a warning saying what was
wrong and that the piece is recompiled; a writer waits for the directory's lock;
``cache_key_factors.json`` is sorted, indented JSON (two files diff line by line); the cache
directory is ``<root>/torch_compile_cache/<hash>/rank_<r>/<prefix>``; a cache directory it cannot
write is read (its artifacts load) and never written (no artifact, entry or factors file), with
one log line, and its warnings promise no rewrite; without an index to read it raises; the factors
file is written only when the factors differ. About two seconds in all.
Run: pytest tests/core/cache/test_compile_cache_store.py
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from pieceworks.config import EngineConfig, ParallelConfig
from pieceworks.core.cache.cache_key import cache_directory, hash_source_files
from pieceworks.core.cache.compile_cache import CompileCache, sha256_of, write_atomic
from pieceworks.core.config import CompilationConfig
from pieceworks.core.counters import compilation_counter
from pieceworks.utils import hash_factors

ENTRY = "piece_0/general"


@pytest.fixture
def warnings_text(caplog, monkeypatch):
    """The text of the ``pieceworks`` warnings logged during the test (call it to read)."""
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="pieceworks")
    return lambda: caplog.text


@pytest.fixture
def warning_messages(caplog, warnings_text):
    """Each ``pieceworks`` warning's whole message (call it to read)."""
    return lambda: {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}


def writer(content: bytes):
    """A ``save(path)`` callback writing ``content``."""
    return lambda path: Path(path).write_bytes(content)


def index_on_disk(directory: Path) -> dict:
    return json.loads((directory / "index.json").read_text())


def test_a_stored_artifact_is_found_by_a_fresh_instance_with_its_checksum(tmp_path):
    with compilation_counter.expect(num_compiled_artifacts_saved=1, num_cache_entries_updated=1):
        CompileCache(str(tmp_path), {}).store(ENTRY, "k0", writer(b"compiled piece"))
    path = CompileCache(str(tmp_path), {}).lookup(ENTRY, "k0")
    assert path == str(tmp_path / "artifacts" / "k0.bin")
    assert Path(path).read_bytes() == b"compiled piece"
    assert index_on_disk(tmp_path) == {
        "version": 1,
        "entries": {ENTRY: {"artifact": "artifacts/k0.bin", "sha256": sha256_of(path)}},
    }
    assert sorted(os.listdir(tmp_path / "artifacts")) == ["k0.bin"]  # no temporary left behind
    assert CompileCache(str(tmp_path), {}).lookup("piece_1/general", "k0") is None  # no entry


def test_first_writer_wins_unless_replace_is_asked_for(tmp_path):
    cache = CompileCache(str(tmp_path), {})
    cache.store(ENTRY, "k0", writer(b"first"))
    with compilation_counter.expect(num_compiled_artifacts_saved=0, num_cache_entries_updated=1):
        cache.store("piece_1/general", "k0", writer(b"second"))  # an intact artifact is kept
    assert (tmp_path / "artifacts" / "k0.bin").read_bytes() == b"first"
    with compilation_counter.expect(num_compiled_artifacts_saved=1):
        cache.store(ENTRY, "k0", writer(b"replaced"), replace=True)  # it failed to load
    fresh = CompileCache(str(tmp_path), {})
    path = fresh.lookup(ENTRY, "k0")
    assert path is not None and Path(path).read_bytes() == b"replaced"
    assert index_on_disk(tmp_path)["entries"][ENTRY]["sha256"] == sha256_of(path)


@pytest.mark.parametrize("vouched", [False, True])
def test_a_file_the_index_does_not_vouch_for_is_overwritten(tmp_path, vouched):
    """An artifact file without an entry (a writer that died before the index update), or one
    whose bytes no longer match its entry, is not an intact artifact: a store saves anew."""
    cache = CompileCache(str(tmp_path), {})
    if vouched:
        cache.store(ENTRY, "k0", writer(b"good"))
    (tmp_path / "artifacts" / "k0.bin").write_bytes(b"stale")
    with compilation_counter.expect(num_compiled_artifacts_saved=1):
        cache.store("piece_1/general", "k0", writer(b"fresh"))
    assert (tmp_path / "artifacts" / "k0.bin").read_bytes() == b"fresh"
    path = CompileCache(str(tmp_path), {}).lookup("piece_1/general", "k0")
    assert path is not None and sha256_of(path) == sha256_of(tmp_path / "artifacts" / "k0.bin")


def test_record_points_an_entry_at_an_artifact_this_process_has(tmp_path):
    cache = CompileCache(str(tmp_path), {})
    cache.store(ENTRY, "k0", writer(b"shared piece"))
    with compilation_counter.expect(num_cache_entries_updated=1):
        cache.record("piece_1/general", "k0")
        cache.record("piece_1/general", "k0")  # unchanged: the index is not rewritten
    with compilation_counter.expect(num_cache_entries_updated=0):
        cache.record("piece_2/general", "never_saved")
    entries = index_on_disk(tmp_path)["entries"]
    assert set(entries) == {ENTRY, "piece_1/general"}
    assert entries["piece_1/general"] == entries[ENTRY]
    loaded = CompileCache(str(tmp_path), {})  # a warm start verifies, then records
    assert loaded.lookup(ENTRY, "k0") is not None
    with compilation_counter.expect(num_cache_entries_updated=1):
        loaded.record("piece_3/general", "k0")
    assert index_on_disk(tmp_path)["entries"]["piece_3/general"] == entries[ENTRY]


def test_a_save_that_raises_leaves_no_file_and_no_entry(tmp_path):
    def failing_save(path: str) -> None:
        Path(path).write_bytes(b"half")
        raise RuntimeError("serialisation failed")

    cache = CompileCache(str(tmp_path), {})
    with pytest.raises(RuntimeError, match="serialisation failed"):
        cache.store(ENTRY, "k0", failing_save)
    assert os.listdir(tmp_path / "artifacts") == []
    assert cache.entries == {} and not (tmp_path / "index.json").exists()
    cache.record(ENTRY, "k0")  # nothing was saved: nothing to point at
    assert not (tmp_path / "index.json").exists()


def test_an_entry_pointing_to_another_artifact_is_reported_as_a_key_miss(
    tmp_path, warning_messages
):
    CompileCache(str(tmp_path), {}).store(ENTRY, "k0", writer(b"piece"))
    assert CompileCache(str(tmp_path), {}).lookup(ENTRY, "k1") is None
    assert warning_messages() == {
        f"compile cache {tmp_path}: {ENTRY} points to artifacts/k0.bin, but this run's piece "
        "hashes to k1; the cache key missed a change (recompiling). Please report this with "
        "both cache_key_factors.json files."
    }


def test_a_missing_artifact_is_reported_and_recompiled(tmp_path, warning_messages):
    CompileCache(str(tmp_path), {}).store(ENTRY, "k0", writer(b"piece"))
    (tmp_path / "artifacts" / "k0.bin").unlink()
    assert CompileCache(str(tmp_path), {}).lookup(ENTRY, "k0") is None
    assert warning_messages() == {
        f"compile cache {tmp_path}: {ENTRY} unusable (its artifact is missing or fails its "
        "checksum); recompiling it and rewriting the entry"
    }


@pytest.mark.parametrize(
    "index_text, reason",
    [
        ("{not json", "Expecting property name"),
        (json.dumps({"version": 2, "entries": {}}), "(not a version-1 index)"),
        (json.dumps(["version", 1]), "(not a version-1 index)"),
        (json.dumps({"version": 1}), "(no entries)"),
        (
            json.dumps({"version": 1, "entries": {ENTRY: {"artifact": "a"}}}),
            f"(entry {ENTRY!r} lacks artifact or sha256)",
        ),
        (json.dumps({"version": 1, "entries": {ENTRY: "artifacts/k0.bin"}}), "lacks artifact"),
    ],
)
def test_an_unreadable_index_is_ignored_with_a_warning_and_rewritten(
    tmp_path, warnings_text, index_text, reason
):
    (tmp_path / "index.json").write_text(index_text)
    cache = CompileCache(str(tmp_path), {})
    assert cache.entries == {} and cache.lookup(ENTRY, "k0") is None
    text = warnings_text()
    assert f"compile cache index {tmp_path / 'index.json'} is unreadable (" in text
    assert reason in text
    assert "ignoring it: pieces are recompiled and the index rewritten" in text
    cache.store(ENTRY, "k0", writer(b"piece"))
    assert set(index_on_disk(tmp_path)["entries"]) == {ENTRY}
    assert warnings_text() == text  # the rewrite itself warns no more


def test_an_index_that_is_not_utf8_is_ignored_with_a_warning(tmp_path, warnings_text):
    (tmp_path / "index.json").write_bytes(b"\xff\xfe{")
    assert CompileCache(str(tmp_path), {}).entries == {}
    assert "is unreadable ('utf-8' codec can't decode" in warnings_text()


def test_a_store_waits_for_the_lock_another_writer_holds(tmp_path):
    """``flock`` locks belong to an open file, so a second open in this process contends like
    another process would: the store runs only once the holder lets go."""
    holder, writer_cache = CompileCache(str(tmp_path), {}), CompileCache(str(tmp_path), {})
    done = threading.Event()

    def store() -> None:
        writer_cache.store(ENTRY, "k0", writer(b"piece"))
        done.set()

    with holder._locked():
        thread = threading.Thread(target=store)
        thread.start()
        assert not done.wait(timeout=0.3)  # blocked on the lock
        assert not (tmp_path / "index.json").exists()
    thread.join(timeout=10)
    assert done.is_set() and set(index_on_disk(tmp_path)["entries"]) == {ENTRY}


def test_key_factors_file_is_sorted_indented_json(tmp_path):
    """One factor per line in key order, so ``diff`` of two directories' files shows the change;
    values JSON cannot hold are written as their ``str``."""
    CompileCache(str(tmp_path), {"b": torch.float16, "a": {"y": 1, "x": [2]}})
    assert (tmp_path / "cache_key_factors.json").read_text().splitlines() == [
        "{",
        '  "a": {',
        '    "x": [',
        "      2",
        "    ],",
        '    "y": 1',
        "  },",
        '  "b": "torch.float16"',
        "}",
    ]


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "file.bin"
    write_atomic(str(target), b"old")
    write_atomic(str(target), b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["file.bin"]


def test_cache_directory_layout(tmp_path):
    compilation = CompilationConfig(cache_dir=str(tmp_path))
    config = EngineConfig(
        compilation_config=compilation,
        parallel_config=ParallelConfig(tensor_parallel_size=2, rank=1),
    )
    factors = {"config": {"dtype": "float16"}}
    directory = cache_directory(config, factors, "model.language_model")
    expected = tmp_path / "torch_compile_cache" / hash_factors(factors) / "rank_1"
    assert directory == str(expected / "model.language_model")
    nested = cache_directory(config, factors, os.path.join("vision", "tower"))
    assert nested == str(expected / "vision_tower")  # one directory per prefix, not a subtree
    assert cache_directory(config, factors, "") == str(expected / "model")
    home = EngineConfig(compilation_config=CompilationConfig(cache_dir="~/pw-cache"))
    assert cache_directory(home, factors, "model").startswith(os.path.expanduser("~/pw-cache"))
    assert not cache_directory(home, factors, "model").startswith("~")


def test_hash_source_files_is_each_files_sha256(tmp_path):
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("x = 1\n")
    second.write_text("x = 2\n")
    digests = hash_source_files([str(first), str(second)])
    assert digests == {str(first): sha256_of(str(first)), str(second): sha256_of(str(second))}
    assert digests[str(first)] != digests[str(second)]


@pytest.fixture
def make_unwritable(monkeypatch, tmp_path):
    """Call it to make ``tmp_path``'s artifacts directory read as not writable (as one owned by
    another user would; root may write anywhere, so it is ``os.access`` that answers)."""
    from pieceworks.core.cache import compile_cache

    artifacts = os.path.realpath(tmp_path / "artifacts")

    def access(path: str, mode: int) -> bool:
        return not (mode == os.W_OK and os.path.realpath(path) == artifacts)

    return lambda: monkeypatch.setattr(compile_cache.os, "access", access)


@pytest.fixture
def unwritable(make_unwritable):
    make_unwritable()


def test_a_cache_it_cannot_write_is_read_and_left_as_it_is(
    tmp_path, make_unwritable, caplog, warnings_text
):
    """Written by an earlier run, then mounted read-only: its artifact loads; nothing is stored,
    recorded or rewritten (the factors file keeps the first run's factors), with one log line."""
    CompileCache(str(tmp_path), {"dtype": "bfloat16"}).store(ENTRY, "k0", writer(b"first"))
    index_before = (tmp_path / "index.json").read_bytes()
    factors_before = (tmp_path / "cache_key_factors.json").read_bytes()
    make_unwritable()
    caplog.set_level(logging.INFO, logger="pieceworks")
    cache = CompileCache(str(tmp_path), {"dtype": "float16"})
    assert cache.read_only
    assert {r.getMessage() for r in caplog.records if r.levelno == logging.INFO} == {
        f"compile cache {tmp_path} is read-only ({tmp_path} is not writable): its artifacts are "
        "loaded, but nothing compiled in this run is written back"
    }
    path = cache.lookup(ENTRY, "k0")
    assert path is not None and Path(path).read_bytes() == b"first"
    saved: list[str] = []
    cache.store("piece_1/general", "k1", saved.append)
    cache.record("piece_2/general", "k0")  # an artifact it has verified: still not recorded
    assert saved == [] and not (tmp_path / "artifacts" / "k1.bin").exists()
    assert (tmp_path / "index.json").read_bytes() == index_before
    assert set(cache.entries) == {ENTRY}
    assert (tmp_path / "cache_key_factors.json").read_bytes() == factors_before


def test_a_read_only_cache_s_broken_entry_is_not_promised_a_rewrite(
    tmp_path, unwritable, warning_messages
):
    (tmp_path / "index.json").write_text(json.dumps({"version": 1, "entries": {}}))
    cache = CompileCache(str(tmp_path), {})
    cache.warn_corrupt(ENTRY, "its artifact is missing or fails its checksum")
    assert warning_messages() == {
        f"compile cache {tmp_path}: {ENTRY} unusable (its artifact is missing or fails its "
        "checksum); recompiling it; the read-only cache is left as it is"
    }


def test_an_unwritable_directory_without_an_index_raises(tmp_path, unwritable):
    """Nothing to read and nothing to write: the caller turns the cache off."""
    with pytest.raises(PermissionError, match=f"^{tmp_path} is not writable$"):
        CompileCache(str(tmp_path), {})


def test_the_factors_file_is_written_only_when_the_factors_differ(tmp_path, monkeypatch):
    from pieceworks.core.cache import compile_cache

    writes: list[str] = []
    real_write_atomic = compile_cache.write_atomic

    def counting_write(path: str, data: bytes) -> None:
        writes.append(os.path.basename(path))
        real_write_atomic(path, data)

    monkeypatch.setattr(compile_cache, "write_atomic", counting_write)
    CompileCache(str(tmp_path), {"dtype": "float16"})
    CompileCache(str(tmp_path), {"dtype": "float16"})  # the same factors: left as it is
    assert writes == ["cache_key_factors.json"]
    CompileCache(str(tmp_path), {"dtype": "bfloat16"})
    assert writes == ["cache_key_factors.json"] * 2
    assert json.loads((tmp_path / "cache_key_factors.json").read_text()) == {"dtype": "bfloat16"}


def test_an_unreadable_index_is_warned_about_once_when_an_artifact_is_overwritten(
    tmp_path, caplog, warnings_text
):
    """A store that finds an artifact file but no readable index to vouch for it overwrites the
    file without warning about the index a second time."""
    (tmp_path / "index.json").write_text("{not json")
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "k0.bin").write_bytes(b"left by a crashed writer")
    cache = CompileCache(str(tmp_path), {})
    cache.store(ENTRY, "k0", writer(b"piece"))
    assert (tmp_path / "artifacts" / "k0.bin").read_bytes() == b"piece"
    unreadable = [r for r in caplog.records if "is unreadable" in r.getMessage()]
    assert len(unreadable) == 1
