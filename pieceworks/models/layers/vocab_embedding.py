"""Token embedding and LM head with vLLM's names: ``VocabParallelEmbedding``, ``ParallelLMHead``.

Both hold this rank's rows of the ``(vocab_size, hidden_size)`` weight. With tensor parallelism
the vocabulary is split into ``cdiv(vocab_size, tp)`` rows per rank; rank ``r`` holds token ids
``[r * rows, min((r + 1) * rows, vocab_size))`` and the rows past the vocabulary (the last
shard's padding) are zeros. The embedding looks up the ids it holds, zeroes the others and sums
the ranks' partial rows with the traced all-reduce. The LM head computes this rank's slice of the
logits; ``CausalLM.compute_logits`` gathers the slices outside the compiled graph, on the last
hidden states only, and drops the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pieceworks.distributed.communication_op import tensor_model_parallel_all_reduce
from pieceworks.distributed.parallel_state import tensor_parallel_rank_and_size
from pieceworks.models.loading.weight_utils import shard_rows


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """``(start, end, rows)``: rank ``tp_rank`` holds ids ``[start, end)`` in ``rows`` rows.

    ``rows = cdiv(vocab_size, tp_size)`` on every rank; ``rows - (end - start)`` are padding.
    """
    rows = -(-vocab_size // tp_size)
    start = min(tp_rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


class VocabParallelEmbedding(nn.Module):
    """``input_ids (T,) -> (T, hidden_size)`` by row lookup, the vocabulary split across ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, prefix: str = "") -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tensor_parallel_rank_and_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.vocab_start, self.vocab_end, self.num_embeddings_per_partition = vocab_range(
            num_embeddings, self.tp_rank, self.tp_size
        )
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # (T, hidden)
        held = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # (T,)
        local_ids = (input_ids - self.vocab_start) * held  # ids held elsewhere read row 0
        embeddings = F.embedding(local_ids, self.weight)  # (T, hidden)
        embeddings = embeddings.masked_fill(~held.unsqueeze(-1), 0)  # ... and contribute zeros
        return tensor_model_parallel_all_reduce(embeddings)  # (T, hidden)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """This rank's rows of the ``(vocab_size, hidden)`` tensor; padding rows are zeros."""
        name = f"{self.prefix}.weight" if self.prefix else "weight"
        num_rows = self.vocab_end - self.vocab_start
        full_shape = (self.num_embeddings, self.embedding_dim)
        rows = shard_rows(loaded_weight, full_shape, [(self.vocab_start, num_rows)], name)
        with torch.no_grad():
            param[:num_rows].copy_(rows)
            param[num_rows:].zero_()

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"rows={self.num_embeddings_per_partition} (ids {self.vocab_start}..{self.vocab_end})"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """``hidden_states (T, hidden) -> logits (T, rows)`` of this rank's vocabulary slice.

    Untied, it owns its weight; ``tie_weights(embedding)`` makes it share the input embedding's
    (``tie_word_embeddings`` in config.json; the checkpoint then has no ``lm_head.weight``).
    """

    def tie_weights(self, embedding: VocabParallelEmbedding) -> ParallelLMHead:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie {self.prefix or 'lm_head'} {tuple(self.weight.shape)} to an "
                f"embedding of shape {tuple(embedding.weight.shape)}"
            )
        self.weight = embedding.weight
        return self

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight)  # (T, rows), padding columns are 0
