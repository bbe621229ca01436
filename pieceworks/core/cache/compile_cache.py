"""``CompileCache``: one compile-cache directory on disk (index, artifacts, key factors).

Layout of ``<cache_root>/torch_compile_cache/<hash>/rank_<r>/<prefix>/``::

    cache_key_factors.json   what the directory's hash covers (diff two to see why they differ)
    index.json               {"entries": {"piece_3/general": {"artifact": ..., "sha256": ...}}}
    artifacts/<key>.bin      one compiled artifact per distinct piece structure and shape
    .lock                    serialises writers across processes

Identical pieces (the middle layers of a model) share one artifact: the artifact key is a hash of
the piece's structure (``artifact_key.py``), and their index entries point to the same file. Every
file is written to a temporary name in the same directory and ``os.replace``d into place; writers
hold an exclusive ``flock`` for the artifact + index update, so processes compiling the same model
at once all succeed and leave a consistent index. Readers take no lock: an artifact whose SHA-256
does not match its index entry, or an index that does not parse, is reported with a warning and
treated as missing, so the piece is recompiled and the entry rewritten. A cache directory this
process cannot write (a read-only mount, a shared cache owned by another user) is still read: its
artifacts load, and only the writes are skipped, with one log line saying so. What to compile and
when is ``compiler_manager.py``; the key is ``cache_key.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from pieceworks.core.counters import compilation_counter
from pieceworks.logger import init_logger

logger = init_logger(__name__)

INDEX_VERSION = 1
KEY_FACTORS_FILE = "cache_key_factors.json"


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part."""
    temporary = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def sha256_of(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


class CompileCache:
    """The index and artifacts of one cache directory, as seen by one compiling process."""

    def __init__(self, directory: str, factors: dict[str, Any]) -> None:
        self.directory = directory
        self.index_path = os.path.join(directory, "index.json")
        # An existing cache this process cannot write is read, and nothing is written to it.
        self.read_only = False
        try:
            os.makedirs(os.path.join(directory, "artifacts"), exist_ok=True)
            if not os.access(os.path.join(directory, "artifacts"), os.W_OK):
                raise PermissionError(f"{directory} is not writable")
            self._write_factors(factors)
        except OSError as error:
            if not os.path.isfile(self.index_path):
                raise  # nothing to read either: the caller turns the cache off
            self.read_only = True
            logger.info(
                "compile cache %s is read-only (%s): its artifacts are loaded, but nothing "
                "compiled in this run is written back",
                directory,
                error,
            )
        self.entries = self._read_index(warn=True)
        self.checksums: dict[str, str] = {}  # artifact name -> SHA-256, saved or verified here

    def _write_factors(self, factors: dict[str, Any]) -> None:
        """Write ``cache_key_factors.json`` unless it already holds exactly these factors."""
        path = os.path.join(self.directory, KEY_FACTORS_FILE)
        data = json.dumps(factors, indent=2, sort_keys=True, default=str).encode()
        if os.path.isfile(path):
            with open(path, "rb") as file:
                if file.read() == data:
                    return
        write_atomic(path, data)

    def lookup(self, entry_name: str, artifact_key: str) -> str | None:
        """Path of this entry's artifact if it is there and intact; None (with a warning) if not."""
        entry = self.entries.get(entry_name)
        if entry is None:
            return None
        if entry["artifact"] != self.artifact_name(artifact_key):
            logger.warning(
                "compile cache %s: %s points to %s, but this run's piece hashes to %s; the cache "
                "key missed a change (recompiling). Please report this with both "
                "cache_key_factors.json files.",
                self.directory,
                entry_name,
                entry["artifact"],
                artifact_key,
            )
            return None
        path = os.path.join(self.directory, entry["artifact"])
        if not os.path.isfile(path) or sha256_of(path) != entry["sha256"]:
            self.warn_corrupt(entry_name, "its artifact is missing or fails its checksum")
            return None
        self.checksums[entry["artifact"]] = entry["sha256"]
        return path

    def is_intact(self, entry_name: str, artifact_key: str) -> bool:
        """Whether ``lookup`` would find this entry's artifact, without a warning either way."""
        entry = self.entries.get(entry_name)
        if entry is None or entry["artifact"] != self.artifact_name(artifact_key):
            return False
        path = os.path.join(self.directory, entry["artifact"])
        return os.path.isfile(path) and sha256_of(path) == entry["sha256"]

    def warn_corrupt(self, entry_name: str, reason: str) -> None:
        repair = (
            "; the read-only cache is left as it is"
            if self.read_only
            else " and rewriting the entry"
        )
        logger.warning(
            "compile cache %s: %s unusable (%s); recompiling it%s",
            self.directory,
            entry_name,
            reason,
            repair,
        )

    def store(
        self,
        entry_name: str,
        artifact_key: str,
        save: Callable[[str], None],
        replace: bool = False,
    ) -> None:
        """Save an artifact (``save(path)`` writes it) and point ``entry_name`` at it.

        An intact artifact of the same key, written by another process, is kept as it is: the
        first writer wins, so entries pointing to it stay valid. ``replace`` overwrites it anyway
        (it passed its checksum but failed to load).
        """
        if self.read_only:
            return
        name = self.artifact_name(artifact_key)
        with self._locked():
            checksum = None if replace else self._intact_checksum(name)
            if checksum is None:
                checksum = self._save_artifact(name, save)
            self.checksums[name] = checksum
            self._write_entry(entry_name, {"artifact": name, "sha256": checksum})

    def record(self, entry_name: str, artifact_key: str) -> None:
        """Point ``entry_name`` at an artifact this process already saved or loaded."""
        name = self.artifact_name(artifact_key)
        if name not in self.checksums or self.read_only:
            return  # the artifact could not be saved, or the cache is not ours to update
        entry = {"artifact": name, "sha256": self.checksums[name]}
        if self.entries.get(entry_name) != entry:
            with self._locked():
                self._write_entry(entry_name, entry)

    def _save_artifact(self, name: str, save: Callable[[str], None]) -> str:
        """Write an artifact under a temporary name, then move it into place; its checksum."""
        path = os.path.join(self.directory, name)
        temporary = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            save(temporary)
            checksum = sha256_of(temporary)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
        compilation_counter.num_compiled_artifacts_saved += 1
        return checksum

    def _intact_checksum(self, name: str) -> str | None:
        """The checksum of artifact ``name`` if the index on disk vouches for the file as it is."""
        path = os.path.join(self.directory, name)
        if not os.path.isfile(path):
            return None
        recorded = {
            e["sha256"] for e in self._read_index(warn=False).values() if e["artifact"] == name
        }
        checksum = sha256_of(path) if recorded else None
        return checksum if checksum in recorded else None

    @staticmethod
    def artifact_name(artifact_key: str) -> str:
        return os.path.join("artifacts", f"{artifact_key}.bin")

    def _write_entry(self, entry_name: str, entry: dict[str, str]) -> None:
        """Merge one entry into the index on disk (the caller holds the lock)."""
        entries = self._read_index(warn=False)
        entries[entry_name] = entry
        payload = {"version": INDEX_VERSION, "entries": entries}
        write_atomic(self.index_path, json.dumps(payload, indent=1, sort_keys=True).encode())
        self.entries[entry_name] = entry
        compilation_counter.num_cache_entries_updated += 1

    def _read_index(self, warn: bool) -> dict[str, dict[str, str]]:
        """The index's entries; an unreadable index counts as empty (and is rewritten)."""
        if not os.path.exists(self.index_path):
            return {}
        try:
            with open(self.index_path, encoding="utf-8") as file:
                return _parse_index(json.load(file))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            if warn:
                logger.warning(
                    "compile cache index %s is unreadable (%s); ignoring it: pieces are "
                    "recompiled and the index rewritten",
                    self.index_path,
                    error,
                )
            return {}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on the directory, across processes (``flock``)."""
        with open(os.path.join(self.directory, ".lock"), "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)


def _parse_index(payload: Any) -> dict[str, dict[str, str]]:
    """Validate an index's structure; a ``ValueError`` says what is wrong."""
    if not isinstance(payload, dict) or payload.get("version") != INDEX_VERSION:
        raise ValueError(f"not a version-{INDEX_VERSION} index")
    entries = payload.get("entries")
    if not isinstance(entries, dict):
        raise ValueError("no entries")
    for name, entry in entries.items():
        if not isinstance(entry, dict) or not {"artifact", "sha256"} <= set(entry):
            raise ValueError(f"entry {name!r} lacks artifact or sha256")
    return entries
