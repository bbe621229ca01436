"""``BlockManager`` (paged KV blocks and their prefix cache) and ``StateSlotManager`` (Mamba state
slots).

Owns the free lists of the two per-request caches and writes the ids into ``Request.block_ids`` /
``Request.state_slot``. It does not decide who gets memory (the scheduler does) and holds no
tensors (the model runner owns the KV cache and the state cache these ids index).

Prefix caching (vLLM v1's ``BlockPool``): a full block whose KV is computed is registered under
its hash (``block_hash.py``) and reference-counted; a later request whose tokens start with the
same blocks takes them instead of computing them (``get_computed_blocks``). A block whose last
holder lets go keeps its hash and waits, evictable, in a least-recently-used queue; a new block
comes first from the blocks that hold no hash (never used, or freed unregistered), and only when
none is left is the least recently used cached block evicted (its hash forgotten). Blocks are
only read once registered, never written: a request writes only positions past its computed
tokens, and a cache hit never covers a request's last token.
With a model whose every attention layer has a sliding window, a running request's blocks wholly
before its window are let go early (``free_blocks_outside_window``), as its own reference drops.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from pieceworks.scheduler.block_hash import BlockHash, root_block_hash, update_block_hashes
from pieceworks.scheduler.request import Request


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


class BlockManager:
    """Hands out KV-cache blocks of ``block_size`` tokens on demand and takes them back.

    ``request.block_ids[i]`` holds the KV of token positions ``[i * block_size, (i + 1) *
    block_size)``, or is ``FREED_BLOCK_ID`` once let go outside a sliding window: a placeholder
    that keeps the list's length (block ``i`` still stands for those positions) and that the
    attention kernels never read (they load no key before a window). ``allocate`` is
    all-or-nothing: it never leaves a request half-extended, and only ever appends to
    ``block_ids`` (``free`` and ``free_blocks_outside_window`` replace the list). With
    ``enable_prefix_caching`` blocks may be shared: ``ref_counts[b]`` requests hold block ``b``,
    and a free block is either unhashed (``free_block_ids``' first part) or cached and evictable.
    """

    FREED_BLOCK_ID = -1

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        model_identity: str = "",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks={num_blocks} and block_size={block_size} must both be >= 1; "
                "the KV cache has no room (give it more memory)"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_block_hash(model_identity)
        self.ref_counts = [0] * num_blocks
        self._unhashed_free: deque[int] = deque(range(num_blocks))  # taken first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached_blocks: dict[BlockHash, int] = {}
        # Prompt tokens looked up in the prefix cache on admission, and those found there.
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evicted on demand)."""
        return len(self._unhashed_free) + len(self._cached_free)

    @property
    def free_block_ids(self) -> list[int]:
        """The free blocks in the order they are handed out: unhashed first, then cached ones,
        least recently used first."""
        return [*self._unhashed_free, *self._cached_free]

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._cached_blocks)

    @property
    def num_tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so ``request`` covers ``num_computed_tokens + num_new_tokens`` tokens."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_tokens, self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.num_free_blocks

    def allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Append the blocks ``request`` needs for ``num_new_tokens``; if short, change nothing.

        ``computed_blocks`` (a request holding no blocks yet, from ``get_computed_blocks``) are
        taken first and counted as computed: ``num_new_tokens`` come after them, and the caller
        sets ``num_computed_tokens`` to their tokens.
        """
        if computed_blocks:
            return self._allocate_with_hits(request, num_new_tokens, computed_blocks)
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(request.block_ids)  # blocks_needed
        if num_needed <= 0:
            return True  # the common decode step: the last block still has room
        if num_needed > self.num_free_blocks:
            return False
        request.block_ids.extend(self._take_free_block() for _ in range(num_needed))
        return True

    def _allocate_with_hits(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int]
    ) -> bool:
        num_tokens = len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size) - len(computed_blocks)
        # A hit that waits in the free queue stops being free once taken.
        num_evictable_hits = sum(not self.ref_counts[b] for b in computed_blocks)
        if num_needed > self.num_free_blocks - num_evictable_hits:
            return False
        for block_id in computed_blocks:  # taken before any eviction can reach them
            if not self.ref_counts[block_id]:
                del self._cached_free[block_id]
            self.ref_counts[block_id] += 1
        request.block_ids = list(computed_blocks)
        request.block_ids.extend(self._take_free_block() for _ in range(num_needed))
        request.num_cached_blocks = len(computed_blocks)
        return True

    def _take_free_block(self) -> int:
        """A free block for new KV: an unhashed one, else the least recently used cached one
        (evicted: its hash is forgotten)."""
        if self._unhashed_free:
            block_id = self._unhashed_free.popleft()
        else:
            block_id, _ = self._cached_free.popitem(last=False)
            self._forget_hash(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            self._block_hashes[block_id] = None
            if self._cached_blocks.get(block_hash) == block_id:
                del self._cached_blocks[block_hash]

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks ``request``'s tokens start with (its longest cached prefix of full
        blocks), never its last token's block: that token is computed for its logits. Counts
        the lookup in the hit-rate counters; takes nothing (``allocate`` does)."""
        if not self.enable_prefix_caching:
            return []
        update_block_hashes(request, self.block_size, self.root_hash)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self._cached_blocks.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix-cache lookup (its tokens, and those found)."""
        self.num_prefix_cache_queries += request.num_tokens
        self.num_prefix_cache_hits += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register ``request``'s full blocks whose KV is computed and whose tokens are known.

        Called for KV of steps already launched (the device writes it before any later step
        reads it). A block whose content another block already holds stays unregistered.
        """
        if not self.enable_prefix_caching:
            return
        num_tokens = min(request.num_computed_tokens, request.num_tokens_known)
        num_full = min(num_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return
        update_block_hashes(request, self.block_size, self.root_hash)
        for index in range(request.num_cached_blocks, num_full):
            block_hash = request.block_hashes[index]
            block_id = request.block_ids[index]
            if block_hash not in self._cached_blocks and block_id != self.FREED_BLOCK_ID:
                self._forget_hash(block_id)
                self._block_hashes[block_id] = block_hash
                self._cached_blocks[block_hash] = block_id
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Let go of all of ``request``'s blocks (its computed full blocks stay cached)."""
        self.cache_computed_blocks(request)
        # Last block first: a request's tail is evicted before the prefix others may share.
        self.free_blocks(b for b in reversed(request.block_ids) if b != self.FREED_BLOCK_ID)
        request.block_ids = []
        request.num_cached_blocks = 0

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds becomes free (cached blocks
        keep their hash and join the evictable queue as most recently used)."""
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self._block_hashes[block_id] is None:
                    self._unhashed_free.append(block_id)
                else:
                    self._cached_free[block_id] = None

    def uncache(self, request: Request) -> None:
        """Forget the hashes of ``request``'s blocks (their KV may never have been written: its
        step failed), so no later request reads them."""
        for block_id in request.block_ids:
            if block_id != self.FREED_BLOCK_ID:
                self._forget_hash(block_id)
        request.num_cached_blocks = len(request.block_ids)  # never registered again

    def reset_prefix_cache(self) -> None:
        """Forget every cached block's hash (held blocks stay held)."""
        for block_id in range(self.num_blocks):
            self._forget_hash(block_id)
        self._unhashed_free.extend(self._cached_free)
        self._cached_free.clear()

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
        self.cache_computed_blocks(request)  # their KV is computed: findable once let go
        freed = [b for b in block_ids[:num_dead] if b != self.FREED_BLOCK_ID]
        self.free_blocks(freed)
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
