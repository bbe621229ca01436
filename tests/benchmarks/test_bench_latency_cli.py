"""``bench latency`` says what it measured and never loses a result.

- ``--compare`` on a hybrid model (``bamba-tiny``) runs the hf_eager peer, lists the static loops
  as skipped with the reason, in the printed notes and in the JSON;
- a mode that raises becomes a failed row with its error; the other rows and the JSON survive;
- each row states its effective level and graph mode; on the CPU (no static graphs) modes that
  resolve to the same configuration run once, under the first name, the others named beside it;
- ``--num-scheduler-steps`` reaches the engine (the same tokens, the same count of decode
  steps) and is recorded in the JSON, its rows and the printed header;
- ``--enforce-eager`` and ``-O`` are honoured, and a ``--modes`` entry that contradicts them is an
  error before any engine is built.

The copy bandwidth is a fixed number here (measuring it costs seconds and is not under test).
Run: pytest tests/benchmarks/test_bench_latency_cli.py
"""

from __future__ import annotations

import json

import pytest
import torch

from pieceworks.benchmarks import latency
from pieceworks.entrypoints import bench
from pieceworks.entrypoints.cli import main

TINY = ["--batch-size", "1", "--input-len", "4", "--output-len", "3", "--num-iters-warmup", "0",
        "--num-iters", "1", "--dtype", "float32"]  # fmt: skip
EAGER_BACKEND = ["--compilation-config", '{"backend": "eager"}']


@pytest.fixture(autouse=True)
def _fixed_bandwidth(monkeypatch):
    monkeypatch.setattr(latency, "measure_copy_bandwidth", lambda *args, **kwargs: 1e9)


def bench_latency(tmp_path, *flags: str) -> tuple[int, dict]:
    path = tmp_path / "bench.json"
    code = main(["bench", "latency", *TINY, *flags, "--output-json", str(path)])
    return code, json.loads(path.read_text())


def test_compare_on_a_hybrid_model_runs_hf_eager_and_says_what_it_skipped(tmp_path, capsys):
    pytest.importorskip("transformers")
    code, payload = bench_latency(
        tmp_path, "--model", "bamba-tiny", "--modes", "eager", "--compare"
    )
    assert code == 0
    assert [(r["mode"], r["status"]) for r in payload["results"]] == [
        ("eager", "ok"),
        ("hf_eager", "ok"),
    ]
    skipped = {s["mode"]: s["reason"] for s in payload["skipped"]}
    assert set(skipped) == {"static_compiled", "gpt_fast"}
    assert "Mamba layers" in skipped["static_compiled"]
    out = capsys.readouterr().out
    assert "skipped static_compiled: needs an attention-only Llama" in out
    assert payload["command"].startswith("pieceworks bench latency ")
    assert "--compare" in payload["command"] and "--model bamba-tiny" in payload["command"]
    assert {"dtype", "device", "versions", "commit", "date"} <= set(payload)


def test_a_failing_mode_is_reported_in_its_row_and_the_rest_complete(tmp_path, monkeypatch):
    measure_mode = latency.measure_mode

    def flaky(case, plan, bandwidth=None, **kwargs):
        if plan.name == "eager":
            raise RuntimeError("out of device memory (simulated)")
        return measure_mode(case, plan, bandwidth, **kwargs)

    monkeypatch.setattr(latency, "measure_mode", flaky)
    code, payload = bench_latency(
        tmp_path, "--model", "llama-tiny", "--modes", "eager,compiled", *EAGER_BACKEND
    )
    assert code == 1  # something failed, and the exit status says so
    failed, measured = payload["results"]
    assert failed["status"] == "failed" and "simulated" in failed["error"]
    assert measured["mode"] == "compiled" and measured["status"] == "ok"
    assert measured["decode_step_ms"]["median"] > 0


def test_rows_state_effective_level_and_graphs_and_equal_ones_run_once(tmp_path, capsys):
    modes = "eager,piecewise,full_and_piecewise"
    code, payload = bench_latency(
        tmp_path, "--model", "llama-tiny", "--modes", modes, *EAGER_BACKEND
    )
    assert code == 0
    rows = [(r["mode"], r["level"], r["graph_mode"], r["merged_modes"]) for r in payload["results"]]
    # The CPU has no static graphs: both graph modes resolve to level 3 without graphs.
    assert rows == [("eager", 0, "NONE", []), ("piecewise", 3, "NONE", ["full_and_piecewise"])]
    eager, compiled = payload["results"]
    assert eager["compile_s"] is None and compiled["compile_s"] > 0  # eager compiles nothing
    assert eager["decode_step_ms"]["min"] <= eager["decode_step_ms"]["max"]
    out = capsys.readouterr().out
    assert "piecewise also stands for full_and_piecewise" in out
    table_row = next(line for line in out.splitlines() if line.startswith("eager "))
    assert table_row.split()[1:3] == ["0", "NONE"]  # lvl and graphs columns
    assert table_row.split()[10] == "-"  # compile s


def test_enforce_eager_runs_one_eager_row(tmp_path):
    code, payload = bench_latency(tmp_path, "--model", "llama-tiny", "--enforce-eager")
    assert code == 0
    assert [(r["mode"], r["level"]) for r in payload["results"]] == [("eager", 0)]
    assert payload["programmatic_launch"] is False  # the CPU has none: kernel times are their own


def test_num_scheduler_steps_reaches_the_engine_and_every_row_says_it(tmp_path, capsys):
    """10 tokens: the prefill's, then decode runs of 4, 4 and 1 (9 decode steps either way)."""
    flags = ["--model", "llama-tiny", "--enforce-eager", "--output-len", "10"]
    code, single = bench_latency(tmp_path, *flags)
    assert code == 0 and single["num_scheduler_steps"] == 1
    code, multi = bench_latency(tmp_path, *flags, "--num-scheduler-steps", "4")
    assert code == 0 and multi["num_scheduler_steps"] == 4
    assert "4 decode step(s) per host round trip" in capsys.readouterr().out
    assert "--num-scheduler-steps 4" in multi["command"]
    (row,), (single_row,) = multi["results"], single["results"]
    assert (row["num_scheduler_steps"], single_row["num_scheduler_steps"]) == (4, 1)
    assert row["num_decode_steps"] == single_row["num_decode_steps"] == 9
    assert row["first_output_token_ids"] == single_row["first_output_token_ids"]
    assert len(row["first_output_token_ids"]) == 10


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--enforce-eager", "--modes", "compiled"], "--enforce-eager asks for level 0"),
        (["-O", "0", "--modes", "eager,compiled"], "mode 'compiled' runs compile level 3"),
        (["--compilation-config", '{"cudagraph_mode": "FULL"}', "--modes", "piecewise"], "FULL"),
    ],
)
def test_a_mode_contradicting_a_flag_is_an_error_before_any_work(flags, words, capsys, monkeypatch):
    monkeypatch.setattr(latency, "measure_mode", pytest.fail)  # never reached
    assert main(["bench", "latency", "--model", "llama-tiny", *TINY, *flags]) == 2
    assert words in capsys.readouterr().err


def test_run_honours_level_zero(capsys, monkeypatch):
    plans = []
    monkeypatch.setattr(bench, "measure_rows", lambda case, p, baselines, bw: plans.extend(p) or [])
    assert main(["run", "--model", "llama-tiny", "-O", "0", "--no-answers"]) == 0
    assert [(p.name, p.level, p.graph_mode) for p in plans] == [("eager", 0, "NONE")]
    assert "lvl" in capsys.readouterr().out


def test_help_explains_every_column(capsys):
    from pieceworks.benchmarks.report import MODE_TABLE_COLUMNS

    with pytest.raises(SystemExit):
        main(["bench", "latency", "--help"])
    out = capsys.readouterr().out
    for title, _, meaning in MODE_TABLE_COLUMNS:
        assert f"  {title} " in out and meaning.split()[0] in out


def test_the_recorded_command_reruns_the_case_and_leaves_out_where_results_went():
    from pieceworks.entrypoints.bench import command_line
    from pieceworks.entrypoints.cli import build_parser

    argv = ["bench", "latency", "--model", "llama-125m", "--compare", "--num-iters", "7"]
    argv += ["--output-json", "/tmp/x.json", "--plot", "/tmp/x.png", "--commit", "abc"]
    command = command_line(build_parser().parse_args(argv))
    assert command == (
        "pieceworks bench latency --model llama-125m --batch-size 8 --input-len 32 "
        "--output-len 128 --num-iters 7 --compare"
    )


def test_epilogue_fusions_sums_every_compiled_module_by_kind():
    from types import SimpleNamespace

    from pieceworks.benchmarks.latency import epilogue_fusions

    def compiled(counts):
        module = torch.nn.Linear(1, 1)
        backend = SimpleNamespace(num_fusions=counts)
        module._pieceworks_compiler = SimpleNamespace(piecewise_backend=backend)
        return module

    model = torch.nn.Sequential(
        compiled({"gemv_act": 2, "rope": 2}), compiled({"gemv_act": 1, "attn_quant": 3}),
        torch.nn.Linear(1, 1),  # not compiled
    )  # fmt: skip
    assert epilogue_fusions(model) == {"gemv_act": 3, "rope": 2, "attn_quant": 3}
    assert epilogue_fusions(torch.nn.Linear(1, 1)) == {}


def test_speculative_config_reaches_the_engine_and_the_row_reports_acceptance(tmp_path):
    """n-gram speculation: the tokens are those of plain greedy decoding, and the row counts
    what was proposed and accepted (a random model rarely repeats, so few proposals)."""
    flags = ["--model", "llama-tiny", "--enforce-eager", "--output-len", "12"]
    code, plain = bench_latency(tmp_path, *flags)
    assert code == 0 and "speculative" not in plain["results"][0]
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}'
    code, payload = bench_latency(tmp_path, *flags, "--speculative-config", spec)
    assert code == 0
    (row,) = payload["results"]
    assert row["first_output_token_ids"] == plain["results"][0]["first_output_token_ids"]
    stats = row["speculative"]
    assert (stats["method"], stats["num_speculative_tokens"]) == ("ngram", 2)
    assert set(stats) == {
        "method", "num_speculative_tokens", "num_drafts", "num_draft_tokens",
        "num_accepted_tokens", "acceptance_rate", "mean_accepted_length",
    }  # fmt: skip
    assert 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
