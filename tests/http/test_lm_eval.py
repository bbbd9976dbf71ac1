"""EleutherAI's lm-evaluation-harness against a real `minirt up` serving SmolLM2, as its users run
it (`lm_eval --model local-completions`), and against its own ``hf`` backend on the same weights:
multiple choice (loglikelihood), perplexity (loglikelihood_rolling, several windows per document)
and greedy generation (generate_until) give the same scores, and the same per-request
loglikelihoods and texts. The harness tokenizes through the server (``/tokenizer_info``,
``/tokenize``): nothing local but the task files, which the test writes; nothing downloaded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.http_server import start_http_runtime

pytest.importorskip("lm_eval")  # a dev dependency: `make install` brings it

QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of", ["100 degrees", "0 degrees", "50 degrees"], 1),
    ("The largest planet in the solar system is", ["Mars", "Venus", "Jupiter", "Mercury"], 2),
    ("A week has", ["five days", "six days", "seven days", "ten days"], 2),
    ("The opposite of hot is", ["cold", "warm", "loud", "tall"], 0),
    ("Bees make", ["milk", "honey", "silk", "wool"], 1),
    ("The sun rises in the", ["west", "north", "east", "south"], 2),
    ("Two plus two equals", ["three", "four", "five", "six"], 1),
    ("A baby cat is called a", ["puppy", "calf", "kitten", "foal"], 2),
    ("Python is a programming", ["language", "snake", "river", "city"], 0),
    ("The color of a clear sky is", ["green", "blue", "red", "purple"], 1),
    ("Ice is the solid form of", ["air", "water", "sand", "iron"], 1),
]

DOCUMENTS = [
    "The scheduler decides, at every step, which requests may run. A request may start its "
    "prefill only when it holds every block of key and value cache it needs; the longest "
    "prefix already in the cache is matched first, so a shared system prompt is computed once. "
    "When blocks run short, the least recently used leaves of the prefix tree are evicted, and "
    "if that is not enough the request waits in the queue until another one finishes.",
    "Rivers carry water from the mountains to the sea. Along the way they cut valleys, move "
    "stones and sand, and feed the fields on their banks. In spring the snow melts and the "
    "rivers rise; in late summer many of them run low, and some small streams dry up entirely "
    "until the autumn rains return. People have built their towns beside rivers for thousands "
    "of years, for the water, for the fish, and for the easy road they make to other places.",
    "A recipe for bread needs only four things: flour, water, salt and yeast. Mix them, knead "
    "the dough until it is smooth, and leave it covered in a warm place until it has doubled. "
    "Shape the loaf, let it rise once more, and bake it in a hot oven until the crust is brown "
    "and the loaf sounds hollow when tapped underneath.",
]

PROMPTS = [
    ("Question: What is the capital of Italy?\nAnswer:", "Rome"),
    ("Question: How many legs does a spider have?\nAnswer:", "eight"),
    ("Question: What do cows drink?\nAnswer:", "water"),
    ("Question: Which animal says moo?\nAnswer:", "cow"),
]

TASKS = {
    "minirt_mc": """\
task: minirt_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "minirt_ppl": """\
task: minirt_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "minirt_gen": """\
task: minirt_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""",
}


def write_tasks(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rows = {
        "mc": [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS],
        "ppl": [{"text": t} for t in DOCUMENTS],
        "gen": [{"prompt": p, "answer": a} for p, a in PROMPTS],
    }
    for name, docs in rows.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    for name, text in TASKS.items():
        (root / f"{name}.yaml").write_text(text.format(dir=root))
    return root


def lm_eval(
    tmp: Path, tasks: Path, model: str, model_args: str, *extra: str
) -> tuple[dict, dict, str]:
    """One `lm_eval` run as its users start it: its scores, its logged responses per task (in
    document order, as Python values) and its log."""
    out = tmp / model
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        *(sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args),
        *("--tasks", ",".join(TASKS), "--include_path", str(tasks), "--batch_size", "4"),
        *("--output_path", str(out), "--log_samples", "--seed", "1234"),
        *extra,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    (results,) = out.rglob("results_*.json")
    samples = {}
    for task in TASKS:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task] = [_values(r["resps"]) for r in sorted(rows, key=lambda r: r["doc_id"])]
    return json.loads(results.read_text())["results"], samples, done.stderr


def _values(resps: list) -> list:
    """The harness logs its responses as strings: "-0.25", "True", or a generated text."""
    if isinstance(resps, list):
        return [_values(r) for r in resps]
    if resps in ("True", "False"):
        return resps == "True"
    try:
        return float(resps)
    except ValueError:
        return resps


@pytest.mark.deadline(900)
def test_lm_eval_local_completions_scores_as_its_hf_backend(smollm2, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    # A short context so that every document is scored in several rolling windows. The harness
    # makes an API model's windows two tokens shorter than its max_length (one kept for the
    # token it generates, one for the context): 48 there and 46 for hf give the same windows.
    ref, ref_samples, _ = lm_eval(
        tmp_path,
        tasks,
        "hf",
        f"pretrained={smollm2},dtype=float32,max_length=46",
        "--device",
        "cpu",
    )
    flags = ("--dtype", "float32", "--served-model-name", "smollm2")
    with start_http_runtime(smollm2, tmp_path / "run", *flags) as server:
        args = (
            f"model=smollm2,base_url={server.base_url}/completions,num_concurrent=2,"
            "max_retries=1,tokenized_requests=True,max_length=48"
        )
        got, got_samples, log = lm_eval(tmp_path, tasks, "local-completions", args)
    assert "Using remote tokenizer backend" in log, log[-3000:]  # the server's /tokenizer_info

    for metric in ("acc,none", "acc_norm,none"):
        assert got["minirt_mc"][metric] == ref["minirt_mc"][metric], (metric, got, ref)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(got["minirt_ppl"][metric], ref["minirt_ppl"][metric], rel_tol=1e-4)
    assert got["minirt_gen"]["exact_match,none"] == ref["minirt_gen"]["exact_match,none"]

    # Request by request: each choice's loglikelihood and whether it is the greedy answer,
    # each document's rolling loglikelihood, each generated text.
    for want, have in zip(ref_samples["minirt_mc"], got_samples["minirt_mc"], strict=True):
        assert len(want) == len(have)
        for [(w_ll, w_greedy)], [(h_ll, h_greedy)] in zip(want, have, strict=True):
            assert abs(w_ll - h_ll) < 1e-3 and w_greedy == h_greedy, (want, have)
    for [[w_ll]], [[h_ll]] in zip(
        ref_samples["minirt_ppl"], got_samples["minirt_ppl"], strict=True
    ):
        assert math.isclose(w_ll, h_ll, rel_tol=1e-4, abs_tol=1e-3), (w_ll, h_ll)
    assert got_samples["minirt_gen"] == ref_samples["minirt_gen"]
