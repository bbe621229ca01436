"""``NgramProposer``: prompt lookup, vLLM's ``ngram`` method, in numpy on the host.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the request's last ``n``
tokens are looked up among its earlier tokens (prompt and output so far); at the first ``n`` with
a match, the tokens that followed the most recent earlier match are proposed,
``num_speculative_tokens`` of them. When the tokens after the match run into the end of the
sequence (the match is fewer than ``k`` tokens back, as in a repeating phrase), the proposal
continues the repetition: the sequence is taken to repeat with the period between the match and
the suffix (vLLM would propose fewer tokens there). No match at any ``n``: no proposal. One
vectorised comparison per ``n`` (``sliding_window_view``), no model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pieceworks.speculative_config import SpeculativeConfig
from pieceworks.worker.spec_decode.proposer import Proposer


class NgramProposer(Proposer):
    """Proposes the continuation of the latest earlier occurrence of the request's last n-gram."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        num_tokens = len(token_ids)
        if num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            start = ngram_match(tokens, n)
            if start is not None:
                period = num_tokens - n - start  # the suffix repeats the match this far back
                offsets = np.arange(self.num_speculative_tokens) % period
                return tokens[start + n + offsets].tolist()
        return []


def ngram_match(tokens: np.ndarray, n: int) -> int | None:
    """The start of the latest occurrence of ``tokens[-n:]`` that ends before the last token
    (so at least one token follows it), or None."""
    # Windows of tokens[:-1]: window i is tokens[i : i + n] with i + n <= len - 1.
    windows = sliding_window_view(tokens[:-1], n)  # (len - n, n)
    matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(matches[-1]) if len(matches) else None
