"""Models of other families served as a new user would: ``minirt make-model`` writes a
Gemma-2-shaped and a Qwen3-MoE-shaped random checkpoint, ``minirt up --model DIR`` serves each
through the model path ``--model-impl`` picks, and the OpenAI API answers chats with transformers'
own greedy tokens; ``--model-impl native`` refuses them at start, naming the architecture."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.http_server import hf_chat_ids, start_http_runtime

N = 16
ASK = [{"role": "user", "content": "hello river model, what is the cache?"}]


def _make(name: str, out) -> None:
    subprocess.run(
        [sys.executable, "-m", "minirt.cli", "make-model", "--arch", name, "--out", str(out)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip


def _greedy(model_dir, prompt: list[int]) -> str:
    hf = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok.decode(out[0, len(prompt) :].tolist(), skip_special_tokens=True)


@pytest.mark.parametrize(
    ("name", "impl"), [("gemma2", "auto"), ("qwen3_moe", "auto"), ("qwen3_moe", "transformers")]
)
def test_served_over_the_openai_api(tmp_path, name, impl):
    """gemma2: the transformers path (auto); qwen3_moe: native (auto) and transformers'."""
    model = tmp_path / name
    _make(name, model)
    flags = ("--dtype", "float32", "--model-impl", impl)
    with start_http_runtime(model, tmp_path / "run", *flags) as h:
        client = h.client()
        got = client.chat.completions.create(
            model=str(model),
            messages=ASK,
            max_tokens=N,
            temperature=0,
        )
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=str(model), messages=ASK, max_tokens=N, temperature=0,
                stream=True,
            )
            if c.choices
        )  # fmt: skip
    want = _greedy(model, hf_chat_ids(model, ASK))
    assert got.choices[0].message.content == want
    assert streamed == want
    assert got.usage is not None and got.usage.completion_tokens > 0


def test_native_impl_refuses_them_at_start(tmp_path):
    model = tmp_path / "gemma2"
    _make("gemma2", model)
    out = subprocess.run(
        [sys.executable, "-m", "minirt.cli", "up", "--model", str(model), "--model-impl",
         "native", "--run-dir", str(tmp_path / "run"), "--http-port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "'gemma2') on the native path" in out.stderr + out.stdout
