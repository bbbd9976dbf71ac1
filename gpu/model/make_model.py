"""Build small random-weight models in Hugging Face layout, with an in-process BPE tokenizer.

Nothing is downloaded: the weights come from a fixed seed, the tokenizer is trained here on a
generated corpus. The output loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` and with
minirt's own loader, so tests exercise the real loading code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
SIZES = ("tiny", "bench", "q05")
# Sizes that are benchmark bodies (random weights, qwen2 only); never used by the tests.
_BENCH_SIZES = ("bench", "q05")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A Qwen-style template that shows tools and reasoning (written here, for tests): tools listed
# in the system turn, calls as <tool_call> blocks, tool answers as <tool_response> in a user
# turn, an assistant's reasoning in <think>; ``enable_thinking=False`` closes an empty one.
TOOLS_CHAT_TEMPLATE = (
    "{% set sys = messages[0].content if messages and messages[0].role == 'system' else '' %}"
    "{% if tools %}<|im_start|>system\n{% if sys %}{{ sys }}\n\n{% endif %}"
    "You may call one or more functions. Their signatures:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'To call one, write <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call>'
    "<|im_end|>\n"
    "{% elif sys %}<|im_start|>system\n{{ sys }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
TEMPLATES = {"chatml": CHAT_TEMPLATE, "tools": TOOLS_CHAT_TEMPLATE}

_WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are or not "
    "model token cache block prefix request queue batch step decode prefill schedule actor "
    "message socket process memory kernel tensor layer head attention value key query "
    "river mountain cloud garden window coffee music paper light stone city road winter "
    "happy quick slow bright quiet heavy small large early late green blue red golden "
    "run walk read write build serve send wait stop start think learn move open close "
    "hello world minirt runtime über café naïve 你好 世界 東京 数据 😀 🚀"
).split()


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ",", ""]))
    return lines


def _sizes(size: str) -> dict[str, Any]:
    if size == "tiny":
        return dict(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=1024,
            # Wider than HF's 0.02 default so random weights give varied, non-degenerate text.
            initializer_range=0.2,
        )
    if size == "bench":
        return dict(
            vocab_size=32000,
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=1408,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    if size == "q05":  # Qwen2.5-0.5B's body with the bench vocabulary: 0.39B parameters
        return dict(
            vocab_size=32000,
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        )
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def build_tokenizer(out: Path, vocab_size: int, seed: int = 0, template: str = "chatml"):
    """Train a byte-level BPE tokenizer in-process and save it (HF fast-tokenizer layout)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = TEMPLATES[template]
    fast.save_pretrained(str(out))
    return fast


def make_model(
    arch: str,
    size: str,
    out: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    config_overrides: dict[str, Any] | None = None,
    template: str = "chatml",
) -> Path:
    """Write a random-weight ``arch`` model of ``size`` plus tokenizer into ``out``; return the path.
    ``arch``: one of the native four (:data:`ARCHS`), or at the tiny size a family of
    gpu.model.families (served by the transformers path).

    ``config_overrides``: config keyword arguments applied last, over the size's and the
    architecture's defaults (e.g. ``{"rope_parameters": {...}}``, ``{"attention_bias": True}``);
    the tests build the model variants with them. ``template``: the chat template, ``chatml``
    or ``tools`` (``TOOLS_CHAT_TEMPLATE``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from gpu.model.families import FAMILIES

    if arch not in ARCHS and arch not in FAMILIES:
        raise ValueError(f"arch must be one of {[*ARCHS, *FAMILIES]}, got {arch!r}")
    if arch in FAMILIES and size != "tiny":
        raise ValueError(f"the {arch} family is defined at the tiny size only")
    if size in _BENCH_SIZES and arch != "qwen2":
        raise ValueError(f"the {size} size is defined for qwen2 only")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dims = _sizes(size)
    tokenizer = build_tokenizer(
        out, vocab_size=min(dims["vocab_size"], 4096), seed=seed, template=template
    )
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    extra: dict[str, Any] = dict(
        bos_token_id=None, eos_token_id=eos, pad_token_id=eos, rms_norm_eps=1e-6, rope_theta=10000.0
    )
    if arch == "qwen3":
        extra["head_dim"] = dims["hidden_size"] // dims["num_attention_heads"]
    if arch == "mistral":
        extra["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        extra["use_sliding_window"] = False
    if size == "tiny":
        dims["tie_word_embeddings"] = arch in ("qwen2", "qwen3")
    kwargs = {**dims, **extra, **FAMILIES.get(arch, {}), **(config_overrides or {})}
    config = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, im_end], pad_token_id=eos, do_sample=False
    )
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "minirt-model.json").write_text(json.dumps({"arch": arch, "size": size, "seed": seed}))
    return out
