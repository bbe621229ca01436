"""``SampledTokens``: a step's sampled ids on their way from the device to the host.

The runner copies the ids into a pinned host buffer without waiting and records an event after
the copy; ``tolist()`` waits for that event (the step's one host sync) and reads the buffer. The
runner alternates two buffers, so the handle stays valid until the step after next is launched,
which is as long as async scheduling keeps it.
"""

from __future__ import annotations

from typing import Any

import torch


class SampledTokens:
    def __init__(self, host_ids: torch.Tensor | None, event: Any | None) -> None:
        self.host_ids = host_ids  # (S,) int64, pinned where the platform pins
        self.event = event  # None: the copy finished before the runner returned

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
