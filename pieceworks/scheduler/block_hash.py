"""Block hashes of the prefix cache: what identifies a full KV block's content.

A full block of ``block_size`` tokens is named by a SHA-256 digest chained over its parent
block's hash, its token ids and its extra keys, so equal hashes mean equal token prefixes (the
whole prefix up to and including the block) and therefore equal KV. The first block's parent is
a root hash derived from the model's identity, so two engines' caches never mix; per-request
extra keys (LoRA adapter, multimodal inputs, a cache salt) go into every block's hash through
``request_extra_keys``, which has none yet. ``update_block_hashes`` extends a request's
``block_hashes`` as its known tokens (prompt and generated) fill blocks. The ``BlockManager``
(``block_manager.py``) looks hashes up and registers blocks under them.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

from pieceworks.scheduler.request import Request

BlockHash = bytes


def model_identity(model_config: Any) -> str:
    """What the root hash names (a ``ModelConfig``'s): the weights and how they are computed."""
    return (
        f"{model_config.model}|{model_config.dtype}|{model_config.quantization}"
        f"|seed={model_config.seed}"
    )


def root_block_hash(model_identity: str) -> BlockHash:
    """The parent hash of every request's first block: the model's identity, digested."""
    return hashlib.sha256(b"pieceworks-prefix-cache\0" + model_identity.encode()).digest()


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: list[int], extra_keys: tuple[object, ...] = ()
) -> BlockHash:
    """The hash of one full block: its parent's hash, its token ids and its extra keys."""
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def request_extra_keys(request: Request) -> tuple[object, ...]:
    """Keys besides the tokens that change a block's KV for ``request``: none yet (the slot
    where LoRA adapters, multimodal inputs and cache salts go)."""
    return ()


def update_block_hashes(request: Request, block_size: int, root_hash: BlockHash) -> None:
    """Append the hashes of ``request``'s blocks that its known tokens have filled since."""
    hashes = request.block_hashes
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_known = len(prompt) + len(output)
    num_full = num_known // block_size
    if len(hashes) >= num_full:
        return
    extra_keys = request_extra_keys(request)
    parent = hashes[-1] if hashes else root_hash
    for index in range(len(hashes), num_full):
        start, end = index * block_size, (index + 1) * block_size
        if end <= len(prompt):
            token_ids = prompt[start:end]
        else:
            first = max(start - len(prompt), 0)
            token_ids = prompt[start:end] + output[first : end - len(prompt)]
        parent = hash_block_tokens(parent, token_ids, extra_keys)
        hashes.append(parent)
