"""Small helpers shared by every layer: lazy import by qualname, content and file hashing, and a
value remembered per identity of a sequence of objects."""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import weakref
from collections.abc import Sequence
from typing import Any


def resolve_obj_by_qualname(qualname: str) -> Any:
    """Import ``package.module.Name`` and return ``Name``; a clear error if it is not there."""
    module_name, _, obj_name = qualname.rpartition(".")
    if not module_name:
        raise ValueError(f"{qualname!r} is not a qualified name of the form 'package.module.Name'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, obj_name)
    except AttributeError:
        raise ImportError(
            f"module {module_name!r} has no attribute {obj_name!r} (looked up for {qualname!r})"
        ) from None


def hash_factors(factors: Any) -> str:
    """Stable short hash of a JSON-serialisable structure (dict keys sorted)."""
    text = json.dumps(factors, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_digest(path: str) -> str:
    """SHA-256 of the file's contents, read once per process while its size and modification
    time stay the same (every compile of a start-up hashes the same pass and model files). An
    edit that keeps the size within one tick of the file system's clock goes unseen until the
    next process."""
    status = os.stat(path)
    return _file_digest(os.path.realpath(path), status.st_mtime_ns, status.st_size)


@functools.cache
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


class IdentityMemo:
    """A value remembered for one sequence of objects: ``get`` returns it for those very objects
    (by identity) while all of them live, else None.

    For host paths that see the same tensor objects call after call (graph outputs, persistent
    buffer views) and would otherwise read their shapes, strides or dtypes every time. Each
    object is held by a weak reference whose callback forgets the value when it goes, so a new
    object that reuses a dead one's id is never taken for it, and nothing is kept alive.
    """

    def __init__(self) -> None:
        self.ids: tuple[int, ...] | None = None
        self.value: Any = None
        self._refs: list[weakref.ref] = []

    def get(self, objects: Sequence[Any]) -> Any:
        return self.value if tuple(map(id, objects)) == self.ids else None

    def put(self, objects: Sequence[Any], value: Any) -> None:
        self._refs = [weakref.ref(obj, self._forget) for obj in objects]
        self.ids, self.value = tuple(map(id, objects)), value

    def clear(self) -> None:
        self._refs, self.ids, self.value = [], None, None

    def _forget(self, _ref: weakref.ref) -> None:
        self.ids, self.value = None, None
