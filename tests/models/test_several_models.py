"""Several models built in one process each trace as if they were alone.

Three differently shaped Llamas (hidden size, head count and dim, KV heads, ``rms_norm_eps``) and a
Bamba are built one after another at level 3 in one process, then the first Llama's shape again.
Proves: each gives HF transformers' logits (prefill and decode); Dynamo marks nothing dynamic
"from automatic dynamic" (its per-code-object state would otherwise turn ``q_size``, ``num_heads``
or ``variance_epsilon`` of the second model into symbols); every input of every traced graph is a
parameter, a buffer or derived from ``input_ids`` / ``positions``; the first shape built again
traces the very graph it traced first; with Inductor and the compile cache on, building a shape
again after another shape loads its artifacts without the cache-key self-check warning.
Run: pytest tests/models/test_several_models.py
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from pieceworks.core.counters import compilation_counter
from pieceworks.core.decorators import piecewise_backends
from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint
from tests.models.test_bamba_hf import make_hf_model
from tests.models.test_llama_hf import run_and_compare

transformers = pytest.importorskip("transformers")

LLAMA_SHAPES = {
    "tiny": {},
    "wide": {
        "hidden_size": 96,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "intermediate_size": 192,
        "rms_norm_eps": 1e-6,
    },
    "mha-head32": {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 160,
    },
}
# The order models are built in: the first shape again at the end.
BUILD_ORDER = ["tiny", "wide", "mha-head32", "bamba", "tiny-again"]
# Graph inputs that are not model constants: weights, buffers and the token dimension.
ALLOWED_INPUT = re.compile(r"_parameters|_buffers|\['input_ids'\]|\['positions'\]")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _llama_checkpoint(tmp_path_factory, name: str) -> tuple[str, object]:
    hf_config = {**get_preset("llama-tiny"), **LLAMA_SHAPES[name], "tie_word_embeddings": False}
    path = tmp_path_factory.mktemp(name)
    random_hf_checkpoint(hf_config, path, seed=3, dtype=torch.float32)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return str(path), hf_model


def _build(path: str, backend: str = "eager") -> LLM:
    return LLM(
        path,
        compilation_config={"level": 3, "backend": backend},
        dtype="float32",
        max_num_seqs=2,
        max_num_batched_tokens=32,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``{name: (llm, hf_model)}`` in BUILD_ORDER, and what Dynamo logged meanwhile."""
    checkpoints = {name: _llama_checkpoint(tmp_path_factory, name) for name in LLAMA_SHAPES}
    checkpoints["bamba"] = make_hf_model(tmp_path_factory.mktemp("bamba"))
    checkpoints["tiny-again"] = checkpoints["tiny"]
    dynamo_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    records, old_level = _Records(), dynamo_log.level
    dynamo_log.addHandler(records)
    dynamo_log.setLevel(logging.INFO)
    try:
        models = {}
        for name in BUILD_ORDER:
            path, hf_model = checkpoints[name]
            models[name] = (_build(path), hf_model)
    finally:
        dynamo_log.removeHandler(records)
        dynamo_log.setLevel(old_level)
    return models, records.messages


def _traced_graph(llm: LLM) -> torch.fx.GraphModule:
    (backend,) = piecewise_backends(llm.engine.runner.model)
    assert backend.split_gm is not None
    return backend.split_gm


@pytest.mark.parametrize("name", BUILD_ORDER)
def test_each_model_gives_hf_logits(built, name):
    models, _ = built
    llm, hf_model = models[name]
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (3, 9)]
    assert run_and_compare(llm, hf_model, prompts, steps=3) == 2 * 3


def test_dynamo_marks_nothing_dynamic_automatically(built):
    _, messages = built
    automatic = [m for m in messages if "automatic dynamic" in m]
    assert automatic == []
    # The log was really captured: the declared token dims were marked, once per model.
    declared = [m for m in messages if "from mark_dynamic" in m]
    assert len(declared) == 2 * len(BUILD_ORDER)  # input_ids and positions


@pytest.mark.parametrize("name", BUILD_ORDER)
def test_graph_inputs_are_weights_buffers_or_token_dims(built, name):
    models, _ = built
    sources = []
    for node in _traced_graph(models[name][0]).graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        sources.append(grapharg.source.name if grapharg is not None else node.name)
    leaked = [source for source in sources if not ALLOWED_INPUT.search(source)]
    assert leaked == []


def test_a_shape_built_again_traces_the_graph_it_traced_alone(built):
    models, _ = built
    first = _traced_graph(models["tiny"][0]).print_readable(print_output=False)
    again = _traced_graph(models["tiny-again"][0]).print_readable(print_output=False)
    assert again == first


@pytest.mark.inductor
def test_cache_key_self_check_stays_quiet_across_shapes(tmp_path_factory, monkeypatch, caplog):
    """Inductor with the cache on: tiny, wide, tiny. The second tiny finds its own entries."""
    # Start from an empty per-code Dynamo state, as a fresh process does, whatever ran before.
    torch._dynamo.reset()
    monkeypatch.setenv("PIECEWORKS_DISABLE_COMPILE_CACHE", "0")
    monkeypatch.setenv("PIECEWORKS_CACHE_ROOT", str(tmp_path_factory.mktemp("cache")))
    tiny, _ = _llama_checkpoint(tmp_path_factory, "tiny")
    wide, _ = _llama_checkpoint(tmp_path_factory, "wide")
    warnings = _Records()
    cache_log = logging.getLogger("pieceworks.core.cache.compile_cache")
    cache_log.addHandler(warnings)
    try:
        _build(tiny, "inductor")
        _build(wide, "inductor")
        loaded_before = compilation_counter.num_compiled_artifacts_loaded
        _build(tiny, "inductor")
    finally:
        cache_log.removeHandler(warnings)
    assert [m for m in warnings.messages if "missed a change" in m] == []
    assert compilation_counter.num_compiled_artifacts_loaded > loaded_before
