"""``SampledTokens``: a step's sampled ids on their way from the device to the host.

The runner copies the ids into a pinned host buffer without waiting and records an event after
the copy; ``tolist()`` waits for that event (the step's one host sync) and reads the buffer. The
runner alternates two buffers, so the handle stays valid until the step after next is launched,
which is as long as async scheduling keeps it. A multi-step decode output's handle holds the ids
of all its steps, step 0's first (``num_steps * S`` ids), read with the same one sync.

When a request asked for them, the step's log-probabilities ride along as device tensors
(``pieceworks.worker.logprobs``): ``logprobs`` for sampled rows, ``prompt_logprobs`` per request
id for prefill rows. They are read after ``tolist()``, so they add no sync of their own.
"""

from __future__ import annotations

from typing import Any

import torch

from pieceworks.scheduler.request import TokenLogprob
from pieceworks.worker.logprobs import TokenLogprobs


class SampledTokens:
    def __init__(
        self,
        host_ids: torch.Tensor | None,
        event: Any | None,
        logprobs: tuple[list[int], TokenLogprobs] | None = None,
        prompt_logprobs: dict[str, tuple[int, TokenLogprobs]] | None = None,
    ) -> None:
        self.host_ids = host_ids  # (S,) int64 ((K * S,) multi-step), pinned where the platform pins
        self.event = event  # None: the copy finished before the runner returned
        self.logprobs = logprobs  # (producing rows that asked, their rows' logprobs)
        self.prompt_logprobs = prompt_logprobs  # request id -> (first position, its rows)

    @classmethod
    def none(cls) -> SampledTokens:
        """A step that samples nothing (a chunk of a prompt)."""
        return cls(None, None)

    def tolist(self) -> list[int]:
        if self.host_ids is None:
            return []
        if self.event is not None:
            self.event.synchronize()
        return self.host_ids.tolist()

    def logprobs_by_row(self) -> dict[int, TokenLogprob]:
        """The sampled tokens' log-probabilities on the host, by producing row; {} if none."""
        if self.logprobs is None:
            return {}
        rows, values = self.logprobs
        return dict(zip(rows, values.tolist()))

    def prompt_logprobs_by_request(self) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """Request id -> (first prompt position scored, its log-probabilities on the host)."""
        if not self.prompt_logprobs:
            return {}
        return {rid: (first, rows.tolist()) for rid, (first, rows) in self.prompt_logprobs.items()}
