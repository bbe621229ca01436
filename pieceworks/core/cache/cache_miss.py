"""Why a compile-cache key has no cache yet: the factors that differ from the nearest other cache.

A changed factor (another torch or Triton version, an edited source file, another config) hashes
to another directory, so a cache made under the old factors is simply not found. That is correct
but silent; this module says why. Beside every cache directory lies its ``cache_key_factors.json``
(``compile_cache.py``); the caches of the same rank and model under the same root are compared
with this run's factors, and the one with the fewest differences is reported with what differs:
``compiler.torch: '2.11.0' -> '2.13.0'``, ``traced_files.pieceworks/models/llama.py: changed``.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from pieceworks.core.cache.compile_cache import KEY_FACTORS_FILE

MAX_SHOWN = 6  # differences named in the log line; the rest are counted


def flatten(factors: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict keyed by dotted paths (``compiler.torch``)."""
    if not isinstance(factors, dict) or not factors:
        return {prefix: factors}
    flat: dict[str, Any] = {}
    for name, value in factors.items():
        flat.update(flatten(value, f"{prefix}.{name}" if prefix else str(name)))
    return flat


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed from ``old`` to ``new``, one line per factor, in key order."""
    old_flat, new_flat = flatten(old), flatten(new)
    lines = []
    for name in sorted(set(old_flat) | set(new_flat)):
        if name not in old_flat:
            lines.append(f"{name}: added")
        elif name not in new_flat:
            lines.append(f"{name}: removed")
        elif old_flat[name] != new_flat[name]:
            if name.startswith("traced_files."):
                lines.append(f"{name}: changed")  # digests say nothing to a reader
            else:
                lines.append(f"{name}: {_short(old_flat[name])} -> {_short(new_flat[name])}")
    return lines


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def explain_miss(cache_dir: str, factors: dict[str, Any]) -> str:
    """Why ``cache_dir`` (``<root>/torch_compile_cache/<hash>/rank_<r>/<model>``) is new."""
    model_dir = os.path.basename(cache_dir)
    rank_dir = os.path.basename(os.path.dirname(cache_dir))
    root = os.path.dirname(os.path.dirname(os.path.dirname(cache_dir)))
    current = json.loads(json.dumps(factors, sort_keys=True, default=str))
    nearest: tuple[int, str, list[str]] | None = None
    pattern = os.path.join(glob.escape(root), "*", rank_dir, model_dir, KEY_FACTORS_FILE)
    for path in sorted(glob.glob(pattern)):
        other_dir = os.path.dirname(path)
        if os.path.realpath(other_dir) == os.path.realpath(cache_dir):
            continue
        try:
            with open(path, encoding="utf-8") as file:
                lines = differences(json.load(file), current)
        except (OSError, ValueError):
            continue  # an unreadable neighbour explains nothing
        if nearest is None or len(lines) < nearest[0]:
            nearest = (len(lines), other_dir, lines)
    if nearest is None:
        return f"no other compile cache of {model_dir} under {root} (a first compile)"
    count, other_dir, lines = nearest
    shown = "; ".join(lines[:MAX_SHOWN])
    more = f"; and {count - MAX_SHOWN} more" if count > MAX_SHOWN else ""
    return f"the nearest cache, {other_dir}, differs in {count} factor(s): {shown}{more}"
