"""The replay of a run with speculative decoding (n-gram prompt lookup; SmolLM2 quoting passages
back): each request verifies its recorded drafts in its replayed decode steps and emits the
accepted ones, the draft rows cost what the fitted step-time model says; so the replay needs
fewer steps, and less time, than the same workload replayed without speculation (``--no-spec``),
which plans the steps a real run without speculation ran."""

from __future__ import annotations

import json

import trio

from minirt.client import open_client
from minirt.replay import sim, stepmodel, workload
from tests.support.runtime import start_runtime

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def _passages(n: int) -> list[str]:
    """Passages of Python's own documentation for the model to quote back (what prompt lookup
    drafts from)."""
    from pydoc_data.topics import topics

    return [topics[k][:600] for k in sorted(topics)[10 : 10 + n]]


def test_a_speculating_run_replays_with_its_acceptance(smollm2, tmp_path):
    # --spec-max-rows: draft rows priced flat, not on forwards timed at start, so whether drafts
    # run does not hang on the machine's speed at that moment (what this test checks is the replay)
    flags = (
        "--num-blocks", "256", "--speculative-config", json.dumps(SPEC), "--spec-max-rows", "16",
    )  # fmt: skip

    async def serve(rt) -> None:
        async with open_client(rt.endpoint) as client:
            with trio.fail_after(120):
                for text in _passages(4):  # batch 1: each request speculates alone
                    ask = f"Repeat this text exactly:\n\n{text}"
                    await client.generate(
                        messages=[{"role": "user", "content": ask}],
                        max_tokens=60,
                        temperature=0,
                    )

    with start_runtime(smollm2, tmp_path / "run", *flags) as rt:
        trio.run(serve, rt)
    with start_runtime(smollm2, tmp_path / "plain", *flags[:2]) as rt:  # no speculation
        trio.run(serve, rt)
    rec = workload.load(tmp_path / "run")
    recorded_accepted = sum(a for s in rec.requests for _, a, _ in s.spec)
    assert recorded_accepted > 20, "the recording accepted too few drafts to tell"
    model = stepmodel.fit(rec.steps)
    res = sim.replay(rec, model)
    assert res.decisions() == rec.decisions

    def accepted(r) -> int:
        return sum(e.get("spec_accepted", 0) for e in r.events if e["event"] == "executor.step")

    assert accepted(res) >= 0.9 * recorded_accepted
    assert res.summary()["output_tokens"] == sum(r["completion_tokens"] for r in rec.records)
    without = sim.replay(rec, model, {"no-spec": True})  # the what-if: speculation off
    assert accepted(without) == 0
    # every accepted draft is a decode step saved, and the replay's clock says so (how close
    # its times are to the recording's is for the benchmark reports, not a test)
    assert without.steps > res.steps and without.wall_s > res.wall_s
    # ... and the what-if runs the rows a real run without speculation ran: a decode row per
    # token, no draft rows (not as many steps: arrivals replay at their recorded times, and
    # without the drafts the requests overlap where the real client waited for each answer)
    real = workload.load(tmp_path / "plain")
    assert sum(r["completion_tokens"] for r in real.records) == without.summary()["output_tokens"]

    def rows(steps) -> tuple[int, int, int]:
        return tuple(sum(e.get(k, 0) for e in steps) for k in (  # type: ignore[return-value]
            "prefill_tokens", "decode_tokens", "spec_draft_tokens"))  # fmt: skip

    replayed = rows([e for e in without.events if e["event"] == "executor.step"])
    assert replayed == rows(real.steps) and replayed[2] == 0, (replayed, rows(real.steps))
