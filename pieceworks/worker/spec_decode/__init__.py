"""Speculative decoding on the worker side: proposers (``proposer``, ``ngram_proposer``), the
verify batch (``verify_batch``) and the acceptance of proposals (``rejection_sampler``).
``make_proposer`` picks the proposer of a ``SpeculativeConfig``; ``draft_model_proposer`` is
imported only when a draft model is asked for."""

from __future__ import annotations

from pieceworks.config import EngineConfig
from pieceworks.speculative_config import SpeculativeConfig
from pieceworks.worker.spec_decode.ngram_proposer import NgramProposer
from pieceworks.worker.spec_decode.proposer import Proposer


def make_proposer(config: SpeculativeConfig, draft_config: EngineConfig | None = None) -> Proposer:
    """The proposer of ``config.method`` (``SpeculativeConfig`` refused every other method);
    ``draft_config`` configures the draft model's engine (``draft_model``)."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "draft_model" and draft_config is not None:
        from pieceworks.worker.spec_decode.draft_model_proposer import DraftModelProposer

        return DraftModelProposer(config, draft_config)
    raise ValueError(f"no proposer for speculative method {config.method!r}")
