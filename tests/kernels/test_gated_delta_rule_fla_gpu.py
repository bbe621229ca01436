"""flash-linear-attention's gated delta-rule kernels equal the torch forms on a GPU, and a Qwen3.5
model's greedy tokens do not change with them.

Proves: over state slots, fla's chunked kernel (packed prefill sequences: one token, shorter
than a chunk, exactly a chunk, over two chunks; some continuing from their slot, a padded
sequence of no tokens on the null slot) and its fused recurrent kernel (decode rows, a padded
row on the null slot) give the torch forms' outputs and written states in float32 and bfloat16;
a mixed step through the Gated DeltaNet backend (decode rows, then prefills) equals the torch
kernels' step; a tiny Qwen3.5 checkpoint's greedy tokens with fla's kernels (what the CUDA
platform chooses) equal those with the torch forms (``custom_ops`` switching both off), in
FULL_AND_PIECEWISE. float32 runs with ``TRITON_F32_DEFAULT=ieee``: Triton's default float32
``tl.dot`` is TF32 on NVIDIA, which the comparison would otherwise have to allow for.
Run (GPU machine, fla extra installed): PYTHONPATH=. python -m pytest
tests/kernels/test_gated_delta_rule_fla_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pieceworks.kernels.gated_delta_rule import fla_gated_delta_rule as fla
from pieceworks.kernels.gated_delta_rule import torch_state_slots as ref
from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.models.gated_delta_net.backend import GatedDeltaNetBackend, GatedDeltaNetParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]
pytest.importorskip("fla")
pytest.importorskip("einops")

DEVICE = torch.device("cuda")
K_HEADS, V_HEADS, K_DIM, V_DIM, NUM_SLOTS = 2, 4, 128, 128, 8
TOLERANCES = {torch.float32: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(autouse=True)
def ieee_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")


def operands(num_tokens: int, dtype: torch.dtype, seed: int, batch: int = 1):
    """q, k, v in ``dtype`` (as the conv leaves them), g float32, beta in ``dtype``, states."""
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(DEVICE)  # noqa: E731
    q = randn(batch, num_tokens, K_HEADS, K_DIM).to(dtype)
    k = randn(batch, num_tokens, K_HEADS, K_DIM).to(dtype)
    v = randn(batch, num_tokens, V_HEADS, V_DIM).to(dtype)
    g = -F.softplus(randn(batch, num_tokens, V_HEADS))  # log decay <= 0, float32
    beta = torch.sigmoid(randn(batch, num_tokens, V_HEADS)).to(dtype)
    state = 0.1 * randn(NUM_SLOTS, V_HEADS, K_DIM, V_DIM)
    return q, k, v, g, beta, state


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_over_slots_equals_the_torch_form(dtype):
    lengths = [1, 37, 64, 100, 0]  # the last: a padded sequence of no tokens
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    slots = torch.tensor([3, 5, 1, 6, 0], dtype=torch.int32, device=DEVICE)
    has_initial_state = torch.tensor([True, False, True, False, False], device=DEVICE)
    q, k, v, g, beta, state = operands(sum(lengths), dtype, seed=0)
    expected_state = state.clone()
    expected = ref.chunk_gated_delta_rule_varlen(
        q, k, v, g, beta, expected_state, cu_seqlens.int(), slots, has_initial_state
    )
    out = fla.chunk_gated_delta_rule_varlen(
        q, k, v, g, beta, state, cu_seqlens.int(), slots, has_initial_state
    )
    assert out.dtype == dtype
    assert_close(out, expected, dtype)
    real = [3, 5, 1, 6]
    assert_close(state[real], expected_state[real], dtype)
    assert torch.equal(state[[2, 4, 7]], expected_state[[2, 4, 7]])  # no sequence's slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_recurrent_over_slots_equals_the_torch_form(dtype):
    slots = torch.tensor([2, 7, 4, 0, 0], dtype=torch.int32, device=DEVICE)  # two padded rows
    q, k, v, g, beta, state = operands(1, dtype, seed=1, batch=slots.shape[0])
    expected_state = state.clone()
    expected = ref.recurrent_gated_delta_rule_slots(q, k, v, g, beta, expected_state, slots)
    out = fla.recurrent_gated_delta_rule_slots(q, k, v, g, beta, state, slots)
    real = [0, 1, 2]
    assert_close(out[real], expected[real], dtype)
    assert_close(state[[2, 7, 4]], expected_state[[2, 7, 4]], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_through_the_backend_equals_the_torch_kernels(dtype):
    """Three decode rows, then a continued chunk of 20 tokens and a new prompt of 70."""
    decode_slots, prefill_lengths = [1, 4, 6], [20, 70]
    num_decodes = len(decode_slots)
    num_tokens = num_decodes + sum(prefill_lengths)
    starts = [0, 1, 2, 3, 23, 93]
    conv_dim, d_conv = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM, 4
    generator = torch.Generator().manual_seed(2)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(DEVICE)  # noqa: E731
    mixed_qkv = randn(num_tokens, conv_dim).to(dtype)
    g = -F.softplus(randn(num_tokens, V_HEADS))
    beta = torch.sigmoid(randn(num_tokens, V_HEADS)).to(dtype)
    conv_state = randn(NUM_SLOTS, conv_dim, d_conv - 1).to(dtype)
    state = 0.1 * randn(NUM_SLOTS, V_HEADS, K_DIM, V_DIM)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        max_query_len=max(prefill_lengths),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.ones(5, dtype=torch.int32, device=DEVICE),  # read: only its length
        block_tables=torch.zeros(5, 1, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
        state_indices=torch.tensor([*decode_slots, 2, 5], dtype=torch.int32, device=DEVICE),
        has_initial_state=torch.tensor([True, True, True, True, False], device=DEVICE),
        num_decodes=num_decodes,
    )
    weight = 0.3 * randn(conv_dim, d_conv).to(dtype)
    outputs, states = [], []
    for kernels in [ref, fla]:
        params = GatedDeltaNetParams(
            weight, K_HEADS, V_HEADS, K_DIM, V_DIM,
            chunk_kernel=kernels.chunk_gated_delta_rule_varlen,
            recurrent_kernel=kernels.recurrent_gated_delta_rule_slots,
        )  # fmt: skip
        output = torch.empty(num_tokens, V_HEADS * V_DIM, dtype=dtype, device=DEVICE)
        cache = (conv_state.clone(), state.clone())
        GatedDeltaNetBackend.forward(mixed_qkv, g, beta, output, cache, params, metadata)
        outputs.append(output)
        states.append(cache[1])
    assert_close(outputs[1], outputs[0], dtype)
    assert_close(states[1], states[0], dtype)


@pytest.fixture(scope="module")
def qwen3_5_checkpoint(tmp_path_factory) -> str:
    """A tiny random Qwen3.5 text checkpoint whose Gated DeltaNet heads fla's kernels take (32)."""
    from tests.models.test_qwen3_5_hf import SHAPE

    transformers = pytest.importorskip("transformers")
    shape = {**SHAPE, "linear_key_head_dim": 32, "linear_value_head_dim": 32}
    hf_config = transformers.Qwen3_5TextConfig(**shape)
    hf_config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_5_fla")
    transformers.Qwen3_5ForCausalLM(hf_config).float().save_pretrained(path)
    return str(path)


def greedy_tokens(path: str, custom_ops: list[str]) -> tuple[list[list[int]], dict[str, str]]:
    """Greedy tokens in FULL_AND_PIECEWISE, and what each delta-rule op ran."""
    from pieceworks.benchmarks.modes import compilation_for_mode
    from pieceworks.engine.llm import LLM
    from pieceworks.sampling_params import SamplingParams

    compilation = compilation_for_mode("full_and_piecewise", {"custom_ops": custom_ops})
    llm = LLM(path, compilation_config=compilation, dtype="float32", max_num_seqs=4)
    prompts = [[7], [3, 17, 92, 5], [200, 1, 44, 9, 61, 7, 250, 13, 8, 99, 4] * 7]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]
    chosen = llm.engine.runner.kernels.chosen_kernels()
    ops = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule")
    return tokens, {op: chosen[op].impl.name for op in ops}


def test_qwen3_5_greedy_tokens_with_fla_equal_the_torch_kernels(qwen3_5_checkpoint):
    with_fla, chosen = greedy_tokens(qwen3_5_checkpoint, [])
    assert chosen == {
        "chunk_gated_delta_rule": "fla_chunk",
        "recurrent_gated_delta_rule": "fla_fused_recurrent",
    }
    off = ["-chunk_gated_delta_rule", "-recurrent_gated_delta_rule"]
    with_torch, chosen = greedy_tokens(qwen3_5_checkpoint, off)
    assert set(chosen.values()) == {"torch"}
    assert with_fla == with_torch
