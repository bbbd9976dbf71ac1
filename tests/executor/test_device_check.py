"""scripts/device-check, the one command run on a lent GPU (issue 36), exercised here on cpu with
--quick so that CI runs every phase of it: exactness against transformers, the memory readout,
`minirt up` answering the OpenAI API (plain and streamed alike), `minirt bench executor` against
transformers' static batch and `minirt bench serve --start`."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_device_check_runs_every_phase_on_cpu(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device-check"), "--device", "cpu", "--quick"]
        + ["--only", "main", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    phases = {p["phase"]: p for p in summary["phases"]}
    wanted = ["env", "models", "exact", "memory", "serve", "bench", "bench-serve"]
    assert list(phases) == wanted
    assert all(p["status"] == "pass" for p in phases.values()), phases
    exact = phases["exact"]
    assert (
        exact["float32 on cpu, llama"]["equal"] + exact["float32 on cpu, llama"]["near_ties"] == 18
    )
    assert exact["bf16 on cpu"]["positions"] > 0
    serve = phases["serve"]
    assert serve["usage"]["completion_tokens"] > 0 and serve["streamed_equal"]
    bench = phases["bench"]
    assert bench["ours_tok_s"] > 0 and bench["identical_to_hf_static"] == bench["requests"]
    assert phases["memory"]["num_blocks"] > 0
    with tarfile.open(out / "reports.tar.gz") as tar:
        names = tar.getnames()
    assert "reports/bench.json" in names and "reports/bench-serve/results/report.json" in names
    assert done.stdout.strip().endswith("device-check: all phases passed")
