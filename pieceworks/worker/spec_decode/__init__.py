"""Speculative decoding on the worker side: proposers (``proposer``, ``ngram_proposer``), the
verify batch (``verify_batch``) and the acceptance of proposals (``rejection_sampler``).
``make_proposer`` picks the proposer of a ``SpeculativeConfig``."""

from __future__ import annotations

from pieceworks.speculative_config import SpeculativeConfig
from pieceworks.worker.spec_decode.ngram_proposer import NgramProposer
from pieceworks.worker.spec_decode.proposer import Proposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of ``config.method`` (``SpeculativeConfig`` refused every other method)."""
    if config.method == "ngram":
        return NgramProposer(config)
    raise ValueError(f"no proposer for speculative method {config.method!r}")
