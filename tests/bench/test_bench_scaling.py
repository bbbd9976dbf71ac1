"""``minirt bench scaling`` writes both sweeps for minirt (vLLM skipped here)."""

from __future__ import annotations

import json
import math

from gpu import cpu_name


def test_scaling_report_has_both_sweeps(tiny_model, tmp_path):
    from benchmarks.scaling import main

    out = tmp_path / "scaling"
    args = ["--model", str(tiny_model), "--batches", "1,8", "--contexts", "64,5000"]
    assert (
        main([*args, "--context-batch", "2", "--steps", "4", "--skip-vllm", "--out", str(out)]) == 0
    )
    rows = json.loads((out / "results" / "report.json").read_text())["rows"]
    assert [(r["sweep"], r["batch"]) for r in rows[:2]] == [("batch", 1), ("batch", 8)]
    ctx = [r["context"] for r in rows if r["sweep"] == "context"]
    assert ctx == [64, 1024 - 4 - 2]  # capped to leave room for the decode steps
    assert all(r["minirt_tok_s"] > 0 and not math.isnan(r["minirt_step_ms"]) for r in rows)
    assert (out / "decode_vs_batch.png").exists() and (out / "step_vs_context.png").exists()
    readme = (out / "README.md").read_text()
    assert "Regenerate with" in readme
    assert f"Machine: {cpu_name()}, " in readme  # a report says which CPU measured it
