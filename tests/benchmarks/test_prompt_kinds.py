"""``bench latency --prompt-kind``: the prompts, one engine for several kinds, the rows' fields.

- ``random`` is the seeded random ids the bench always used; ``repeat`` is a random passage of
  ``input_len // 4`` tokens repeated to ``input_len``; ``copy`` is the passage and the
  instruction to repeat it in the chat template (SmolLM2's tokenizer, when installed) or after
  the tokenizer's special tokens, cut or repeated to exactly ``input_len`` tokens;
- ``copy`` on a model without a tokenizer, an unknown kind, or an input too short for the
  template are refused naming the option, before any engine is built;
- ``--prompt-kind repeat,random`` with ``--speculative-config`` builds one engine and gives a row
  per kind: its prompt kind, output tokens per second (batch x output_len / median latency), the
  acceptance of its own runs, a label naming speculation and kind in the table and the plot;
- peers run once per kind; the speculative table pairs each speculative row with the run
  without speculation of the same configuration and kind.

Run: PIECEWORKS_PLATFORM=cpu pytest tests/benchmarks/test_prompt_kinds.py
"""

from __future__ import annotations

import json
import random

import pytest

from pieceworks.benchmarks import latency
from pieceworks.benchmarks.prompts import (
    INSTRUCTION,
    PASSAGE,
    latency_prompts,
    parse_prompt_kinds,
)
from pieceworks.benchmarks.report import format_performance_table, row_label
from pieceworks.benchmarks.spec_report import format_speculative_table
from pieceworks.entrypoints import bench
from pieceworks.entrypoints.cli import main

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'
TINY = ["--model", "llama-tiny", "--enforce-eager", "--batch-size", "1", "--input-len", "16",
        "--output-len", "12", "--num-iters-warmup", "0", "--num-iters", "1",
        "--dtype", "float32"]  # fmt: skip


class CharTokenizer:
    """One id per character (mod 256), a BOS of 1 with special tokens, no chat template."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [ord(char) % 256 for char in text]


def test_random_prompts_are_the_seeded_ids_of_before():
    rng = random.Random(0)
    expected = [[rng.randrange(256) for _ in range(10)] for _ in range(3)]
    assert latency_prompts("random", 3, 10, 256) == expected


def test_repeat_prompts_repeat_a_quarter_of_the_input():
    prompts = latency_prompts("repeat", 2, 18, 1000)
    assert [len(p) for p in prompts] == [18, 18]
    for prompt in prompts:  # period 18 // 4 = 4
        assert prompt == (prompt[:4] * 5)[:18]
    assert prompts[0] != prompts[1]


def test_copy_prompt_without_a_chat_template_is_passage_then_instruction():
    tokenizer = CharTokenizer()
    suffix = tokenizer.encode(f"\n\n{INSTRUCTION}\n\n", add_special_tokens=False)
    passage = tokenizer.encode(PASSAGE, add_special_tokens=False)
    (short,) = latency_prompts("copy", 1, 100, 256, tokenizer)
    assert short == [1] + passage[: 100 - 1 - len(suffix)] + suffix  # the passage cut
    long = latency_prompts("copy", 2, 4000, 256, tokenizer)
    assert long[0] == long[1] and len(long[0]) == 4000
    assert long[0][1 : 1 + 2 * len(passage)] == passage * 2  # the passage repeated to fill
    with pytest.raises(ValueError, match="--input-len 40 leaves no room"):
        latency_prompts("copy", 1, 40, 256, tokenizer)


def test_copy_prompt_uses_the_chat_template():
    from pieceworks.models.loading import sources

    if not sources.is_smollm2_installed():
        pytest.skip(f"needs the trained model: {sources.SMOLLM2_INSTALL_COMMAND}")
    case = latency.LatencyCase(sources.SMOLLM2_NAME, 1, 200, 8, prompt_kind="copy")
    (prompt,) = latency._prompts(case, 49152)
    assert len(prompt) == 200
    from pieceworks.engine.tokenizer import load_tokenizer

    text = load_tokenizer(sources.SMOLLM2_NAME).decode(prompt)
    assert text.startswith("<|im_start|>") and "Alice was beginning to get very tired" in text
    assert text.endswith(f"{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_kinds_and_copy_without_a_tokenizer_are_refused(capsys, monkeypatch):
    assert parse_prompt_kinds("repeat, random,repeat") == ["repeat", "random"]
    with pytest.raises(ValueError, match="--prompt-kind 'lorem': unknown kind"):
        parse_prompt_kinds("lorem")
    monkeypatch.setattr(latency, "measure_mode", pytest.fail)  # never reached
    assert main(["bench", "latency", *TINY, "--prompt-kind", "random,copy"]) == 2
    assert "--prompt-kind copy needs a model with a tokenizer" in capsys.readouterr().err


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """bench latency JSON of repeat and random prompts, without and with n-gram speculation,
    and the number of engines each built."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(latency, "measure_copy_bandwidth", lambda *args, **kwargs: 1e9)
    built: list[str] = []
    monkeypatch.setattr(latency, "LLM", lambda *a, **k: built.append(a[0]) or llm_class(*a, **k))
    payloads = {}
    for name, flags in (("plain", []), ("ngram", ["--speculative-config", SPEC])):
        path = tmp_path_factory.mktemp(name) / "bench.json"
        built.clear()
        flags += ["--prompt-kind", "repeat,random", "--output-json", str(path)]
        flags += ["--plot", str(path.with_suffix(".png"))]
        assert main(["bench", "latency", *TINY, *flags]) == 0
        payloads[name] = {**json.loads(path.read_text()), "engines": len(built)}
    monkeypatch.undo()
    return payloads


llm_class = latency.LLM


def test_one_engine_measures_every_kind_and_rows_carry_kind_and_rate(runs):
    for payload in runs.values():
        assert payload["engines"] == 1 and payload["prompt_kinds"] == ["repeat", "random"]
        assert "--prompt-kind repeat,random" in payload["command"]
        rows = payload["results"]
        assert [(r["mode"], r["prompt_kind"]) for r in rows] == [("eager", "repeat")] + [
            ("eager", "random")
        ]
        for r in rows:
            assert r["output_tokens_per_s"] == pytest.approx(1 * 12 / r["latency_s"]["median"])
    assert all("speculative" not in r for r in runs["plain"]["results"])


def test_speculative_rows_count_their_own_kind_and_keep_the_tokens(runs):
    for plain, spec in zip(runs["plain"]["results"], runs["ngram"]["results"], strict=True):
        assert spec["first_output_token_ids"] == plain["first_output_token_ids"]
        stats = spec["speculative"]
        assert (stats["method"], stats["num_speculative_tokens"]) == ("ngram", 4)
        # This kind's runs alone: one generation (no warm-up, no profile on the CPU), whose 11
        # decode tokens each verify produced (its accepted proposals and the target's token).
        assert stats["num_drafts"] > 0
        assert stats["num_drafts"] + stats["num_accepted_tokens"] <= 11
        assert 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert [row_label(r) for r in runs["ngram"]["results"]] == [
        "eager, ngram k=4, repeat",
        "eager, ngram k=4",
    ]


def test_labels_reach_the_table_the_plot_and_the_performance_table(runs, tmp_path):
    table = format_performance_table([runs["plain"], runs["ngram"]])
    modes = [line.split(" | ")[3] for line in table.splitlines()[2:]]
    assert modes == [
        "eager, repeat (level 0, NONE)",
        "eager (level 0, NONE)",
        "eager, ngram k=4, repeat (level 0, NONE)",
        "eager, ngram k=4 (level 0, NONE)",
    ]
    pytest.importorskip("matplotlib")
    from pieceworks.benchmarks.report import plot_latency

    path = tmp_path / "labels.png"
    assert plot_latency(path, runs["ngram"]["results"], "ngram") and path.stat().st_size > 0


def test_the_speculative_table_pairs_each_row_with_its_plain_run(runs):
    lines = format_speculative_table([runs["plain"], runs["ngram"]]).splitlines()
    assert lines[0].startswith("| model | dtype | batch | mode | prompt kind | speculation |")
    cells = [line.split(" | ") for line in lines[2:]]
    assert [(c[4], c[5]) for c in cells] == [("repeat", "ngram k=4"), ("random", "ngram k=4")]
    for cell, spec, plain in zip(cells, runs["ngram"]["results"], runs["plain"]["results"]):
        ratio = spec["output_tokens_per_s"] / plain["output_tokens_per_s"]
        assert cell[7] == f"{ratio:.2f}"
    assert format_speculative_table([runs["plain"]]) == ""


def test_peers_run_once_per_kind_on_that_kinds_prompts(monkeypatch):
    from pieceworks.benchmarks import baselines

    seen = []

    def fake_peer(case, bandwidth):
        seen.append((case.prompt_kind, latency._prompts(case, 256)[0][:4]))
        return {"mode": "hf_eager", "status": "ok", "latency_s": {"median": 0.5}}

    monkeypatch.setitem(baselines.BASELINES, "hf_eager", fake_peer)
    case = latency.LatencyCase("llama-tiny", 2, 8, 10)
    rows = list(bench.measure_rows(case, [], ["hf_eager"], 1e9, ["repeat", "random"]))
    assert [(r["prompt_kind"], r["output_tokens_per_s"]) for r in rows] == [
        ("repeat", 2 * 10 / 0.5),
        ("random", 2 * 10 / 0.5),
    ]
    assert [kind for kind, _ in seen] == ["repeat", "random"]
    assert seen[0][1] != seen[1][1]
