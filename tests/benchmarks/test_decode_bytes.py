"""The bandwidth floor's bytes of a hybrid model: ``latency.decode_bytes`` of a tiny Qwen3.5
(three Gated DeltaNet layers, one full-attention layer) counts the weights but the input
embedding once, the attention layer's KV at the mean context per sequence, and per sequence each
Gated DeltaNet layer's conv window and delta-rule state, read and written back.

Run: pytest tests/benchmarks/test_decode_bytes.py
"""

from __future__ import annotations

import pytest

from pieceworks.benchmarks.latency import LatencyCase, decode_bytes, recurrent_state_bytes
from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import num_parameters, random_hf_checkpoint

FLOAT32_BYTES = 4
QWEN3_5_TINY = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def qwen3_5_engine(tmp_path_factory) -> tuple[LLM, str]:
    path = random_hf_checkpoint(QWEN3_5_TINY, tmp_path_factory.mktemp("qwen3_5"), seed=2)
    llm = LLM(str(path), compilation_config={"level": 0}, dtype="float32", max_num_seqs=4)
    return llm, str(path)


def test_recurrent_state_is_each_gated_delta_net_slot_read_and_written(qwen3_5_engine):
    llm, _ = qwen3_5_engine
    key_dim, value_dim = 2 * 16, 4 * 8
    conv_window = (2 * key_dim + value_dim) * (4 - 1)  # [q, k, v] channels x (d_conv - 1)
    delta_rule_state = 4 * 16 * 8  # value heads x key head dim x value head dim (float32 slots)
    per_layer = (conv_window + delta_rule_state) * FLOAT32_BYTES
    assert recurrent_state_bytes(llm.engine.runner) == 2 * 3 * per_layer  # read + write, 3 layers


def test_decode_bytes_adds_kv_and_state_per_sequence_to_the_weights(qwen3_5_engine):
    llm, path = qwen3_5_engine
    case = LatencyCase(path, batch_size=3, input_len=8, output_len=6)
    weights = (num_parameters(QWEN3_5_TINY) - 256 * 64) * FLOAT32_BYTES  # not the input embedding
    mean_context = 8 + 6 / 2
    kv = 2 * 2 * 16 * FLOAT32_BYTES * mean_context  # K and V of the one attention layer
    state = recurrent_state_bytes(llm.engine.runner)
    assert decode_bytes(llm, case) == int(weights + 3 * (kv + state))
