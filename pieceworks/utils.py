"""Small helpers shared by every layer: lazy import by qualname, content and file hashing."""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
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
