"""Small helpers shared by every layer: lazy import by qualname, content hashing."""

from __future__ import annotations

import hashlib
import importlib
import json
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
