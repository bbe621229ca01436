"""The attention layer's per-shape plans: the Triton backend through ``Attention.attend``.

Proves that (1) a layer on the Triton backend gives the torch reference layer's output and cache
writes for decode, prefill and mixed steps, also when its plan is reused across calls with new
values in the same buffers (what a graph replay or a PIECEWISE step does); (2) two layers sharing
one ``DecodeWorkspace`` (as the runner binds it) get the same scratch views and both stay right
when run in turn; (3) a bad layout raises a clear ``ValueError`` on the first call of its shape
and caches nothing, so it raises again; (4) one plan is built per shape signature, a call with
the very tensors and ``max_query_len`` of the layer's last call takes its plan without reading
the signature, and binding a new KV cache forgets them; (5) ``DecodeWorkspace`` hands out the
same views per shape, shares one buffer between shapes, and keeps outgrown buffers alive; (6) a
call given an ``output_scale`` (what the attention quant fusion pass passes for an FP8
``o_proj``) writes
``static_scaled_fp8_quant`` of the unquantized output with that scale on both backends (the torch
backend byte for byte, Triton within one e4m3 step), a new scale needs no new plan, and an FP8
output without a scale (or a scale with another output) raises clearly. A GPU test captures two
layers in one CUDA graph and replays it with new metadata.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (see
``tests/kernels/test_attention_kernels.py`` for how TRITON_INTERPRET is set).
Run: PYTHONPATH=. python -m pytest tests/models/test_attention_layer.py -q
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pieceworks.config import EngineConfig  # noqa: E402
from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE, static_scaled_fp8_quant  # noqa: E402
from pieceworks.kernels.attention import triton_attention  # noqa: E402
from pieceworks.models.attention.backends import (  # noqa: E402
    TorchAttentionBackend,
    TritonAttentionBackend,
)
from pieceworks.models.attention.layer import Attention  # noqa: E402
from pieceworks.models.attention.metadata import AttentionMetadata  # noqa: E402
from pieceworks.models.attention.ops import DecodeWorkspace  # noqa: E402

INTERPRETED = isinstance(triton_attention._prefill_kernel, InterpretedFunction)
ON_GPU = not INTERPRETED and torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not INTERPRETED and not ON_GPU,
    reason="the Triton kernels were imported compiled and no GPU is visible: run with "
    "TRITON_INTERPRET=1 in the environment",
)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 32, 16
NUM_BLOCKS, MAX_BLOCKS = 40, 8  # a block table row covers 128 tokens; 5 rows fit
SCALE = HEAD_SIZE**-0.5
TOLERANCE = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_layer(config: EngineConfig, name: str, backend, head_size: int = HEAD_SIZE) -> Attention:
    layer = Attention(NUM_HEADS, head_size, SCALE, NUM_KV_HEADS, config=config, prefix=name)
    layer.backend = backend
    return layer


def make_cache() -> tuple[torch.Tensor, torch.Tensor]:
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=DEVICE)
    return cache[0], cache[1]


def make_step(seq_lens: list[int], query_lens: list[int], num_padded_tokens: int = 0):
    """Flat q/k/v as slices of one fused projection, and metadata with shuffled block tables."""
    num_tokens = sum(query_lens) + num_padded_tokens
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    qkv = torch.randn(num_tokens, width, device=DEVICE)
    query, key, value = qkv.split(
        [NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE], dim=-1
    )
    metadata = AttentionMetadata(
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        query_start_loc=torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.zeros(len(seq_lens), dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(len(seq_lens), MAX_BLOCKS, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
    )
    rewrite_step(metadata, qkv, seq_lens, query_lens)
    return qkv, (query, key, value), metadata


def rewrite_step(metadata: AttentionMetadata, qkv, seq_lens, query_lens) -> None:
    """New values in the same tensors: inputs, context lengths, block tables and slots."""
    qkv.copy_(torch.randn_like(qkv))
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    metadata.query_start_loc.copy_(starts)
    metadata.seq_lens.copy_(torch.tensor(seq_lens))
    blocks = torch.randperm(NUM_BLOCKS)[: len(seq_lens) * MAX_BLOCKS]
    metadata.block_tables.copy_(blocks.view(len(seq_lens), MAX_BLOCKS))
    slots = torch.full((metadata.slot_mapping.shape[0],), -1, dtype=torch.int64)
    for seq, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for i, position in enumerate(range(seq_len - query_len, seq_len)):
            block = int(metadata.block_tables[seq, position // BLOCK_SIZE])
            slots[int(starts[seq]) + i] = block * BLOCK_SIZE + position % BLOCK_SIZE
    metadata.slot_mapping.copy_(slots)


def run_both(triton_layer, reference_layer, qkv_views, metadata):
    """One call of each layer on its own copy of the caches; outputs and caches to compare."""
    query, key, value = qkv_views
    outputs = []
    for layer in (triton_layer, reference_layer):
        output = torch.full_like(query, 999.0)
        layer.attend(query, key, value, output, metadata)
        outputs.append(output)
    return outputs


def assert_layers_agree(triton_layer, reference_layer, qkv_views, metadata) -> None:
    actual, expected = run_both(triton_layer, reference_layer, qkv_views, metadata)
    real = metadata.num_actual_tokens
    torch.testing.assert_close(actual[:real], expected[:real], **TOLERANCE)
    assert (actual[real:] == 999.0).all(), "a padded row was written"
    for got, want in zip(triton_layer.kv_cache, reference_layer.kv_cache, strict=True):
        assert torch.equal(got, want), "the stored K/V differ from the reference store"


def paired_layers(name: str):
    """A Triton layer and a torch reference layer on identical copies of one cache."""
    config = EngineConfig()
    triton_layer = make_layer(config, f"{name}.triton", TritonAttentionBackend)
    reference_layer = make_layer(config, f"{name}.torch", TorchAttentionBackend)
    key_cache, value_cache = make_cache()
    triton_layer.kv_cache = (key_cache, value_cache)
    reference_layer.kv_cache = (key_cache.clone(), value_cache.clone())
    return triton_layer, reference_layer


STEPS = {
    "decode": ([9, 70, 128, 1], [1, 1, 1, 1], 0),
    "decode_padded": ([33, 100, 0], [1, 1, 0], 1),  # a padded sequence and a padded row
    "prefill": ([20, 7], [20, 7], 0),
    "mixed": ([50, 40, 17], [1, 12, 17], 2),
}


@pytest.mark.parametrize("step", STEPS)
def test_plan_reused_with_new_values_matches_reference(step):
    seq_lens, query_lens, num_padded = STEPS[step]
    triton_layer, reference_layer = paired_layers(step)
    qkv, views, metadata = make_step(seq_lens, query_lens, num_padded)
    for call in range(3):  # the first call plans; the others reuse the plan
        if call:
            rewrite_step(metadata, qkv, seq_lens, query_lens)
        assert_layers_agree(triton_layer, reference_layer, views, metadata)
    assert len(triton_layer._plans) == 1


def test_layers_sharing_a_workspace_run_in_turn():
    config = EngineConfig()
    workspace = DecodeWorkspace()
    seq_lens = [120, 3, 64]
    layers = []
    for index in range(2):
        layer = make_layer(config, f"shared.{index}.triton", TritonAttentionBackend)
        reference = make_layer(config, f"shared.{index}.torch", TorchAttentionBackend)
        key_cache, value_cache = make_cache()
        layer.bind_kv_cache((key_cache, value_cache), workspace)
        reference.kv_cache = (key_cache.clone(), value_cache.clone())
        layers.append((layer, reference))
    qkv, views, metadata = make_step(seq_lens, [1, 1, 1])
    for _ in range(2):  # layer 0, layer 1, layer 0, layer 1: each reads what it just wrote
        for layer, reference in layers:
            assert_layers_agree(layer, reference, views, metadata)
        rewrite_step(metadata, qkv, seq_lens, [1, 1, 1])
    plans = [next(iter(layer._plans.values())) for layer, _ in layers]
    assert plans[0].attend.partial_out is plans[1].attend.partial_out
    assert plans[0].attend.partial_lse is plans[1].attend.partial_lse


@pytest.mark.parametrize("backend", [TritonAttentionBackend, TorchAttentionBackend])
def test_one_plan_per_signature_and_rebinding_forgets_them(backend):
    layer = make_layer(EngineConfig(), "plans", backend)
    layer.kv_cache = make_cache()
    _, views, decode = make_step([30, 40], [1, 1])
    # The same tensors through the prefill path: only max_query_len differs between the two.
    prefill = dataclasses.replace(decode, max_query_len=2)
    for metadata in [decode, prefill, decode, prefill]:
        layer.attend(*views, torch.empty_like(views[0]), metadata)
    assert len(layer._plans) == 2
    layer.kv_cache = make_cache()
    assert not layer._plans


def test_the_same_tensors_again_take_the_last_plan_without_its_signature(monkeypatch):
    layer = make_layer(EngineConfig(), "memo", TorchAttentionBackend)
    layer.kv_cache = make_cache()
    _, views, decode = make_step([30, 40], [1, 1])
    output = torch.empty_like(views[0])
    planned = []
    plan = layer._plan
    monkeypatch.setattr(layer, "_plan", lambda *args: planned.append(1) or plan(*args))
    prefill = dataclasses.replace(decode, max_query_len=2)  # the same tensors
    for metadata in [decode, decode, prefill, prefill, decode]:
        layer.attend(*views, output, metadata)
    assert len(planned) == 3  # a call whose max_query_len differs from the last one looks it up
    layer.kv_cache = make_cache()  # forgets the last plan too
    layer.attend(*views, output, decode)
    layer.attend(*views, torch.empty_like(output), decode)  # another output tensor
    assert len(planned) == 5


def test_bad_head_size_raises_on_every_first_call():
    layer = make_layer(EngineConfig(), "bad", TritonAttentionBackend, head_size=24)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 24, device=DEVICE)
    layer.kv_cache = (cache[0], cache[1])
    query = torch.zeros(2, NUM_HEADS * 24, device=DEVICE)
    key = torch.zeros(2, NUM_KV_HEADS * 24, device=DEVICE)
    _, _, metadata = make_step([5, 6], [1, 1])
    for _ in range(2):  # nothing was cached by the failed call
        with pytest.raises(ValueError, match="power of two"):
            layer.attend(query, key, key.clone(), torch.empty_like(query), metadata)
    assert not layer._plans


def test_mismatched_slot_mapping_raises():
    layer = make_layer(EngineConfig(), "slots", TritonAttentionBackend)
    layer.kv_cache = make_cache()
    _, (query, key, value), metadata = make_step([5, 6], [1, 1])
    metadata.slot_mapping = metadata.slot_mapping[:1]
    with pytest.raises(ValueError, match="slot_mapping"):
        layer.attend(query, key, value, torch.empty_like(query), metadata)


def test_unbound_cache_raises():
    layer = make_layer(EngineConfig(), "unbound", TritonAttentionBackend)
    _, (query, key, value), metadata = make_step([5], [1])
    with pytest.raises(RuntimeError, match="no KV cache bound"):
        layer.attend(query, key, value, torch.empty_like(query), metadata)


def test_workspace_views_per_shape_and_growth():
    workspace = DecodeWorkspace()
    big_out, big_lse = workspace.get(4, 8, 16, 32, DEVICE)
    assert big_out.shape == (4, 8, 16, 32) and big_lse.shape == (4, 8, 16)
    assert workspace.get(4, 8, 16, 32, DEVICE)[0] is big_out  # the same views every time
    small_out, _ = workspace.get(1, 8, 2, 32, DEVICE)
    assert small_out.untyped_storage().data_ptr() == big_out.untyped_storage().data_ptr()
    huge_out, huge_lse = workspace.get(8, 8, 16, 32, DEVICE)  # outgrows the buffer
    assert huge_out.untyped_storage().data_ptr() != big_out.untyped_storage().data_ptr()
    assert huge_lse.data_ptr() == huge_out.data_ptr() + huge_out.numel() * 4
    big_out.fill_(1.0)  # the outgrown buffer is still alive and writable through its views
    assert workspace.get(4, 8, 16, 32, DEVICE)[0] is big_out


@pytest.mark.parametrize("step", STEPS)
def test_fp8_output_is_the_quantized_output_with_the_scale_of_the_call(step):
    seq_lens, query_lens, num_padded = STEPS[step]
    triton_layer, reference_layer = paired_layers(f"fp8.{step}")
    plain_layer = make_layer(EngineConfig(), f"fp8.{step}.plain", TorchAttentionBackend)
    plain_layer.kv_cache = tuple(cache.clone() for cache in reference_layer.kv_cache)
    layers = (triton_layer, reference_layer, plain_layer)
    qkv, (query, key, value), metadata = make_step(seq_lens, query_lens, num_padded)
    real = metadata.num_actual_tokens
    # outputs of randn V up to ~3: at 0.003 the largest saturate
    for call, input_scale in enumerate([0.003, 0.02]):
        if call:
            rewrite_step(metadata, qkv, seq_lens, query_lens)
        scale = torch.tensor(input_scale, device=DEVICE)
        actual = torch.empty_like(query, dtype=KERNEL_FP8_DTYPE)
        expected = torch.empty_like(query, dtype=KERNEL_FP8_DTYPE)
        plain = torch.empty_like(query)
        for layer, output in zip(layers, (actual, expected, plain), strict=True):
            layer.attend(query, key, value, output, metadata, None if output is plain else scale)
        quantized = static_scaled_fp8_quant(plain, scale)
        assert torch.equal(expected[:real].view(torch.uint8), quantized[:real].view(torch.uint8))
        actual, expected = actual[:real].float(), expected[:real].float()
        assert (actual == expected).float().mean() >= 0.99
        torch.testing.assert_close(actual, expected, rtol=2**-3, atol=2**-9)  # one e4m3 step
    assert len(triton_layer._plans) == 1  # the new scale needed no new plan


def test_fp8_output_exactly_when_a_scale_is_given_else_a_clear_error():
    layer = make_layer(EngineConfig(), "fp8.errors", TritonAttentionBackend)
    layer.kv_cache = make_cache()
    _, (query, key, value), metadata = make_step([5, 6], [1, 1])
    scale = torch.tensor(0.01, device=DEVICE)
    with pytest.raises(ValueError, match="does not quantize to") as error:
        layer.attend(query, key, value, torch.empty_like(query, dtype=KERNEL_FP8_DTYPE), metadata)
    assert "the output is FP8 exactly when output_scale is given" in str(error.value)
    with pytest.raises(ValueError, match="quantizes its output to"):
        layer.attend(query, key, value, torch.empty_like(query), metadata, scale)
    assert not layer._plans  # nothing cached: the same call raises again


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA or ROCm GPU")
def test_two_layers_captured_in_one_graph_replay_with_new_metadata():
    # Two layers sharing one workspace captured in one graph (as a FULL decode graph holds them),
    # replayed after the inputs change in place; the plans were made by the warm-up call.
    config = EngineConfig()
    workspace = DecodeWorkspace()
    seq_lens = [100, 7, 128, 0]
    pairs = []
    for index in range(2):
        layer = make_layer(config, f"graph.{index}.triton", TritonAttentionBackend)
        reference = make_layer(config, f"graph.{index}.torch", TorchAttentionBackend)
        key_cache, value_cache = make_cache()
        layer.bind_kv_cache((key_cache, value_cache), workspace)
        reference.kv_cache = (key_cache.clone(), value_cache.clone())
        pairs.append((layer, reference))
    qkv, (query, key, value), metadata = make_step(seq_lens, [1, 1, 1, 0], 1)
    outputs = [torch.zeros_like(query) for _ in pairs]

    def step():
        for (layer, _), output in zip(pairs, outputs, strict=True):
            layer.attend(query, key, value, output, metadata)

    step()  # warm-up: compiles the kernels and makes the plans
    torch.cuda.synchronize()
    for layer, reference in pairs:  # the warm-up stored K/V: give the references the same caches
        for cache, reference_cache in zip(layer.kv_cache, reference.kv_cache, strict=True):
            reference_cache.copy_(cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lens in ([3, 128, 64, 0], [128, 1, 2, 0]):
        rewrite_step(metadata, qkv, new_lens, [1, 1, 1, 0])
        graph.replay()
        torch.cuda.synchronize()
        for (_, reference), output in zip(pairs, outputs, strict=True):
            expected = torch.zeros_like(query)
            reference.attend(query, key, value, expected, metadata)
            torch.testing.assert_close(output[:3], expected[:3], **TOLERANCE)
