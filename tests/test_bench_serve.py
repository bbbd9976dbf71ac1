"""`minirt bench serve` end to end on the tiny model: a report directory with numbers and plots."""

from __future__ import annotations

import json

from actors.bench.serve import main


def test_bench_serve_writes_report_with_variants(tiny_model, tmp_path):
    out = tmp_path / "report"
    argv = [
        "--start",
        "--model",
        str(tiny_model),
        "--workload",
        "mix",
        "--out",
        str(out),
        "--variant",
        "fcfs=--policy fcfs --num-blocks 512",
        "--variant",
        "sjf=--policy sjf --num-blocks 512",
    ]
    assert main(argv) == 0
    data = json.loads((out / "report.json").read_text())
    assert set(data["runs"]) == {"fcfs", "sjf"}
    for run in data["runs"].values():
        s = run["summary"]
        assert s["requests"] == 64 and s["errors"] == 0 and s["output_tokens"] == 64 * 32
        assert run["summary_short"]["requests"] == 60 and run["summary_long"]["requests"] == 4
        assert run["kv_timeline"] and run["control"]["steps"] > 0
    md = (out / "README.md").read_text()
    assert "minirt bench serve" in md and "| fcfs (short) |" in md
    assert (out / "ttft_cdf.png").stat().st_size > 1000
    assert (out / "throughput_kv.png").stat().st_size > 1000
