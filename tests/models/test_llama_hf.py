"""Llama logits equal HF transformers' on the same saved checkpoint (float32, CPU).

Prefill, prefill followed by decode steps, and a mixed batch (one request decoding while another
prefills, and a chunked prefill); GQA, llama3 rope scaling and tied embeddings among the configs;
compile levels 0 and 3. Tolerance (SPEC §4): max |diff| <= 1e-4 * max |HF logit|.
Run: pytest tests/models/test_llama_hf.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint
from pieceworks.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "gqa-llama3-rope": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mha-tied": {
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
        "rope_scaling": None,
    },
}


def checkpoint(tmp_path_factory, name: str) -> str:
    hf_config = {**get_preset("llama-tiny"), **CONFIGS[name]}
    path = tmp_path_factory.mktemp(name)
    random_hf_checkpoint(hf_config, path, seed=1, dtype=torch.float32)
    return str(path)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    path = checkpoint(tmp_path_factory, request.param)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return path, hf_model, request.param


def hf_last_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


def assert_close_to_hf(
    logits: torch.Tensor, reference: torch.Tensor, tolerance: float = 1e-4
) -> None:
    scale = reference.abs().max()
    error = (logits - reference).abs().max()
    assert error <= tolerance * scale, f"max abs diff {error:.3e} vs logit scale {scale:.3e}"


def run_and_compare(
    llm: LLM, hf_model, prompts: list[list[int]], steps: int, late_prompts: list[list[int]] = ()
) -> int:
    """Drive the engine step by step; compare every produced logit row with HF's."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    compared, pending = 0, list(late_prompts)
    while engine.has_unfinished_requests():
        output = engine.scheduler.schedule()
        logits = engine.runner.compute_logits(output)
        producing = [s.request for s in output.scheduled_requests if s.produces_token]
        for row, request in enumerate(producing):
            reference = hf_last_logits(hf_model, request.all_token_ids)
            assert_close_to_hf(logits[row].cpu(), reference)
            compared += 1
        sampled = logits.argmax(dim=-1).tolist() if logits is not None else []
        engine.scheduler.update_from_output(output, sampled)
        if pending:  # a new prompt arrives while the others decode: the next step is mixed
            engine.add_request(pending.pop(), params)
    return compared


@pytest.mark.parametrize("level", [0, 3])
def test_prefill_decode_and_mixed_batches_match_hf(saved, level):
    path, hf_model, _ = saved
    llm = LLM(
        path,
        compilation_config={"level": level, "backend": "eager"},
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=24,
    )
    generator = torch.Generator().manual_seed(level)
    prompt = lambda n: torch.randint(0, 256, (n,), generator=generator).tolist()  # noqa: E731
    # Prompts of 5 and 11 tokens prefill together, then decode; a 30-token prompt arrives later
    # and is chunked by the 24-token budget while the first two decode (mixed batches).
    compared = run_and_compare(
        llm, hf_model, [prompt(5), prompt(11)], steps=4, late_prompts=[prompt(30)]
    )
    assert compared == 3 * 4  # every produced token of every request was checked


def test_hf_really_uses_llama3_rope_scaling(saved):
    _, hf_model, name = saved
    expected = "llama3" if CONFIGS[name]["rope_scaling"] else "default"
    assert hf_model.model.rotary_emb.rope_type == expected
