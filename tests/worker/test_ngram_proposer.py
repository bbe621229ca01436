"""The n-gram (prompt lookup) proposer proposes what followed the latest earlier match.

Proves: the longest n from ``prompt_lookup_max`` down to ``prompt_lookup_min`` wins; the latest
earlier occurrence is used, not the first; ``num_speculative_tokens`` are proposed, and a match
fewer than k tokens back continues the repetition; no match, or too few tokens, proposes nothing;
the trivial match of the suffix with itself never counts; ``propose_for_running`` gives
proposals only to decoding requests and clears the others'.

Run: ``pytest tests/worker/test_ngram_proposer.py -q``
"""

from __future__ import annotations

from pieceworks.scheduler.request import Request
from pieceworks.speculative_config import SpeculativeConfig
from pieceworks.worker.spec_decode import make_proposer
from pieceworks.worker.spec_decode.proposer import propose_for_running


def proposer(k: int = 3, low: int = 1, high: int = 3):
    return make_proposer(
        SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high)
    )


def test_the_latest_earlier_match_of_the_longest_ngram_is_continued():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert proposer().propose(tokens) == [4, 5, 6]  # [1, 2, 3] last seen before 4 5 6
    assert proposer(k=2).propose(tokens) == [4, 5]
    # n = 3 ([7, 2, 3]) has no match; n = 2 ([2, 3]) matches, latest before 4
    assert proposer().propose([1, 2, 3, 9, 2, 3, 4, 8, 7, 2, 3]) == [4, 8, 7]


def test_a_longer_match_wins_over_a_later_shorter_one():
    tokens = [5, 1, 2, 7, 3, 2, 8, 5, 1, 2]
    assert proposer().propose(tokens) == [7, 3, 2]  # [5, 1, 2] at 0, not [2] at 5


def test_repeating_or_no_proposals():
    assert proposer().propose([4, 5, 6, 4, 5]) == [6, 4, 5]
    assert proposer(k=5).propose([4, 5, 6, 4, 5]) == [6, 4, 5, 6, 4]  # period 3
    assert proposer().propose([7, 7, 7, 7]) == [7, 7, 7]  # period 1
    assert proposer().propose([1, 2, 3, 4]) == []  # nothing repeats
    assert proposer(low=2).propose([7, 1, 2, 7]) == []  # only a 1-gram repeats
    assert proposer().propose([3]) == []
    assert proposer().propose([3, 3]) == [3, 3, 3]


def test_only_decoding_requests_get_proposals():
    decoding = Request("d", [1, 2, 1], output_token_ids=[2])
    decoding.num_computed_tokens = 3  # its last token is uncomputed: a decode
    prefilling = Request("p", [1, 2, 1, 2])
    prefilling.spec_token_ids = [5]
    propose_for_running(proposer(), [decoding, prefilling])
    assert decoding.spec_token_ids == [1, 2, 1]  # [1, 2, 1, 2] repeats with period 2
    assert prefilling.spec_token_ids == []
