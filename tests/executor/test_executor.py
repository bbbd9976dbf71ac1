"""Executor core: mixed prefill/decode steps over a paged KV cache, token-identical to transformers."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu.model.loader import UnsupportedModelError
from gpu.model.make_model import ARCHS
from gpu.model_runner import ExecutorInputError, ModelRunner
from messages.common import SamplingParams

NEW_TOKENS = 16
NEAR_TIE = 1e-5


class Driver:
    """Plays the KV manager's role: hands out blocks, grows tables, frees finished requests.

    It grants blocks late at random (its own generator, seeded: the same steps in any test
    order), so requests are skipped for lack of room and resume when their blocks come."""

    def __init__(self, ex: ModelRunner, seed: int = 0) -> None:
        self.ex = ex
        self.rng = random.Random(seed)
        self.free = list(range(ex.num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.outs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.steps: list = []

    def blocks(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def add(self, rid, prompt, params=None, table=None, cached=0, keep=False) -> None:
        params = params or SamplingParams(max_tokens=NEW_TOKENS)
        if table is None:
            table = self.blocks(-(-len(prompt) // self.ex.block_size))
        self.ex.add_request(rid, prompt, params, list(table), num_cached_tokens=cached)
        self.tables[rid] = list(table)
        self.outs[rid] = []

    def run(self, keep_blocks: bool = False) -> None:
        for _ in range(10_000):
            if not self.ex.has_work():
                return
            self.step(keep_blocks)
        raise AssertionError("executor did not finish")

    def step(self, keep_blocks: bool = False) -> None:
        res = self.ex.step()
        self.steps.append(res)
        for rid in res.skipped:  # grow and retry next step
            self.grow(rid, 1)
        for o in res.outputs:
            if o.token_id is None:
                continue
            self.outs[o.request_id].append(o.token_id)
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason
                if not keep_blocks:
                    self.free.extend(self.tables.pop(o.request_id))
                continue
            total = o.num_prompt_tokens + o.num_output_tokens
            need = -(-total // self.ex.block_size) - len(self.tables[o.request_id])
            if need > 0 and self.rng.random() < 0.5:  # sometimes late: exercise `skipped`
                self.grow(o.request_id, need)

    def grow(self, rid: str, n: int) -> None:
        new = self.blocks(n)
        self.tables[rid].extend(new)
        self.ex.extend(rid, new)


def reference(hf, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy generate for one request (stops at the model's EOS ids)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=hf.device)
        out = hf.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def compare(hf, prompt: list[int], ours: list[int], ref: list[int]) -> int:
    """0 if equal; 1 if they first differ at a near-tie of the reference logits; else fail."""
    if ours == ref:
        return 0
    j = next(
        (i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b),
        min(len(ours), len(ref)),
    )
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + ref[:j]], device=hf.device)).logits[0, -1].double()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"diverged at output {j} (gap {gap:.3g}): ours {ours} ref {ref}"
    warnings.warn(f"near-tie divergence at output {j} (top-2 gap {gap:.2g})", stacklevel=2)
    return 1


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 300, 16, 17, 32, 33, *(rng.randint(1, 300) for _ in range(n - 6))]
    return [[rng.randrange(vocab) for _ in range(n_)] for n_ in lengths]


def _exactness(model_dir: Path, device: str) -> None:
    ex = ModelRunner(
        model_dir, device=device, dtype="float32", num_blocks=600, chunk_cap=7, step_budget=40
    )
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    prompts = _prompts(18, ex.vocab_size, seed=1)
    drv = Driver(ex)
    for i, p in enumerate(prompts):
        drv.add(f"r{i}", p)
    drv.run()
    assert sum(1 for r in drv.steps if r.num_decode_tokens and r.num_prefill_tokens) > 10
    assert any(r.skipped for r in drv.steps)
    ties = sum(compare(hf, p, drv.outs[f"r{i}"], reference(hf, p)) for i, p in enumerate(prompts))
    assert ties <= 2, f"{ties} near-tie divergences"
    assert len(drv.free) == ex.num_blocks  # every block came back


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_steps_match_transformers(tiny_models, arch):
    _exactness(tiny_models[arch], "cpu")


def test_steps_mix_decodes_and_mid_prompt_chunks(tiny_model):
    ex = ModelRunner(tiny_model, num_blocks=64, chunk_cap=7, step_budget=40)
    drv = Driver(ex)
    drv.add("a", list(range(5, 10)))
    ex.step()  # "a" prefilled in one chunk, first token sampled
    drv.add("b", list(range(100, 150)))
    res = ex.step()
    assert res.num_decode_tokens == 1 and res.num_prefill_tokens == 7
    (b_out,) = [o for o in res.outputs if o.request_id == "b"]
    assert b_out.token_id is None and not b_out.prefill_done
    res = ex.step()  # "b" continues mid-prompt, at position 7
    assert res.num_prefill_tokens == 7 and res.num_requests == 2


def test_a_step_names_the_prompts_it_completes_before_its_forward(tiny_model):
    """What the executor actor tells the scheduler at plan time (``PrefillDone``), so requests
    that share the prompt's prefix are admitted while the forward runs."""
    ex = ModelRunner(tiny_model, num_blocks=64, chunk_cap=7, step_budget=40)
    drv = Driver(ex)
    drv.add("a", list(range(5, 10)))
    drv.add("b", list(range(100, 118)))  # 18 tokens: chunks of 7, 7, 4
    seen: list[tuple[list[str], int]] = []

    def planned(rids: list[str]) -> None:  # the step's tokens do not exist yet
        seen.append((rids, sum(len(o) for o in drv.outs.values())))

    for _ in range(3):
        res = ex.step(on_planned=planned)
        for o in res.outputs:
            if o.token_id is not None:
                drv.outs[o.request_id].append(o.token_id)
    assert seen == [(["a"], 0), (["b"], 2)]  # step 1 ends a's prompt, step 3 b's; never step 2
    assert drv.outs["b"] and len(drv.outs["a"]) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_mixed_steps_match_transformers_cuda(tiny_models):
    _exactness(tiny_models["qwen2"], "cuda")


def test_prefix_reuse_matches_from_scratch(tiny_model):
    ex = ModelRunner(tiny_model, num_blocks=128, chunk_cap=7, step_budget=40)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    rng = random.Random(3)
    base = [rng.randrange(3, ex.vocab_size) for _ in range(64)]
    drv = Driver(ex)
    drv.add("a", base + [7, 8, 9])
    drv.run(keep_blocks=True)  # a's blocks (and the KV of its first 64 tokens) stay
    shared = drv.tables["a"][:4]
    cases = {
        "tail": (base[:48] + [rng.randrange(3, 500) for _ in range(40)], 48),
        "whole-70": (base + [7, 8, 9, 10, 11, 12], 64),  # all but the partial block cached
        "whole-64": (base, 48),  # prompt is 4 full blocks: the last block is recomputed
    }
    for rid, (prompt, cached) in cases.items():
        blocks = cached // ex.block_size
        table = shared[:blocks] + drv.blocks(-(-len(prompt) // ex.block_size) - blocks)
        drv.add(rid, prompt, table=table, cached=cached)
    drv.step()
    assert drv.steps[-1].num_prefill_tokens == 7 + 6 + 7  # chunks start at 48 / 64 / 48, not 0
    drv.run(keep_blocks=True)
    for rid, (prompt, _) in cases.items():
        compare(hf, prompt, drv.outs[rid], reference(hf, prompt))


def test_prompt_tokens_computed_are_only_the_uncached(tiny_model):
    ex = ModelRunner(tiny_model, num_blocks=32)
    drv = Driver(ex)
    drv.add("a", list(range(3, 40)))
    drv.run(keep_blocks=True)
    drv.add("b", list(range(3, 40)), table=drv.tables["a"][:2] + drv.blocks(1), cached=32)
    assert ex.step().num_prefill_tokens == 5


# What the executor still checks: the invariants a peer could get wrong (the client's fields are
# the front door's to validate, tests/tokenizer_svc/test_bad_input.py; the executor trusts them).
BAD_INPUTS = [
    ("prompt_ids", dict(prompt=[])),
    ("prompt_ids", dict(prompt=[5] * 1024, table="auto")),
    ("block_table", dict(prompt=[5] * 40, table=[0, 1])),
    ("block_table", dict(prompt=[5] * 4, table=[10**6])),
    ("block_table", dict(prompt=[5] * 4, table=[-1])),
    ("num_cached_tokens", dict(prompt=[5] * 40, cached=8)),
    ("num_cached_tokens", dict(prompt=[5] * 32, cached=32)),
    ("prior_output_tokens", dict(prompt=[5] * 8, prior=9)),
    ("request_id", dict(rid="ok0")),
]


def test_bad_input_names_request_and_field_and_leaves_others_untouched(tiny_model):
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    ex = ModelRunner(tiny_model, num_blocks=256, chunk_cap=7, step_budget=20)
    drv = Driver(ex)
    prompts = {f"ok{i}": [11 + i] * (30 + 9 * i) for i in range(3)}
    for rid, p in prompts.items():
        drv.add(rid, p)
    ex.step()
    ex.step()
    n_free = len(drv.free)
    for fld, case in BAD_INPUTS:
        rid = case.get("rid", "bad")
        prompt = case.get("prompt", [5, 6, 7])
        table = case.get("table", [200, 201, 202])
        if table == "auto":
            table = list(range(150, 150 + len(prompt) // 16 + 1))
        params = case.get("params", SamplingParams())
        with pytest.raises(ExecutorInputError) as err:
            ex.add_request(
                rid,
                prompt,
                params,
                table,
                num_cached_tokens=case.get("cached", 0),
                prior_output_tokens=case.get("prior", 0),
            )
        assert err.value.request_id == rid and err.value.field == fld, (fld, str(err.value))
        assert repr(rid) in str(err.value) and fld in str(err.value)
        assert ex.num_requests() == 3
    with pytest.raises(ExecutorInputError) as err:
        ex.extend("nope", [1])
    assert err.value.field == "request_id"
    assert len(drv.free) == n_free
    drv.run()
    for rid, p in prompts.items():
        assert drv.outs[rid] == reference(hf, p), rid


def test_finish_reasons_and_eos(tiny_model):
    ex = ModelRunner(tiny_model, num_blocks=32)
    drv = Driver(ex)
    drv.add("len", [40, 41, 42], SamplingParams(max_tokens=3, ignore_eos=True))
    drv.run()
    assert drv.finish["len"] == "length" and len(drv.outs["len"]) == 3
    first = drv.outs["len"][0]
    drv.add("stop", [40, 41, 42], SamplingParams(max_tokens=5, stop_token_ids=[first]))
    drv.run()
    assert drv.finish["stop"] == "stop" and drv.outs["stop"] == [first]
    assert set(ex.eos_token_ids) == {0, 2}
    assert not ex.has_work() and not ex.abort("stop")


def test_abort_drops_request(tiny_model):
    ex = ModelRunner(tiny_model, num_blocks=32)
    ex.add_request("a", [1, 2, 3], SamplingParams(), [0])
    assert ex.abort("a") and not ex.has_work() and not ex.abort("a")


def test_block_budget_and_unsupported_arch(tiny_model, tmp_path):
    ex = ModelRunner(tiny_model, kv_memory=1 << 20, block_size=8)
    per_block = 2 * 2 * 2 * 16 * 8 * 4  # K+V, layers, kv heads, head dim, tokens, float32
    assert ex.num_blocks == (1 << 20) // per_block and ex.block_size == 8
    assert ex.device.type == "cpu" and ex.dtype == torch.float32
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*Qwen3ForCausalLM"):
        ModelRunner(tmp_path, model_impl="native")


def test_pool_size_has_one_default(tiny_model, monkeypatch):
    """The supervisor's pool size (resolve_num_blocks) and the executor's own default agree: a
    fifth of the memory left after the weights (their expected footprint, WEIGHT_COPIES times
    their bytes), at most what max_batch_size requests of the model's context can use."""
    from actors.runtime.config import RuntimeConfig
    from gpu.model import memory
    from gpu.model.kv_cache import resolve_max_model_len, resolve_num_blocks
    from gpu.model.loader import load_spec

    cfg = RuntimeConfig(model=str(tiny_model))
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # K+V, layers, kv heads, head dim, tokens, float32
    # plenty of memory: capped at 256 requests x 1,024 positions
    assert resolve_num_blocks(cfg) == 256 * 1024 // 16
    assert ModelRunner(tiny_model).num_blocks == resolve_num_blocks(cfg)
    # 64 MiB available: a fifth of what is left once the weights' footprint is taken
    spec = load_spec(tiny_model)
    monkeypatch.setattr(memory, "device_memory", lambda device: (64 << 20, 64 << 20))
    left = (64 << 20) - int(memory.weight_bytes(spec, torch.float32) * memory.WEIGHT_COPIES["cpu"])
    assert resolve_num_blocks(cfg) == int(left * 0.2) // per_block
    assert ModelRunner(tiny_model).num_blocks == resolve_num_blocks(cfg)
    cfg.kv.kv_memory = float(1 << 20)
    assert resolve_num_blocks(cfg) == (1 << 20) // per_block
    cfg.kv.num_blocks = 7
    assert resolve_num_blocks(cfg) == 7
    # max_model_len: the model's 1,024 positions capped by the pool's 112 tokens
    assert resolve_max_model_len(cfg) == 7 * 16
    cfg.max_model_len = 200
    with pytest.raises(ValueError, match="exceeds what the KV pool holds"):
        resolve_max_model_len(cfg)
    cfg.kv.num_blocks, cfg.max_model_len = 1000, 2000
    with pytest.raises(ValueError, match="exceeds the model's context"):
        resolve_max_model_len(cfg)


def test_logprobs(tiny_model):
    ex = ModelRunner(tiny_model, num_blocks=32)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    prompt = [50, 60, 70, 80]
    ex.add_request("a", prompt, SamplingParams(max_tokens=2, logprobs=5, ignore_eos=True), [0])
    out = next(o for o in ex.step().outputs)
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
    assert out.prefill_done and out.token_id == int(lp.argmax())
    assert abs(out.logprob - float(lp.max())) < 1e-4
    assert [t for t, _ in out.top_logprobs] == lp.topk(5).indices.tolist()
    assert len(ex.step().outputs[0].top_logprobs) == 5


def test_bench_quick_runs(tiny_model, tmp_path):
    from benchmarks.executor import main

    out = tmp_path / "bench.json"
    assert (
        main(["--model", str(tiny_model), "--quick", "--skip-hf", "--skip-cb", "--json", str(out)])
        == 0
    )
    res = json.loads(out.read_text())
    assert res["ours_tok_s"] > 0 and res["requests"] == 8 and 0 < res["compute_limit_pct"] < 100


def test_bench_against_another_dtype_reports_paired_rounds(tiny_model, tmp_path):
    """``--against float32 --rounds 3``: bf16 and fp32 executors alternate in one process; each
    round's ratio is its own pair's, and the report's figure is their median."""
    from benchmarks.executor import main

    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_model), "--quick", "--skip-hf", "--skip-cb", "--json", str(out)]
    assert main([*argv, "--dtype", "bfloat16", "--against", "float32", "--rounds", "3"]) == 0
    res = json.loads(out.read_text())
    vs = res["against"]
    assert vs["dtype"] == "float32" and len(vs["rounds"]) == 3
    for r in vs["rounds"]:
        assert r["ratio"] == pytest.approx(r["tok_s"] / r["against_tok_s"])
    assert vs["median_ratio"] == sorted(r["ratio"] for r in vs["rounds"])[1]


def test_bench_sampling_cost_times_the_sampler_in_both_modes(tiny_model, tmp_path):
    """``--sampling-cost 2``: greedy and sampled runs alternate on one executor; each reports
    the sampler's time per step and its share of the run."""
    from benchmarks.executor import main

    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_model), "--quick", "--skip-hf", "--skip-cb", "--json", str(out)]
    assert main([*argv, "--sampling-cost", "2"]) == 0
    cost = json.loads(out.read_text())["sampling_cost"]
    assert cost["sampled_params"] == {"temperature": 1.0} and len(cost["rounds"]) == 2
    for r in cost["rounds"]:
        for side in ("greedy", "sampled"):
            assert r[side]["sampler_ms_per_step"] > 0 and 0 < r[side]["sampler_share"] < 1
    assert 0 < cost["median_sampler_share"] < 1


def test_bench_profile_names_the_c_kernels(tiny_model, tmp_path):
    """``--profile``'s op table says where a step's time goes, the kernel library's operators
    included, each under its own name."""
    from benchmarks.executor import main
    from gpu.model import paged_kernel

    if paged_kernel.kernel() is None:
        pytest.skip("the kernel library is switched off (MINIRT_PAGED_KERNEL=0)")
    prof = tmp_path / "profile.txt"
    argv = ["--model", str(tiny_model), "--quick", "--skip-hf", "--skip-cb", "--profile", str(prof)]
    assert main(argv) == 0
    table = prof.read_text()
    for name in ("paged_decode", "rows_linear", "rms_norm", "silu_mul", "rope", "kv_write"):
        assert f"minirt::{name}" in table, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_bench_quick_runs_cuda(tmp_path):
    from benchmarks.executor import main

    out = tmp_path / "bench.json"
    assert main(["--quick", "--device", "cuda", "--dtype", "bfloat16", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"].startswith("cuda") and res["ours_tok_s"] > 0
