"""``minirt bench structured`` runs (quick, on the tiny model with its own tokenizer) and measures
what it says: both runs generate the same tokens at the same batch size."""

from __future__ import annotations

import json

from benchmarks.structured import main


def test_bench_structured_quick(tiny_model, tmp_path):
    out = tmp_path / "report"
    assert main(["--model", str(tiny_model), "--own-tokenizer", "--quick", "--out", str(out)]) == 0
    res = json.loads((out / "results" / "report.json").read_text())
    assert res["constrained"]["tokens"] == res["free"]["tokens"] == 8 * 8
    assert res["constrained"]["all_length"] and res["mixed"]["all_length"]
    assert res["constrained"]["mask_ms"] > 0 and res["free"]["mask_ms"] == 0
    assert set(res["compile_ms_cold"]) == {"records", "nested", "wide", "text"}
    assert res["cache_misses"] == 4
    assert "| constrained |" in (out / "README.md").read_text()
