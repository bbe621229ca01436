"""``InductorPass``: the base of pieceworks' graph passes, identified by their source.

Inductor calls a ``CustomGraphPass`` with the post-grad FX graph of a piece and needs a
``uuid()`` to key its own cache; pieceworks' compile-cache key includes the pass manager's uuid
too. A pass's uuid hashes the contents of the files that define it (editing a pass, or a pattern
it matches, changes the uuid) and its configuration, so a cached compile is never reused after
the code that produced it changed.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from pieceworks.utils import file_digest, hash_factors


class InductorPass(CustomGraphPass):
    """One rewrite of a post-grad FX graph, in place. ``num_rewrites``: what the last call did."""

    def __init__(self) -> None:
        self.num_rewrites = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError

    def source_files(self) -> list[str]:
        """Files whose contents define what this pass does (its own module by default)."""
        return [inspect.getfile(type(self))]

    def config_factors(self) -> dict[str, Any]:
        """Settings of this pass that change what it does."""
        return {}

    def uuid(self) -> str:
        return hash_factors(
            {
                "pass": type(self).__qualname__,
                "sources": [file_digest(path) for path in self.source_files()],
                "config": self.config_factors(),
            }
        )


def is_call(node: torch.fx.Node, *targets: Any) -> bool:
    """Whether ``node`` calls one of ``targets`` (OpOverloads or functions)."""
    return node.op == "call_function" and node.target in targets
