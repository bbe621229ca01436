"""The --compare peers run the same model as pieceworks: same weights, tokens and floor bytes.

HF eager ``generate``, the HF static-cache loop (``static_compiled``, with its grouped-query SDPA
attention) and the independent gpt-fast-style loop (``gpt_fast``) must choose the same greedy
tokens as the pieceworks engine for the bench's prompts (float32, CPU; the first 4 tokens, as
random tiny models can have near-ties later), count the same decode bytes as
``latency.decode_bytes``, and return results shaped like ``measure_mode``'s. On a grouped-query
shape with Llama 3 rotary scaling the two static loops agree with HF eager's logits. The static
loops compile with the "eager" backend here, except in the one Inductor test (reduce-overhead,
~25 s on a small CPU); the GPU test holds ``static_compiled`` within 10 % of ``gpt_fast``.
Run: pytest tests/benchmarks/test_baselines.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.benchmarks.latency import _COUNTERS, LatencyCase, _prompts, decode_bytes
from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint
from pieceworks.sampling_params import SamplingParams

pytest.importorskip("transformers")

from pieceworks.benchmarks.baselines import applicable_baselines  # noqa: E402
from pieceworks.benchmarks.peers.gpt_fast import (  # noqa: E402
    GptFastDecoder,
    build_gpt_fast_model,
    measure_gpt_fast,
)
from pieceworks.benchmarks.peers.hf_attention import fuse_hf_qkv  # noqa: E402
from pieceworks.benchmarks.peers.hf_eager import StepClock, hf_generate, measure_hf_eager  # noqa: E402
from pieceworks.benchmarks.peers.hf_model import (  # noqa: E402
    baseline_model_config,
    hf_decode_bytes,
    load_hf_baseline,
)
from pieceworks.benchmarks.peers.static_compiled import (  # noqa: E402
    StaticCacheDecoder,
    measure_static_cache_compiled,
)

NUM_COMPARED = 4  # greedy tokens compared per prompt (near-ties of random weights come later)
BANDWIDTH = 1e9  # bytes/s: any number; floors are compared, not judged
MEASURE_MODE_KEYS = {
    "mode",
    "merged_modes",
    "status",
    "level",
    "backend",
    "num_decode_steps",
    "device_busy_ms",
    "device_idle_share",
    "device_busy_note",
    "graph_mode",
    "latency_s",
    "decode_step_ms",
    "startup_s",
    "load_s",
    "compile_s",
    "capture_s",
    "graph_memory_gib",
    "counters",
    "first_output_token_ids",
    "floor_ms",
    "ratio_to_floor",
}


def tiny_case(model: str = "llama-tiny", output_len: int = 6) -> LatencyCase:
    return LatencyCase(model, 3, 8, output_len, 1, 2, {"dtype": "float32", "max_num_seqs": 4})


def engine(case: LatencyCase) -> LLM:
    return LLM(case.model, compilation_config={"level": 0}, **case.engine_args)


def engine_greedy(llm: LLM, case: LatencyCase) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=case.output_len, ignore_eos=True)
    prompts = _prompts(case, llm.config.model_config.hf_config["vocab_size"])
    return [out.outputs[0].token_ids[:NUM_COMPARED] for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def llama_tiny() -> tuple[LatencyCase, list[list[int]], int]:
    """The case, the engine's greedy tokens for its prompts, and the engine's decode bytes."""
    case = tiny_case()
    llm = engine(case)
    return case, engine_greedy(llm, case), decode_bytes(llm, case)


def test_hf_generate_and_static_loop_choose_the_engine_tokens(llama_tiny):
    case, expected, _ = llama_tiny
    _, model, input_ids = load_hf_baseline(case)
    clock = StepClock()
    hf_tokens = hf_generate(model, input_ids, case.output_len, clock)
    decoder = StaticCacheDecoder(model, case.input_len + case.output_len, compile_backend="eager")
    decoder.reset()  # a no-op on a fresh cache
    static_tokens = decoder.generate(input_ids, case.output_len)
    gpt_fast = build_gpt_fast_model(
        baseline_model_config(case), input_ids.device, case.batch_size, case.input_len + 6
    )
    gpt_fast_tokens = GptFastDecoder(gpt_fast, compile_backend="eager").generate(input_ids, 6)
    assert hf_tokens[:, :NUM_COMPARED].tolist() == expected
    assert static_tokens[:, :NUM_COMPARED].tolist() == expected
    assert gpt_fast_tokens[:, :NUM_COMPARED].tolist() == expected
    assert tuple(static_tokens.shape) == (case.batch_size, case.output_len)
    assert len(clock.step_seconds()) == case.output_len - 1  # one stamp per token chosen
    # A second generation reuses the cache in place (reset, no reallocation) and agrees.
    keys = decoder.cache.layers[0].keys
    decoder.reset()
    assert torch.equal(decoder.generate(input_ids, case.output_len), static_tokens)
    assert decoder.cache.layers[0].keys is keys


@pytest.mark.parametrize(
    "measure", [measure_hf_eager, measure_static_cache_compiled, measure_gpt_fast]
)
def test_results_have_the_measure_mode_shape_and_the_engine_floor(llama_tiny, measure):
    case, expected, engine_bytes = llama_tiny
    kwargs = {} if measure is measure_hf_eager else {"compile_backend": "eager"}
    result = measure(case, BANDWIDTH, **kwargs)
    assert set(result) == MEASURE_MODE_KEYS
    assert result["graph_mode"] == "baseline" and result["status"] == "ok"
    assert result["level"] is None  # a peer has no pieceworks compile level
    assert result["device_busy_ms"] is None  # the CPU traces no device work: n/a, not a number
    assert result["device_busy_note"].startswith("n/a")
    assert result["counters"] == dict.fromkeys(_COUNTERS, 0)
    assert result["first_output_token_ids"][:NUM_COMPARED] == expected[0]
    assert result["floor_ms"] == pytest.approx(engine_bytes / BANDWIDTH * 1e3)
    assert result["decode_step_ms"]["min"] <= result["decode_step_ms"]["median"]
    assert result["ratio_to_floor"] == pytest.approx(
        result["decode_step_ms"]["median"] / result["floor_ms"]
    )


def test_untied_checkpoint_directory_loads_the_same_weights(tmp_path):
    hf_config = {**get_preset("llama-tiny"), "tie_word_embeddings": False}
    random_hf_checkpoint(hf_config, tmp_path, seed=5, dtype=torch.float32)
    case = LatencyCase(str(tmp_path), 3, 8, 6, engine_args={"dtype": "float32", "max_num_seqs": 4})
    llm = engine(case)
    model_config, model, input_ids = load_hf_baseline(case)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    # Untied: the LM head is read every step, the input embedding is not.
    assert hf_decode_bytes(model, model_config.hf_config, case) == decode_bytes(llm, case)
    tokens = hf_generate(model, input_ids, case.output_len)[:, :NUM_COMPARED]
    assert tokens.tolist() == engine_greedy(llm, case)


GQA_LLAMA3 = {
    **get_preset("llama-tiny"),
    "num_attention_heads": 8,
    "num_key_value_heads": 2,  # 4 query heads per KV head, as in Llama 3.1 8B
    "head_dim": 8,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16, "rope_type": "llama3"},
}  # fmt: skip


def test_static_loops_match_hf_eager_logits_on_a_grouped_query_llama3_shape(tmp_path):
    random_hf_checkpoint(GQA_LLAMA3, tmp_path, seed=3, dtype=torch.float32)
    case = LatencyCase(str(tmp_path), 2, 20, 5, engine_args={"dtype": "float32"})
    model_config, model, input_ids = load_hf_baseline(case)
    with torch.no_grad():
        reference = model(input_ids).logits[:, -1]  # stock HF attention, no cache
    gpt_fast = build_gpt_fast_model(model_config, input_ids.device, 2, 25)
    with torch.no_grad():
        logits = gpt_fast(input_ids, torch.arange(20))
    assert torch.allclose(logits, reference, atol=1e-4 * reference.abs().max())
    expected = hf_generate(model, input_ids, case.output_len)
    decoder = StaticCacheDecoder(model, 25, compile_backend="eager")  # registers its attention
    assert torch.equal(decoder.generate(input_ids, case.output_len), expected)
    assert torch.equal(GptFastDecoder(gpt_fast, "eager").generate(input_ids, 5), expected)


def test_applicable_baselines_skip_the_static_loops_for_a_hybrid_model_and_say_why():
    assert applicable_baselines(tiny_case()) == (["static_compiled", "gpt_fast", "hf_eager"], [])
    run, skipped = applicable_baselines(tiny_case("bamba-tiny"))
    assert run == ["hf_eager"]
    assert [s["mode"] for s in skipped] == ["static_compiled", "gpt_fast"]
    assert all("Mamba layers" in s["reason"] for s in skipped)


def test_static_loop_refuses_a_hybrid_model_with_a_clear_error():
    with pytest.raises(ValueError, match="attention-only Llama"):
        measure_static_cache_compiled(tiny_case("bamba-tiny"), compile_backend="eager")


@pytest.mark.inductor
@pytest.mark.parametrize("measure", [measure_static_cache_compiled, measure_gpt_fast])
def test_static_loops_under_reduce_overhead_inductor(llama_tiny, measure):
    case, expected, _ = llama_tiny
    case = LatencyCase(case.model, case.batch_size, case.input_len, 4, 0, 1, case.engine_args)
    result = measure(case, BANDWIDTH)
    assert result["first_output_token_ids"] == expected[0]
    assert result["compile_s"] > 0.0


def test_gpt_fast_model_in_bfloat16_keeps_float32_rotary_and_tied_weights():
    case = LatencyCase("llama-tiny", 1, 4, 2, engine_args={"dtype": "bfloat16"})
    model = build_gpt_fast_model(baseline_model_config(case), torch.device("cpu"), 1, 8)
    assert model.inv_freq.dtype == torch.float32  # rotary angles as precise as HF's
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the preset says
    assert model.lm_head.weight.dtype == torch.bfloat16


def cache_per_query_head_tensors(gqa: bool, checkpoint) -> list[tuple[int, ...]]:
    """Shapes ``(B, num_heads, max_cache_len, D)`` in the traced decode step: K or V of the whole
    static cache copied out to every query head."""
    case = LatencyCase(str(checkpoint), 2, 6, 3, engine_args={"dtype": "float32"})
    _, model, input_ids = load_hf_baseline(case)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    max_cache_len = 9
    decoder = StaticCacheDecoder(model, max_cache_len, compile_backend=record, gqa=gqa)
    decoder.reset()
    decoder.generate(input_ids, case.output_len)
    torch.compiler.reset()
    values = [node.meta.get("example_value") for gm in graphs for node in gm.graph.nodes]
    shapes = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor) and v.dim() == 4]
    heads = GQA_LLAMA3["num_attention_heads"]
    return [s for s in shapes if s[1] == heads and s[2] == max_cache_len]


def test_the_compiled_step_reads_each_kv_head_once(tmp_path):
    """HF's own SDPA path under torch.compile with a static cache's mask copies K/V out to every
    query head (``repeat_kv``) over the whole cache, each layer, each step; the registered
    grouped-query attention does not."""
    random_hf_checkpoint(GQA_LLAMA3, tmp_path, seed=3, dtype=torch.float32)
    assert cache_per_query_head_tensors(gqa=False, checkpoint=tmp_path)  # the cost, shown
    assert cache_per_query_head_tensors(gqa=True, checkpoint=tmp_path) == []


def test_flex_decode_steps_equal_the_sdpa_steps_and_both_peers_take_them(tmp_path):
    """The peers' one-token steps run ``flex_attention`` (gpt-fast's decode) and give the logits of
    SDPA over the whole masked cache, step after step; q/k/v in one matmul changes nothing."""
    random_hf_checkpoint(GQA_LLAMA3, tmp_path, seed=3, dtype=torch.float32)
    case = LatencyCase(str(tmp_path), 2, 6, 4, engine_args={"dtype": "float32"})
    model_config, model, input_ids = load_hf_baseline(case)
    max_len = 40  # more than one 128-position block is not needed: the mask offsets the query
    flex = build_gpt_fast_model(model_config, input_ids.device, 2, max_len)
    sdpa = build_gpt_fast_model(model_config, input_ids.device, 2, max_len, "sdpa", False)
    assert flex.decode_block_mask is not None and sdpa.decode_block_mask is None
    with torch.no_grad():
        flex(input_ids, torch.arange(6))
        sdpa(input_ids, torch.arange(6))
        token = input_ids[:, -1:]
        for position in range(6, 12):
            expected = sdpa(token, torch.tensor([position]))
            logits = flex(token, torch.tensor([position]))
            assert torch.allclose(logits, expected, atol=1e-5 * expected.abs().max())
            token = expected.argmax(-1, keepdim=True)

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    decoder = StaticCacheDecoder(model, max_len, compile_backend=record)
    decoder.reset()
    decoder.generate(input_ids, 3)
    GptFastDecoder(flex, compile_backend=record).generate(input_ids, 3)
    torch.compiler.reset()
    flex_calls = [
        sum("flex_attention" in str(node.target) for node in gm.graph.nodes) for gm in graphs
    ]
    layers = GQA_LLAMA3["num_hidden_layers"]
    assert flex_calls == [layers, layers]  # each peer's decode step, every layer


def test_fused_qkv_keeps_the_logits_and_makes_one_projection_matmul_per_layer(tmp_path):
    """``fuse_hf_qkv`` (what ``static_compiled`` runs): HF's logits, biases included, and in the
    compiled step one matmul for q, k and v per layer (o, gate, up and down stay: 5 per layer,
    plus the LM head), where HF makes three."""
    random_hf_checkpoint({**GQA_LLAMA3, "attention_bias": True}, tmp_path, seed=3)
    case = LatencyCase(str(tmp_path), 2, 6, 3, engine_args={"dtype": "float32"})
    _, model, input_ids = load_hf_baseline(case)
    layers = GQA_LLAMA3["num_hidden_layers"]
    assert all(layer.self_attn.k_proj.bias is not None for layer in model.model.layers)
    with torch.no_grad():
        reference = model(input_ids).logits
    assert fuse_hf_qkv(model) == layers
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(lambda ids: model(ids).logits, fullgraph=True, backend=record)
    with torch.no_grad():
        fused = step(input_ids)
        assert torch.allclose(fused, reference, atol=1e-5 * reference.abs().max())
        assert torch.allclose(model(input_ids).logits, fused)  # eager as compiled
    torch.compiler.reset()
    linears = [n for n in graphs[0].graph.nodes if n.target is torch._C._nn.linear]
    assert len(linears) == 5 * layers + 1


def test_fused_k_and_v_projections_refuse_to_run_before_q():
    model = torch.nn.Module()
    model.q_proj, model.k_proj, model.v_proj = (torch.nn.Linear(4, n) for n in (8, 4, 4))
    fuse_hf_qkv(model)
    with pytest.raises(RuntimeError, match="q_proj to be called before k_proj and v_proj"):
        model.k_proj(torch.zeros(1, 4))
    query = model.q_proj(torch.ones(1, 4))
    key, value = model.k_proj(torch.ones(1, 4)), model.v_proj(torch.ones(1, 4))
    assert (query.shape, key.shape, value.shape) == ((1, 8), (1, 4), (1, 4))
    with pytest.raises(RuntimeError, match="fuse_qkv=False"):  # v_proj emptied the holder
        model.v_proj(torch.ones(1, 4))


@pytest.mark.parametrize("measure", [measure_static_cache_compiled, measure_gpt_fast])
def test_static_loops_profile_their_decode_steps_where_the_platform_traces_activity(
    llama_tiny, measure, monkeypatch
):
    """Where the profiler records work (here the CPU's own ops stand in for device kernels), a
    static loop's device-busy time is per profiled decode step."""
    from pieceworks.benchmarks import device_busy
    from pieceworks.platforms import current_platform

    platform = type(current_platform())
    cpu_activity = torch.profiler.ProfilerActivity.CPU
    monkeypatch.setattr(platform, "profiler_activity", lambda self: cpu_activity)
    monkeypatch.setattr(device_busy, "DEVICE_EVENT_CATEGORIES", ("cpu_op",))
    case, _, _ = llama_tiny
    result = measure(case, BANDWIDTH, compile_backend="eager")
    assert result["device_busy_ms"] > 0
    steps = min(device_busy.NUM_PROFILED_STEPS, case.output_len - 1)
    assert result["device_busy_note"].startswith(f"{steps} decode steps profiled")
