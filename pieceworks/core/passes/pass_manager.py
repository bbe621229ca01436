"""``PostGradPassManager``: the one custom pass Inductor runs on every piece, configured by
``PassConfig``.

``InductorAdaptor`` hands it to ``standalone_compile`` through ``config_patches()``:
``post_grad_custom_post_pass`` (Inductor calls it on the post-grad graph, after its own pattern
passes and before it reinplaces and decomposes functionalized ops) and
``enable_auto_functionalized_v2=False`` where torch has that flag, so mutating custom ops arrive
as v1 ``auto_functionalized`` nodes, the form ``FixFunctionalizationPass`` rewrites.

Order: no-op elimination (exposes adjacent patterns), fusion, the fold of fused norms into the
FP8 GEMVs that read them (part of fusion, ``fold_norm_into_gemv``), then fix-functionalization,
always and always last (fusion itself emits functionalized ops). ``uuid()`` hashes this file,
each pass's uuid and the ``PassConfig``: Inductor keys its cache by it, and it enters pieceworks'
compile-cache key (``InductorAdaptor.compute_hash_factors``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx

from pieceworks.core.config import PassConfig
from pieceworks.core.passes.fix_functionalization import FixFunctionalizationPass
from pieceworks.core.passes.fusion import RMSNormQuantFusionPass
from pieceworks.core.passes.gemv_norm_fold import GemvNormFoldPass
from pieceworks.core.passes.inductor_pass import InductorPass
from pieceworks.core.passes.noop_elimination import NoOpEliminationPass


class PostGradPassManager(InductorPass):
    """Runs the passes ``PassConfig`` enables, in order, on a post-grad graph."""

    def __init__(self, pass_config: PassConfig) -> None:
        super().__init__()
        self.pass_config = pass_config
        self.passes: list[InductorPass] = []
        if pass_config.enable_noop:
            self.passes.append(NoOpEliminationPass())
        if pass_config.enable_fusion:
            self.passes.append(RMSNormQuantFusionPass())
            if pass_config.fold_norm_into_gemv:
                self.passes.append(GemvNormFoldPass())
        self.passes.append(FixFunctionalizationPass())

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)
        self.num_rewrites = sum(graph_pass.num_rewrites for graph_pass in self.passes)

    def config_factors(self) -> dict[str, Any]:
        return {
            "pass_config": dataclasses.asdict(self.pass_config),
            "passes": [graph_pass.uuid() for graph_pass in self.passes],
        }

    def config_patches(self) -> dict[str, Any]:
        """The Inductor config entries that install this manager for one compile."""
        from torch._inductor import config

        patches: dict[str, Any] = {"post_grad_custom_post_pass": self}
        if hasattr(config, "enable_auto_functionalized_v2"):
            patches["enable_auto_functionalized_v2"] = False
        return patches
