"""The transformers model path (``--model-impl transformers``, gpu/model/generic.py): families beyond
the native four run by transformers' own modeling code over minirt's paged KV cache, token for
token with transformers' ``generate`` (eager attention, float32) on tiny random-weight models:
prompts longer than every sliding window, prefilled in chunks, and continued from a prefix-cache
hit. What it cannot run is refused at start, naming why."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu.model.families import FAMILIES, WINDOW
from gpu.model.loader import SUPPORTED, UnsupportedModelError, load_spec
from gpu.model.make_model import make_model
from gpu.model_runner import ModelRunner
from messages.common import SamplingParams
from tests.executor.test_executor import Driver, compare, reference

# longer than every window; not a multiple of the chunk cap
LENGTHS = (1, 3 * WINDOW + 5, 6 * WINDOW + 1)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: make_model(name, "tiny", root / name) for name in FAMILIES}


def _hf(model_dir: Path):
    # eager: the attention transformers computes without a kernel of its own (and the only one
    # with soft-capping)
    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )


def _runner(model_dir: Path, **kw) -> ModelRunner:
    kw = {"device": "cpu", "dtype": "float32", "num_blocks": 96, "chunk_cap": 7, **kw}
    return ModelRunner(model_dir, step_budget=40, **kw)


def _exact(model_dir: Path, ex: ModelRunner, seed: int = 0) -> Driver:
    """Prompts of LENGTHS at once, then two that share a cached prefix of the longest: each
    equals transformers' greedy generate (a first difference only at a near-tie)."""
    hf = _hf(model_dir)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, ex.vocab_size) for _ in range(n)] for n in LENGTHS]
    drv = Driver(ex)
    for i, p in enumerate(prompts):
        drv.add(f"r{i}", p)
    drv.run(keep_blocks=True)
    assert any(r.num_decode_tokens and r.num_prefill_tokens for r in drv.steps)
    longest = prompts[-1]
    cached = 2 * ex.block_size  # two whole blocks: past the window
    shared = drv.tables[f"r{len(prompts) - 1}"][: cached // ex.block_size]
    hits = {
        "hit-a": longest[:cached] + [rng.randrange(3, ex.vocab_size) for _ in range(WINDOW + 3)],
        "hit-b": longest[: cached + 3],
    }
    for rid, p in hits.items():
        table = shared + drv.blocks(-(-len(p) // ex.block_size) - len(shared))
        drv.add(rid, p, table=table, cached=cached)
    before = len(drv.steps)
    drv.run(keep_blocks=True)
    computed = sum(r.num_prefill_tokens for r in drv.steps[before:])
    assert computed == sum(len(p) - cached for p in hits.values())  # the prefix was not
    ties = sum(
        compare(hf, p, drv.outs[rid], reference(hf, p))
        for rid, p in [*((f"r{i}", p) for i, p in enumerate(prompts)), *hits.items()]
    )
    assert ties <= 1, f"{ties} near-tie divergences"
    return drv


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(families, name):
    impl = "transformers" if name in SUPPORTED else "auto"  # auto: no native path for the rest
    ex = _runner(families[name], model_impl=impl)
    assert ex.spec.impl == "transformers"
    if name == "gemma2":  # a windowed layer and a full one, both soft-capped: the masks matter
        cfg = ex.spec.hf_config
        assert cfg.layer_types == ["sliding_attention", "full_attention"]
        assert cfg.sliding_window == WINDOW and cfg.attn_logit_softcapping is not None
        assert max(LENGTHS) > 4 * WINDOW
    _exact(families[name], ex)


def test_native_family_through_transformers_matches_too(tiny_models):
    ex = _runner(tiny_models["qwen3"], model_impl="transformers")
    assert ex.spec.impl == "transformers"
    _exact(tiny_models["qwen3"], ex, seed=1)


def test_kv_heads_are_what_attention_gets(families):
    """Falcon's multi-query attention has one K/V head whatever its config's head counts say:
    the spec (so the pool's bytes per block) takes it from a forward on the meta device."""
    spec = load_spec(families["falcon"])
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 1, 16)


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma3_text"])
def test_speculative_decoding_on_the_transformers_path(families, name):
    """n-gram drafts verified in the model's own forward (experts; sliding windows): still its
    greedy tokens."""
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    model_dir = families[name]
    ex = _runner(model_dir, speculative=spec, spec_rows=64, model_impl="transformers")
    hf = _hf(model_dir)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, ex.vocab_size) for _ in range(n)] for n in (5, 12, 30, 41)]
    drv = Driver(ex)
    for i, p in enumerate(prompts):
        drv.add(f"s{i}", p, SamplingParams(max_tokens=48))
    drv.run()
    stats = [s.spec for s in drv.steps if s.spec is not None]
    assert sum(s.num_draft_tokens for s in stats) > 0  # the outputs repeat themselves
    if name == "qwen3_moe":
        assert sum(s.num_accepted_tokens for s in stats) > 0
    for i, p in enumerate(prompts):
        compare(hf, p, drv.outs[f"s{i}"], reference(hf, p, 48))


def test_sampled_requests_reproduce_by_seed(families):
    ex = _runner(families["qwen3_moe"], model_impl="transformers")
    drv = Driver(ex)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    drv.add("a", list(range(3, 40)), params)
    drv.add("b", list(range(3, 40)), params)
    drv.add("c", list(range(50, 60)), SamplingParams(max_tokens=5, temperature=1.0, seed=1))
    drv.run()
    assert drv.outs["a"] == drv.outs["b"] and len(drv.outs["a"]) == 12


def test_preempted_and_resumed_as_if_never_stopped(families):
    """An abort mid-answer (preemption), then the prompt plus the tokens so far queued again:
    the answer goes on as transformers' greedy one, recomputing the KV through the model."""
    model_dir = families["starcoder2"]
    ex = _runner(model_dir)
    hf = _hf(model_dir)
    prompt = list(range(20, 20 + 3 * WINDOW))
    drv = Driver(ex)
    drv.add("a", prompt)
    while len(drv.outs["a"]) < 6:
        drv.step(keep_blocks=True)
    so_far = drv.outs["a"][:]
    assert ex.abort("a")
    drv.free.extend(drv.tables.pop("a"))
    whole = prompt + so_far
    table = drv.blocks(-(-len(whole) // ex.block_size))
    ex.add_request(
        "a", whole, SamplingParams(max_tokens=16), table, prior_output_tokens=len(so_far)
    )
    drv.tables["a"] = table
    drv.run()
    compare(hf, prompt, drv.outs["a"], reference(hf, prompt))


def test_structured_output_and_penalties_on_the_transformers_path(families):
    """The executor's grammar masks and logits processors act on the transformers path's logits:
    a regex-constrained answer matches its regex, greedy and sampled."""
    import re

    from transformers import AutoTokenizer

    from messages.common import StructuredOutput

    model_dir = families["gemma2"]
    ex = _runner(model_dir)
    pattern = r"([a-z]{2,5}-[0-9]{2} ){2,4}end"
    drv = Driver(ex)
    shape = StructuredOutput(regex=pattern)
    drv.add("g", [5, 6, 7], SamplingParams(max_tokens=60, structured=shape))
    drv.add("s", [8, 9], SamplingParams(max_tokens=60, structured=shape, temperature=1.0, seed=3,
                                         repetition_penalty=1.3))  # fmt: skip
    drv.run()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for rid in ("g", "s"):
        assert drv.finish[rid] == "stop"
        assert re.fullmatch(pattern, tok.decode(drv.outs[rid], skip_special_tokens=True))


def _config_dir(tmp_path: Path, fields: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return tmp_path


REFUSED = {
    "encoder_decoder": ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]},
                        r"encoder-decoder"),
    "vision": ({"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"},
                "text_config": {"model_type": "llama"}}, r"vision_config is set"),
    "own_attention": ({"model_type": "mamba", "architectures": ["MambaForCausalLM"]},
                      r"MambaForCausalLM computes attention in its own code"),
    "not_causal": ({"model_type": "vit", "architectures": ["ViTModel"]},
                   r"model_type 'vit' has no causal-LM class"),
    "layer_types": ({"model_type": "qwen3_next", "layer_types": ["linear_attention"] * 4,
                     "num_hidden_layers": 4}, r"layer_types entry 'linear_attention'"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_naming_why(tmp_path, name):
    fields, message = REFUSED[name]
    with pytest.raises(UnsupportedModelError, match=message):
        load_spec(_config_dir(tmp_path, fields))


def test_bidirectional_attention_is_refused_at_start(tmp_path):
    """BERT as a causal-LM class, but not configured as a decoder: its layers attend both ways."""
    from transformers import BertConfig, BertLMHeadModel

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64)  # fmt: skip
    BertLMHeadModel(cfg).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match=r"attends bidirectionally"):
        _runner(tmp_path)


def test_attention_sinks_are_refused_at_start(tmp_path):
    """gpt-oss passes its sinks (``s_aux``) to attention: maths the function does not do."""
    from transformers import AutoConfig

    from gpu.model.make_model import _sizes

    cfg = AutoConfig.for_model(
        "gpt_oss", **_sizes("tiny"), num_local_experts=4, num_experts_per_tok=2, head_dim=16
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match=r"GptOssAttention passes s_aux"):
        _runner(tmp_path)


def test_native_refuses_other_families_and_lora_needs_it(families, tiny_model):
    with pytest.raises(UnsupportedModelError, match=r"'gemma2'\) on the native path"):
        load_spec(families["gemma2"], "native")
    with pytest.raises(ValueError, match=r"model_impl must be one of"):
        load_spec(tiny_model, "vllm")
    with pytest.raises(ValueError, match=r"--enable-lora is served on the native model path"):
        _runner(families["olmo2"], max_loras=2)
    assert load_spec(tiny_model).impl == "native"  # auto: the native path where it can


def _token_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(out)[:, None])[:, 0]


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe"])
def test_bfloat16_within_tolerance_of_float32(families, name):
    """In bfloat16 (weights, activations, KV cache, where the CPU computes it natively): the
    output tokens' log-probabilities stray from transformers' float32 no further than
    transformers' own bfloat16 does (mean, with 0.01 of slack; at most 0.25 anywhere)."""
    model_dir = families[name]
    ex = _runner(model_dir, dtype="bfloat16", model_impl="transformers")
    rng = random.Random(2)
    prompt = [rng.randrange(3, ex.vocab_size) for _ in range(4 * WINDOW + 3)]
    drv = Driver(ex)
    drv.add("a", prompt, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0))
    got: list[float] = []
    while ex.has_work():
        res = ex.step()
        for o in res.outputs:
            if o.token_id is not None:
                drv.outs["a"].append(o.token_id)
                got.append(o.logprob)  # type: ignore[arg-type]
        for rid in res.skipped:
            drv.grow(rid, 1)
    out = drv.outs["a"]
    assert len(got) == 12
    want = _token_logprobs(_hf(model_dir), prompt, out)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, attn_implementation="eager"
    )
    theirs = (_token_logprobs(hf_bf16, prompt, out) - want).abs()
    ours = (torch.tensor(got, dtype=torch.float64) - want).abs()
    assert ours.mean() <= theirs.mean() + 0.01, (ours.mean(), theirs.mean())
    assert ours.max() < 0.25
