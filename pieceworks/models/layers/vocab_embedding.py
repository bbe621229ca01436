"""Token embedding and LM head with vLLM's names: ``VocabParallelEmbedding``, ``ParallelLMHead``.

Both hold a ``(vocab_size, hidden_size)`` weight. With tensor parallelism the vocabulary would be
split across ranks (see ``linear.tensor_parallel_rank_and_size``); for now every rank holds it all.
The LM head runs outside the compiled graph (``compute_logits``), on the last hidden states only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pieceworks.models.layers.linear import tensor_parallel_rank_and_size
from pieceworks.models.loader import copy_weight


class VocabParallelEmbedding(nn.Module):
    """``input_ids (T,) -> (T, hidden_size)`` by row lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, prefix: str = "") -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tensor_parallel_rank_and_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # (T, hidden)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        name = f"{self.prefix}.weight" if self.prefix else "weight"
        copy_weight(param, loaded_weight, name)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class ParallelLMHead(VocabParallelEmbedding):
    """``hidden_states (T, hidden) -> logits (T, vocab)`` in the weight's dtype.

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
        return F.linear(hidden_states, self.weight)  # (T, vocab)
