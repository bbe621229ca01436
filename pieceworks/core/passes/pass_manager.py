"""``PostGradPassManager``: the one custom pass Inductor runs on every piece, configured by
``PassConfig``.

``InductorAdaptor`` hands it to ``standalone_compile`` through ``config_patches()``:
``post_grad_custom_post_pass`` (Inductor calls it on the post-grad graph, after its own pattern
passes and before it reinplaces and decomposes functionalized ops) and
``enable_auto_functionalized_v2=False`` where torch has that flag, so mutating custom ops arrive
as v1 ``auto_functionalized`` nodes, the form ``FixFunctionalizationPass`` rewrites.

Order: no-op elimination (exposes adjacent patterns), fusion, then fix-functionalization, always
and always last (fusion itself emits functionalized ops). With fusion, no-op elimination and
fusion also run on the joint graph, before Inductor's own joint-graph patterns
(``joint_custom_pre_pass``; ``PostGradPassManager`` says why). ``uuid()`` hashes this file,
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
from pieceworks.core.passes.inductor_pass import InductorPass
from pieceworks.core.passes.noop_elimination import NoOpEliminationPass


class PassSequence(InductorPass):
    """Passes run in order on one graph, as one of Inductor's custom-pass slots."""

    def __init__(self, passes: list[InductorPass]) -> None:
        super().__init__()
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)
        self.num_rewrites = sum(graph_pass.num_rewrites for graph_pass in self.passes)

    def config_factors(self) -> dict[str, Any]:
        return {"passes": [graph_pass.uuid() for graph_pass in self.passes]}


class PostGradPassManager(PassSequence):
    """Runs the passes ``PassConfig`` enables, in order, on a post-grad graph; with fusion, also
    no-op elimination and fusion on the joint graph first (``joint_passes``, see below)."""

    def __init__(self, pass_config: PassConfig) -> None:
        noop = [NoOpEliminationPass()] if pass_config.enable_noop else []
        fusion: list[InductorPass] = [RMSNormQuantFusionPass()] if pass_config.enable_fusion else []
        super().__init__([*noop, *fusion, FixFunctionalizationPass()])
        self.pass_config = pass_config
        # Fusion must see the residual stream rounded to the model dtype between two norms:
        # torch 2.11's joint-graph pattern `pointless_convert` folds the float32 -> bfloat16 ->
        # float32 round trip away (2.13 keeps it), after which no residual-form norm of a piece
        # matches. So fusion runs on the joint graph too, before Inductor's own joint patterns;
        # in the post-grad graph it then finds nothing left (or what only appears there).
        # (Instances of their own: a pass's num_rewrites tells what its last call did.)
        self.joint_passes: PassSequence | None = None
        if pass_config.enable_fusion:
            joint_noop = [NoOpEliminationPass()] if pass_config.enable_noop else []
            self.joint_passes = PassSequence([*joint_noop, RMSNormQuantFusionPass()])

    def config_factors(self) -> dict[str, Any]:
        joint = self.joint_passes.uuid() if self.joint_passes is not None else None
        factors = {"pass_config": dataclasses.asdict(self.pass_config), "joint": joint}
        return {**factors, **super().config_factors()}

    def config_patches(self) -> dict[str, Any]:
        """The Inductor config entries that install this manager for one compile."""
        from torch._inductor import config

        patches: dict[str, Any] = {"post_grad_custom_post_pass": self}
        if self.joint_passes is not None:
            patches["joint_custom_pre_pass"] = self.joint_passes
        if hasattr(config, "enable_auto_functionalized_v2"):
            patches["enable_auto_functionalized_v2"] = False
        return patches
