"""``FieldRule`` and the value predicates the config checks are written with.

A ``FieldRule`` names one config.json field, the values pieceworks implements for it, those values
in words (for the error message) and what its absence means. ``config_checks.py`` holds the tables
of rules per architecture and the check that applies them; ``hybrid_rules.py`` the hybrid
architectures' own fields. This module holds no table and checks nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

REQUIRED = object()  # FieldRule.default of a field config.json must carry


class ModelConfigError(ValueError):
    """A config.json field pieceworks does not implement, or a value it cannot run."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: Any) -> bool:
    return is_int(value) and value > 0


def non_negative_number(value: Any) -> bool:
    return is_number(value) and value >= 0


def is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda value: value in choices


def neutral(*neutral_values: Any) -> Callable[[Any], bool]:
    """For features pieceworks does not implement: only the values that switch them off pass."""
    return lambda value: value is None or value in neutral_values


@dataclasses.dataclass(frozen=True)
class FieldRule:
    """One config.json field: which values are implemented (``supported`` says it in words)."""

    name: str
    accepts: Callable[[Any], bool]
    supported: str
    default: Any = None  # the value when the field is absent; REQUIRED: it must be present


def size(name: str) -> FieldRule:
    return FieldRule(name, positive_int, "a positive integer", REQUIRED)
