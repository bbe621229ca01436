"""``NgramProposer``: prompt lookup, vLLM's ``ngram`` method, in numpy on the host.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the request's last ``n``
tokens are looked up among its earlier tokens (prompt and output so far); at the first ``n`` with
a match, the tokens that followed the most recent earlier match are proposed, at most
``num_speculative_tokens`` of them (fewer when the match ends near the end). No match at any
``n``: no proposal. One vectorised comparison per ``n`` (``sliding_window_view``), no model.
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
                end = min(start + n + self.num_speculative_tokens, num_tokens)
                return tokens[start + n : end].tolist()
        return []


def ngram_match(tokens: np.ndarray, n: int) -> int | None:
    """The start of the latest occurrence of ``tokens[-n:]`` that ends before the last token
    (so at least one token follows it), or None."""
    # Windows of tokens[:-1]: window i is tokens[i : i + n] with i + n <= len - 1.
    windows = sliding_window_view(tokens[:-1], n)  # (len - n, n)
    matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(matches[-1]) if len(matches) else None
