"""Inputs that used to fail deep inside a library now fail at once, with one clear message.

Proves: a chat template that does not render (a Jinja syntax error, or a template's own
``raise_exception``) is a ``ValueError`` naming the template; OpenAI's list of content parts is
accepted when every part is text (joined by newlines, as vLLM does) and refused naming the type
otherwise; a lone surrogate in a text prompt or a chat message is a ``ValueError`` naming where;
garbage tokenizer files are a ``ValueError`` naming the directory and the files; an Inductor cache
directory that cannot be written is refused before compiling, naming ``TORCHINDUCTOR_CACHE_DIR``;
the server refuses a lone surrogate anywhere in a body with a 400 naming the field.
The tokenizer is the byte-level stand-in of ``test_llm_chat``; llama-tiny, eager, float32.
Run: pytest tests/engine/test_bad_inputs.py
"""

from __future__ import annotations

import json

import pytest

from pieceworks.core.compiler_interface import check_inductor_cache_dir
from pieceworks.engine import tokenizer as tokenizer_module
from pieceworks.engine.llm import LLM
from pieceworks.engine.tokenizer import gguf_tokenizer, load_tokenizer
from pieceworks.sampling_params import SamplingParams
from tests.engine.test_llm_chat import METADATA, ids

pytest.importorskip("transformers")

PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
SIMPLE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(tokenizer_module, "gguf_tokenizer_metadata", lambda path: METADATA)
        tokenizer = gguf_tokenizer("models/tiny.gguf")
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llm(tokenizer_dir):
    return LLM("llama-tiny", enforce_eager=True, dtype="float32", max_num_seqs=2,
               tokenizer=str(tokenizer_dir))  # fmt: skip


@pytest.mark.parametrize(
    "template, reason",
    [
        ("{% for m in messages %}{{ m['content'] }", "TemplateSyntaxError"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ],
)
def test_a_template_that_does_not_render_is_a_value_error_naming_it(llm, template, reason):
    with pytest.raises(ValueError, match="the chat_template given does not render") as error:
        llm.chat([{"role": "user", "content": "Hi"}], PARAMS, chat_template=template)
    assert reason in str(error.value)
    assert not llm.engine.has_unfinished_requests()


def test_text_content_parts_are_joined(llm):
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    [output] = llm.chat([{"role": "user", "content": parts}], PARAMS, chat_template=SIMPLE)
    assert output.prompt_token_ids == ids("user: Hi\nthere\n")


def test_a_non_text_content_part_is_refused_naming_its_type(llm):
    parts = [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(ValueError, match="message 0: content part of type 'image_url'"):
        llm.chat([{"role": "user", "content": parts}], PARAMS, chat_template=SIMPLE)


def test_a_lone_surrogate_is_refused_naming_where(llm):
    with pytest.raises(ValueError, match=r"prompt 1 is not valid Unicode.*position 2"):
        llm.generate(["fine", "ab\ud800"], PARAMS)
    with pytest.raises(ValueError, match=r"message 0 is not valid Unicode"):
        llm.chat([{"role": "user", "content": "\ud800"}], PARAMS)
    assert not llm.engine.has_unfinished_requests()


def test_garbage_tokenizer_files_name_the_directory(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{ this is not json")
    with pytest.raises(ValueError, match=r"tokenizer files \(tokenizer.json\) do not load"):
        load_tokenizer(str(tmp_path))


def test_an_unwritable_inductor_cache_dir_is_refused(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(ValueError, match="not writable.*TORCHINDUCTOR_CACHE_DIR"):
        check_inductor_cache_dir()


def test_the_server_refuses_a_lone_surrogate_naming_the_field():
    pytest.importorskip("fastapi")
    from pieceworks.entrypoints.serve.errors import APIError
    from pieceworks.entrypoints.serve.protocol import ChatCompletionRequest
    from pieceworks.entrypoints.serve.validation import parse_body

    body = {"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}
    raw = json.dumps(body).encode()  # "\\ud800" in the JSON text, valid UTF-8 bytes
    with pytest.raises(APIError, match="lone surrogate") as error:
        parse_body(raw, ChatCompletionRequest)
    assert error.value.param == "messages.0.content"
