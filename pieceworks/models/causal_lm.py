"""``CausalLM``: the part every decoder-only model shares around its compiled backbone.

A model class names its backbone (``model_cls``: the ``@support_torch_compile`` module taking
``input_ids (T,)`` and ``positions (T,)``); this base adds the LM head (tied or not), applied in
``compute_logits`` outside the compiled graph, and ``load_weights``, which maps HF checkpoint names
onto the merged ``qkv_proj`` / ``gate_up_proj`` weights. With tensor parallelism the model is built
per rank (the layers shard themselves) and ``compute_logits`` gathers the vocabulary slices, so
every rank returns the full logits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from pieceworks.distributed.communication_op import tensor_model_parallel_all_gather
from pieceworks.distributed.parallel_state import tensor_parallel_rank_and_size
from pieceworks.models.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pieceworks.models.loading.config_defaults import with_architecture_defaults
from pieceworks.models.loading.weight_utils import (
    get_weight_loader,
    is_ignored_tensor,
    unexpected_tensor_error,
)

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig


def maybe_prefix(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the top level (vLLM's helper)."""
    return f"{prefix}.{name}" if prefix else name


def check_parallel_state(config: EngineConfig) -> None:
    """The layers shard by the initialised TP group: it must match ``config.parallel_config``."""
    parallel = config.parallel_config
    tp_rank, tp_size = tensor_parallel_rank_and_size()
    if (tp_rank, tp_size) != (parallel.rank, parallel.tensor_parallel_size):
        raise RuntimeError(
            f"parallel_config says rank {parallel.rank} of tensor_parallel_size="
            f"{parallel.tensor_parallel_size}, but this process is tensor-parallel rank {tp_rank} "
            f"of {tp_size}: call pieceworks.distributed.init_distributed_environment("
            f"{parallel.tensor_parallel_size}, {parallel.rank}) before building the model"
        )


class CausalLM(nn.Module):
    """Backbone + LM head + HF-checkpoint loading; subclasses set ``model_cls``."""

    model_cls: ClassVar[type[nn.Module]]
    # Merged parameter -> the HF modules stacked into it, in shard order.
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # (param name, checkpoint name, shard id) for the merged weights.
    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        check_parallel_state(config)
        hf_config = config.model_config.hf_config
        self.config = config
        self.vocab_size = hf_config["vocab_size"]
        self.tie_word_embeddings = bool(
            with_architecture_defaults(hf_config)["tie_word_embeddings"]
        )
        self.model = self.model_cls(config=config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            hf_config["vocab_size"],
            hf_config["hidden_size"],
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if self.tie_word_embeddings:
            embedding = self.model.embed_tokens
            assert isinstance(embedding, VocabParallelEmbedding)
            self.lm_head.tie_weights(embedding)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids (T,)``, ``positions (T,)`` -> hidden states ``(T, hidden)``."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states ``(N, hidden)`` -> logits ``(N, vocab)`` in the LM head's dtype (outside
        the graph; the sampler casts to float32 where it computes probabilities, as vLLM's does).

        Each rank computes its vocabulary slice; the slices are gathered on every rank and the
        padding of the last one is dropped.
        """
        logits = self.lm_head(hidden_states)  # (N, rows)
        if self.lm_head.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[:, : self.vocab_size]
        return logits  # (N, vocab)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; returns the parameter names loaded."""
        params_dict = dict(self.named_parameters())
        loaded_params: set[str] = set()
        for checkpoint_name, loaded_weight in weights:
            if is_ignored_tensor(checkpoint_name):
                continue
            if self.tie_word_embeddings and checkpoint_name == "lm_head.weight":
                continue  # some tied checkpoints still carry it; the embedding is the weight
            name, shard_id = self._param_name_and_shard(checkpoint_name)
            if name not in params_dict:
                raise unexpected_tensor_error(self, checkpoint_name)
            shard_args = () if shard_id is None else (shard_id,)
            get_weight_loader(self, name)(params_dict[name], loaded_weight, *shard_args)
            loaded_params.add(name)
        return loaded_params

    def _param_name_and_shard(self, checkpoint_name: str) -> tuple[str, str | int | None]:
        """``...self_attn.k_proj.weight`` -> (``...self_attn.qkv_proj.weight``, ``"k"``)."""
        for param_name, weight_name, shard_id in self.stacked_params_mapping:
            if weight_name in checkpoint_name:
                return checkpoint_name.replace(weight_name, param_name), shard_id
        return checkpoint_name, None
