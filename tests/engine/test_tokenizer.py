"""The byte-level BPE tokenizer built from GGUF ``tokenizer.*`` metadata, on a hand-written
metadata dict (no file is read, nothing is downloaded).

Proves: merges apply and text splits as ``tokenizer.ggml.pre`` says (no prefix space); a token
spelled in the byte alphabet keeps its spelling and one spelled in raw text is respelled in it;
control tokens match whole and are skipped by ``skip_special_tokens``, user-defined ones match
whole and stay text; the bos, eos, unk and pad tokens come from their ``*_token_id`` keys and
an id outside the vocabulary is ignored; the bos token is prepended (once per sequence of a
pair) only when ``add_bos_token`` is true and there is one; a chat prompt is rendered by the
template and encoded without a second BOS; a given template wins over the tokenizer's, the
generation prompt can be left out, and chat without a tokenizer, or without any template, is
refused with the whole message; an invalid template is jinja's syntax error; a GGUF file without
a vocabulary is refused with the whole message; a vocabulary that is not byte-level BPE goes to
transformers' converter with the file's directory and name; ``LLM`` uses the tokenizer its
``tokenizer`` argument names (here a preset, which has none of its own), and refuses one with
more tokens than the model's vocabulary.
Run: pytest tests/engine/test_tokenizer.py
"""

from __future__ import annotations

import pytest

from pieceworks.engine import tokenizer as tokenizer_module
from pieceworks.engine.tokenizer import apply_chat_template, bytes_to_unicode, gguf_tokenizer

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ALPHABET = list(bytes_to_unicode().values())
EVERY_CHARACTER = "".join(ALPHABET)  # a token spelled with the whole byte alphabet
TOKENS = [*SPECIALS, *ALPHABET, "he", "ll", "hell", "<think>", " the", EVERY_CHARACTER]
# llama.cpp's token types: 3 control, 1 normal, 4 user-defined.
TOKEN_TYPES = [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS))
TOKEN_TYPES[TOKENS.index("<think>")] = 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
METADATA = {
    "ggml.model": "gpt2",
    "ggml.pre": "smollm",
    "ggml.tokens": TOKENS,
    "ggml.token_type": TOKEN_TYPES,
    "ggml.merges": ["h e", "l l", "he ll"],
    "ggml.bos_token_id": 1,
    "ggml.eos_token_id": 2,
    "ggml.unknown_token_id": 0,
    "ggml.add_bos_token": True,
    "chat_template": CHAT_TEMPLATE,
}


def ids(text: str) -> list[int]:
    """The byte tokens of ``text``, one a byte (no merge applies)."""
    return [TOKENS.index(bytes_to_unicode()[byte]) for byte in text.encode()]


def build(monkeypatch, metadata: dict):
    """The tokenizer of ``metadata``; transformers' converter must not be reached."""
    from transformers import AutoTokenizer

    def no_converter(*args, **kwargs):
        raise AssertionError("a byte-level BPE vocabulary is built here, not by transformers")

    monkeypatch.setattr(tokenizer_module, "gguf_tokenizer_metadata", lambda path: metadata)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_converter)
    built = gguf_tokenizer("models/tiny.gguf")
    monkeypatch.undo()
    return built


@pytest.fixture
def tokenizer(monkeypatch):
    return build(monkeypatch, METADATA)


def test_merges_and_the_split_without_a_prefix_space(tokenizer):
    hell, bos = TOKENS.index("hell"), TOKENS.index("<|im_start|>")
    assert tokenizer.encode("hello 12") == [bos, hell, *ids("o"), *ids(" "), *ids("12")]
    assert tokenizer.decode(tokenizer.encode("hello 12"), skip_special_tokens=True) == "hello 12"


def test_tokens_keep_or_take_the_byte_alphabet_spelling(tokenizer):
    vocab = tokenizer.get_vocab()
    assert vocab[EVERY_CHARACTER] == TOKENS.index(EVERY_CHARACTER)  # already in the alphabet
    assert vocab["Ġthe"] == TOKENS.index(" the")  # raw text, respelled byte by byte
    assert vocab["hell"] == TOKENS.index("hell")


def test_control_and_user_defined_tokens_match_whole(tokenizer):
    think, im_end = TOKENS.index("<think>"), TOKENS.index("<|im_end|>")
    token_ids = tokenizer.encode("<think>he<|im_end|>", add_special_tokens=False)
    assert token_ids == [think, TOKENS.index("he"), im_end]
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == "<think>he"


def test_a_control_token_that_names_no_special_role_still_matches_whole(monkeypatch):
    # <|tool|> is neither BOS, EOS, UNK nor PAD: only its control type makes it one token.
    tokens, types = [*TOKENS, "<|tool|>"], [*TOKEN_TYPES, 3]
    built = build(monkeypatch, {**METADATA, "ggml.tokens": tokens, "ggml.token_type": types})
    he, tool = TOKENS.index("he"), tokens.index("<|tool|>")
    token_ids = built.encode("he<|tool|>he", add_special_tokens=False)
    assert token_ids == [he, tool, he]
    assert built.decode(token_ids) == "he<|tool|>he"
    assert built.decode(token_ids, skip_special_tokens=True) == "hehe"


def test_special_tokens_come_from_their_id_keys(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.unk_token == "<|endoftext|>"
    assert tokenizer.pad_token is None  # no ggml.padding_token_id


def test_a_chat_prompt_is_encoded_without_a_second_bos(tokenizer):
    im_start, im_end = TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>")
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
    assert prompt == [
        im_start, *ids("user\nhi"), im_end, *ids("\n"), im_start, *ids("assistant\n")
    ]  # fmt: skip


def test_special_token_ids_outside_the_vocabulary_are_ignored(monkeypatch):
    last = len(TOKENS) - 1
    ids_out_of_range = {"ggml.bos_token_id": len(TOKENS), "ggml.eos_token_id": -1,
                        "ggml.padding_token_id": last}  # fmt: skip
    built = build(monkeypatch, {**METADATA, **ids_out_of_range})
    assert (built.bos_token, built.eos_token) == (None, None)
    assert built.pad_token == TOKENS[last] and built.pad_token_id == last
    # add_bos_token without a bos token in the vocabulary: nothing is prepended
    assert built.encode("he") == [TOKENS.index("he")]


def test_the_bos_token_is_prepended_only_when_add_bos_token_says(monkeypatch, tokenizer):
    he, ll, bos = TOKENS.index("he"), TOKENS.index("ll"), TOKENS.index("<|im_start|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (bos, TOKENS.index("<|im_end|>"))
    assert tokenizer.encode("he") == [bos, he]
    assert tokenizer.encode("he", "ll") == [bos, he, bos, ll]  # a pair: one bos before each
    assert tokenizer.encode("he", add_special_tokens=False) == [he]
    for add_bos in ({"ggml.add_bos_token": False}, {}):
        metadata = {key: value for key, value in METADATA.items() if key != "ggml.add_bos_token"}
        built = build(monkeypatch, {**metadata, **add_bos})
        assert built.bos_token_id == bos and built.encode("he") == [he]


def test_chat_without_a_tokenizer_is_refused_with_the_whole_message():
    with pytest.raises(ValueError) as error:
        apply_chat_template(None, [{"role": "user", "content": "hi"}])
    assert str(error.value) == (
        "chat needs a tokenizer with a chat template; this model has no tokenizer (presets have "
        "random weights): use a model directory or GGUF file with one"
    )


def test_a_tokenizer_without_a_template_needs_one_given(monkeypatch):
    without = {key: value for key, value in METADATA.items() if key != "chat_template"}
    built = build(monkeypatch, without)
    assert built.chat_template is None
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError) as error:
        apply_chat_template(built, conversation)
    assert str(error.value) == (
        "this model's tokenizer has no chat template; pass chat_template=<jinja text> or use "
        "generate() with plain prompts"
    )
    im_start = TOKENS.index("<|im_start|>")
    prompt = apply_chat_template(built, conversation, chat_template=CHAT_TEMPLATE)
    assert prompt == [im_start, *ids("user\nhi"), TOKENS.index("<|im_end|>"), *ids("\n"),
                      im_start, *ids("assistant\n")]  # fmt: skip


@pytest.mark.parametrize("template", ["", "  \n"])
def test_an_empty_template_is_refused_rather_than_rendering_an_empty_prompt(monkeypatch, template):
    built = build(monkeypatch, METADATA)  # its own template would render; the empty one wins
    with pytest.raises(ValueError) as error:
        apply_chat_template(built, [{"role": "user", "content": "hi"}], chat_template=template)
    assert str(error.value) == (
        "chat_template is empty; pass the Jinja text of a template, or leave it out to use the "
        "tokenizer's own"
    )


def test_a_given_template_wins_and_the_generation_prompt_can_be_left_out(tokenizer):
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    own = "{% for m in messages %}{{ m['content'] }};{% endfor %}"
    own += "{% if add_generation_prompt %}>{% endif %}"
    assert apply_chat_template(tokenizer, conversation, own) == ids("hi;ok;>")
    no_prompt = apply_chat_template(tokenizer, conversation, own, add_generation_prompt=False)
    assert no_prompt == ids("hi;ok;")
    im_start, im_end = TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>")
    prompt = apply_chat_template(tokenizer, conversation, add_generation_prompt=False)
    assert prompt == [im_start, *ids("user\nhi"), im_end, *ids("\n"),
                      im_start, *ids("assistant\nok"), im_end, *ids("\n")]  # fmt: skip


def test_an_invalid_template_is_refused_by_jinja(tokenizer):
    from jinja2 import TemplateSyntaxError

    unclosed = "{% for m in messages %}{{ m['content'] }}"
    with pytest.raises(
        ValueError, match="TemplateSyntaxError: Unexpected end of template"
    ) as error:
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}], unclosed)
    assert isinstance(error.value.__cause__, TemplateSyntaxError)  # Jinja's own error, chained


def test_a_gguf_file_without_a_vocabulary_is_refused_with_the_whole_message(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "gguf_tokenizer_metadata", lambda path: {"ggml.pre": ""})
    with pytest.raises(ValueError) as error:
        gguf_tokenizer("models/tiny.gguf")
    assert str(error.value) == (
        "models/tiny.gguf: the GGUF file has no tokenizer (no tokenizer.ggml.tokens metadata); "
        "pass token-id prompts, or a tokenizer with tokenizer=<HF dir or .gguf file>"
    )


def test_another_vocabulary_goes_to_the_transformers_converter(monkeypatch):
    from transformers import AutoTokenizer

    calls = []
    monkeypatch.setattr(
        tokenizer_module,
        "gguf_tokenizer_metadata",
        lambda path: {**METADATA, "ggml.model": "llama"},
    )
    monkeypatch.setattr(tokenizer_module, "gguf_architecture_name", lambda path: "llama")
    monkeypatch.setattr(
        AutoTokenizer, "from_pretrained", lambda *args, **kwargs: calls.append((args, kwargs))
    )
    gguf_tokenizer("models/tiny.gguf")
    assert calls == [(("models",), {"gguf_file": "tiny.gguf"})]


def test_llm_takes_the_tokenizer_of_its_tokenizer_argument(tokenizer, tmp_path, monkeypatch):
    from pieceworks.engine.llm import LLM
    from pieceworks.models.loading import presets

    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"has {len(tokenizer)} tokens, more than the model's"):
        LLM("llama-tiny", compilation_config={"level": 0}, tokenizer=str(tmp_path))
    # the same tiny model with room for every token id of the tokenizer
    monkeypatch.setitem(
        presets.PRESETS, "llama-tiny-512", {**presets.PRESETS["llama-tiny"], "vocab_size": 512}
    )
    llm = LLM("llama-tiny-512", compilation_config={"level": 0}, max_num_seqs=2,
              tokenizer=str(tmp_path))  # fmt: skip
    assert llm.tokenizer.get_vocab() == tokenizer.get_vocab()
    assert llm.tokenizer.chat_template == CHAT_TEMPLATE


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused():
    from pieceworks.engine.tokenizer import check_tokenizer_fits

    class Tokens(list):  # len() is all the check reads
        pass

    check_tokenizer_fits(Tokens(range(256)), 256, "tok")  # the same size
    check_tokenizer_fits(Tokens(range(300)), 256, None)  # the model's own: a padded embedding
    with pytest.raises(ValueError, match="'tok' has 300 tokens, more than the model's vocabulary"):
        check_tokenizer_fits(Tokens(range(300)), 256, "tok")
