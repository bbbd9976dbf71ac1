"""``scripts/bench-openai``'s report: interleaved rounds, each minirt server's ratios to vLLM
paired within a round, and the goodput the client counted. (The servers and the client are not
started here: the script runs vLLM from its own venv, outside CI.)"""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.openai import _args
from benchmarks.openai_report import paired, write_report


def _client(tput: float, ttft: float, tpot99: float, goodput: float) -> dict:
    """The fields of a ``vllm bench serve`` result the report reads."""
    return {
        "completed": 64, "failed": 0, "output_throughput": tput, "request_throughput": tput / 64,
        "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": tpot99 * 0.8,
        "p99_tpot_ms": tpot99, "median_itl_ms": 60.0, "median_e2el_ms": 5000.0,
        "request_goodput": goodput,
    }  # fmt: skip


def test_ratios_are_paired_within_each_round(tmp_path) -> None:
    results = {
        "minirt": {"rounds": [
            {"w1": _client(500, 2000, 120, 3.0), "sweep": {"2": _client(120, 50, 20, 1.9)}},
            {"w1": _client(400, 2400, 130, 2.0), "sweep": {"2": _client(118, 55, 21, 1.8)}},
        ]},
        "vllm": {"rounds": [
            {"w1": _client(400, 2500, 100, 2.5), "sweep": {"2": _client(119, 40, 15, 1.9)}},
            {"w1": _client(320, 2000, 130, 1.0), "sweep": {"2": _client(117, 45, 16, 1.9)}},
        ]},
    }  # fmt: skip
    a: argparse.Namespace = _args(
        ["--rounds", "2", "--variant", "minirt-fixed=--budget-policy fixed"]
    )
    a.work = str(tmp_path / "work")
    path = write_report(
        tmp_path / "out", "scripts/bench-openai --rounds 2", a, tmp_path, results, []
    )
    md = path.read_text()
    # round 1: 500/400 = 1.25x; round 2: 400/320 = 1.25x, though minirt's round 2 is below
    # vLLM's round 1: the pairing, not the pooled means
    assert "throughput 1.25x**" in md
    assert "TTFT p50 0.80-1.20x" in md and "TPOT p99 1.00-1.20x" in md
    ratios = paired(
        [{"server": s, "round": i + 1, **r} for s, i, r in (
            ("minirt", 0, {"output_tok_s": 1.0, "ttft_p50_ms": 1.0, "tpot_p50_ms": 1.0, "tpot_p99_ms": 2.0}),
            ("vllm", 0, {"output_tok_s": 2.0, "ttft_p50_ms": 4.0, "tpot_p50_ms": 1.0, "tpot_p99_ms": 1.0}),
        )]
    )  # fmt: skip
    assert ratios == [
        {"server": "minirt", "round": 1, "throughput_x": 0.5, "ttft_p50_x": 0.25,
         "tpot_p50_x": 1.0, "tpot_p99_x": 2.0}
    ]  # fmt: skip
    assert "| minirt | 2 | 1.25 | 1.20 | 1.00 | 1.00 |" in md  # round 2, two decimals
    assert "| 2 | 2 | minirt | 64 | 0 | 118.0 |" in md  # the sweep: rate, round, server
    assert "goodput_req_s" in md and "| 1.8 |" in md
    assert "tcmalloc preloaded" in md and "1 GiB of KV cache" in md
    # the sampling settings in the header: the client's default samples, as users run it
    assert "sampling: the client's defaults (it sends no temperature" in md
    assert path == tmp_path / "out" / "README.md"  # the raw data in results/
    saved = json.loads((tmp_path / "out" / "results" / "report.json").read_text())
    assert len(saved["results"]["minirt"]["rounds"]) == 2


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--variant", "noflags"]])
def test_bad_arguments_are_refused(bad, capsys) -> None:
    with pytest.raises(SystemExit):
        _args(bad)
    assert bad[0] in capsys.readouterr().err
