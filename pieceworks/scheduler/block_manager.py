"""``BlockManager`` (paged KV blocks) and ``StateSlotManager`` (Mamba state slots).

Owns the free lists of the two per-request caches and writes the ids into ``Request.block_ids`` /
``Request.state_slot``. It does not decide who gets memory (the scheduler does) and holds no
tensors (the model runner owns the KV cache and the state cache these ids index). No prefix caching:
a block belongs to exactly one request. With a model whose every attention layer has a sliding
window, a running request's blocks wholly before its window go back to the pool early
(``free_blocks_outside_window``).
"""

from __future__ import annotations

from collections import deque

from pieceworks.scheduler.request import Request


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


class BlockManager:
    """Hands out KV-cache blocks of ``block_size`` tokens on demand and takes them back.

    ``request.block_ids[i]`` holds the KV of token positions ``[i * block_size, (i + 1) *
    block_size)``, or is ``FREED_BLOCK_ID`` once freed outside a sliding window: a placeholder
    that keeps the list's length (block ``i`` still stands for those positions) and that the
    attention kernels never read (they load no key before a window). ``allocate`` is
    all-or-nothing: it never leaves a request half-extended.
    """

    FREED_BLOCK_ID = -1

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks={num_blocks} and block_size={block_size} must both be >= 1; "
                "the KV cache has no room (give it more memory)"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so ``request`` covers ``num_computed_tokens + num_new_tokens`` tokens."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_tokens, self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Append the blocks ``request`` needs for ``num_new_tokens``; if short, change nothing."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(request.block_ids)  # blocks_needed
        if num_needed <= 0:
            return True  # the common decode step: the last block still has room
        if num_needed > self.num_free_blocks:
            return False
        request.block_ids.extend(self.free_block_ids.popleft() for _ in range(num_needed))
        return True

    def free(self, request: Request) -> None:
        """Return all of ``request``'s blocks to the free list."""
        self.free_block_ids.extend(b for b in request.block_ids if b != self.FREED_BLOCK_ID)
        request.block_ids = []

    def free_blocks_outside_window(self, request: Request, sliding_window: int) -> int:
        """Free the blocks no query of ``request``'s next step can see; how many were freed.

        The next step's first query sits at position ``num_computed_tokens`` and sees keys from
        ``num_computed_tokens - sliding_window + 1`` on, later queries later still: a block whose
        every position is before that is dead. Its entry becomes ``FREED_BLOCK_ID`` in a new
        list (the runner rewrites a block-table row whose list was replaced). A step still on
        the device may read such a block; a new owner writes it only in a later step, after it.
        """
        first_visible = request.num_computed_tokens - sliding_window + 1
        num_dead = min(max(first_visible, 0) // self.block_size, len(request.block_ids))
        block_ids = request.block_ids
        if num_dead == 0 or block_ids[num_dead - 1] == self.FREED_BLOCK_ID:
            return 0  # freed blocks are a prefix: nothing new died
        freed = [b for b in block_ids[:num_dead] if b != self.FREED_BLOCK_ID]
        self.free_block_ids.extend(freed)
        request.block_ids = [self.FREED_BLOCK_ID] * num_dead + block_ids[num_dead:]
        return len(freed)


class StateSlotManager:
    """Hands out one Mamba state slot per running request.

    Slot 0 is the null slot: the runner points padded rows at it, so it is never handed out and
    ``num_slots - 1`` requests can hold a slot at once.
    """

    NULL_SLOT = 0

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(
                f"num_slots={num_slots}: need at least 2 Mamba state slots (slot 0 is the null "
                "slot for padded rows); size the state cache for max_num_seqs + 1"
            )
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(1, num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def allocate(self, request: Request) -> bool:
        """Give ``request`` a slot unless it has one; False if none is free."""
        if request.state_slot is not None:
            return True
        if not self.free_slots:
            return False
        request.state_slot = self.free_slots.popleft()
        return True

    def free(self, request: Request) -> None:
        if request.state_slot is not None:
            self.free_slots.append(request.state_slot)
            request.state_slot = None
