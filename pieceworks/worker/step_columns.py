"""``StepColumns``: a step's scheduled requests' values as flat lists, gathered in one pass.

``StepInputs.prepare`` (``worker/step_inputs.py``) writes these columns into the staging buffer
with numpy, and compares their ``layout`` with the one the staging buffer last held to skip the
fields that follow from the layout alone.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from pieceworks.scheduler.output import PLACEHOLDER_TOKEN_ID, ScheduledRequest
from pieceworks.worker.input_buffers import StepShape


@dataclasses.dataclass
class StepColumns:
    """The scheduled requests' per-step values as flat lists, gathered in one pass."""

    query_lens: list[int]
    computed: list[int]
    state_slots: list[int]
    token_ids: list[int]  # every scheduled token; a placeholder stays PLACEHOLDER_TOKEN_ID
    producing_rows: list[int]  # rows of the requests that sample a token
    logits_counts: list[int]  # per producing row: its rows sampled (1 + its proposals)
    placeholder_dst: list[int]  # token rows whose id is still on the device ...
    placeholder_src: list[int]  # ... and their rows in the previous step's sampled ids
    num_decodes: int

    @classmethod
    def gather(
        cls, scheduled: Sequence[ScheduledRequest], sampled_rows: Mapping[str, int]
    ) -> StepColumns:
        # One comprehension per column: each runs as a tight loop, cheaper per request than
        # one loop appending to every column.
        token_ids = list(itertools.chain.from_iterable(s.new_token_ids for s in scheduled))
        pending = [s.request for s in scheduled if s.new_token_ids[-1] == PLACEHOLDER_TOKEN_ID]
        try:
            placeholder_src = [sampled_rows[request.request_id] for request in pending]
        except KeyError as error:
            raise RuntimeError(
                f"request {error.args[0]!r}: its last token is still on the device but the "
                "previous step did not sample it; this is a scheduler/runner bug"
            ) from None
        return cls(
            query_lens=[s.num_new_tokens for s in scheduled],
            computed=[s.num_computed_tokens for s in scheduled],
            state_slots=[s.request.state_slot or 0 for s in scheduled],
            token_ids=token_ids,
            producing_rows=[row for row, s in enumerate(scheduled) if s.produces_token],
            logits_counts=[1 + len(s.spec_token_ids) for s in scheduled if s.produces_token],
            # Only a decode's one token can be pending, so these are its request's rows.
            placeholder_dst=[i for i, t in enumerate(token_ids) if t == PLACEHOLDER_TOKEN_ID],
            placeholder_src=placeholder_src,
            # Decodes of one query token (the attention and Mamba decode paths' sequences).
            num_decodes=[s.is_decode and not s.spec_token_ids for s in scheduled].count(True),
        )

    def layout(self, shape: StepShape) -> tuple:
        """What the layout-only fields follow from (positions and lengths are not in it)."""
        return (
            shape.num_tokens,
            shape.num_tokens_padded,
            shape.num_seqs_padded,
            self.query_lens,
            self.state_slots,
            self.producing_rows,
            self.logits_counts,
            self.placeholder_dst,
            self.placeholder_src,
        )
