"""The dashboard in a real headless browser (Debian's chromium + chromedriver, driven by
selenium) against a running ``minirt up`` on a small KV pool: requests refused for lack of
blocks show waiting with the refusal numbers, then running, then finished; prefix hits are
counted right; a request's life opens on click; the page keeps updating for 30 s with bounded
buffers and heap; the static export shows the same life offline.

Skipped (with the install line) when chromium, chromedriver or selenium is missing, except under
CI (CI=true), where it must run. Set MINIRT_DASHBOARD_SHOTS=DIR to keep the screenshots.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import pytest
import trio

from minirt.client import open_client
from minirt.http.dashboard.export import export_html
from tests.support.http_server import start_http_runtime
from tests.support.runtime import kv_stats, wait_until

INSTALL = "apt-get install -y chromium chromium-driver && .venv/bin/pip install selenium"
CAPS = {
    "requests": 40,
    "steps": 200,
    "kv": 1500,
    "hits": 200,
    "marks": 60,
    "tail": 50,
    "events_per_request": 80,
}
# Records every state the page renders for the watched requests (a MutationObserver sees each
# render, so no state shown for a moment is missed between two polls of the test).
RECORD = """
const ids = arguments[0], seen = window.__seen = {};
const snap = () => {
  for (const id of ids) {
    const row = document.querySelector(`tr[data-client-id="${id}"]`);
    if (!row) continue;
    const cached = row.querySelector("td.cached");
    const o = { table: row.closest("table").id, why: row.dataset.why || null,
      needed: row.dataset.blocksNeeded || null, free: row.dataset.blocksFree || null,
      evictable: row.dataset.blocksEvictable || null,
      text: (row.querySelector("td.why") || {}).textContent || "",
      cached: cached && cached.dataset.cached !== undefined ? Number(cached.dataset.cached) : null,
      t: Math.round(performance.now()) };
    const list = seen[id] = seen[id] || [], last = list[list.length - 1];
    if (!last || ["table", "why", "needed", "free", "evictable", "text", "cached"].some((k) => last[k] !== o[k])) list.push(o);
  }
};
new MutationObserver(snap).observe(document.body, { subtree: true, childList: true, attributes: true, characterData: true });
"""
MEMORY = """
if (window.gc) { window.gc(); }
return { heap: performance.memory.usedJSHeapSize, nodes: document.getElementsByTagName("*").length,
  stats: MR.stats(), step: Number(document.getElementById("last-step").dataset.step || 0) };
"""


def _browser_or_skip() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        chromium = None
    if chromium and driver:
        return chromium, driver
    reason = f"needs chromium, chromedriver and selenium ({INSTALL})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the browser test: {reason}")
    pytest.skip(reason)


@pytest.fixture
def browser(tmp_path):
    chromium, driver_path = _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}",
        "--window-size=1500,1300",
        "--js-flags=--expose-gc",
        "--enable-precise-memory-info",
    ):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        yield drv
    finally:
        drv.quit()


def _shot(drv: Any, tmp_path: Path, name: str) -> None:
    drv.save_screenshot(str(tmp_path / name))
    keep = os.environ.get("MINIRT_DASHBOARD_SHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / name, Path(keep) / name)


def _order(obs: list[dict[str, Any]]) -> list[str]:
    """The tables a request was seen in, in order, without repeats."""
    seq: list[str] = []
    for o in obs:
        if not seq or seq[-1] != o["table"]:
            seq.append(o["table"])
    return seq


async def _dom(drv: Any, script: str, *args: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: drv.execute_script(script, *args))


async def _load(endpoint: str, until: float, shared: list[int], seed: int) -> None:
    """A mix that keeps the small pool full: 40% of prompts share a prefix; sizes vary."""
    rng = random.Random(seed)
    async with open_client(endpoint) as c:
        while trio.current_time() < until:
            body = [rng.randrange(5, 500) for _ in range(rng.randint(40, 250))]
            ids = shared + body[:60] if rng.random() < 0.4 else body
            await c.generate(prompt_ids=ids, max_tokens=rng.randint(20, 150), ignore_eos=True)


@pytest.mark.deadline(240)
async def test_dashboard_shows_the_schedulers_decisions_live(tiny_model, tmp_path, browser):
    drv = browser
    run_dir = tmp_path / "rt"
    key = "dash-key"
    rng = random.Random(7)
    prompt = lambda n: [rng.randrange(5, 500) for _ in range(n)]  # noqa: E731
    # full reservations on 64 blocks of 16: each 100 + 900 token request takes 63 blocks, so
    # only one runs at a time (about a second each) and the others are refused for lack of blocks.
    # One torch thread: on two cores the executor's two would starve the browser, whose page then
    # lags the server by more than a request's life.
    # A disk tier too: its panel line shows the KV manager's bytes.
    disk = ("--kv-disk-dir", str(tmp_path / "disk"))
    flags = ("--num-blocks", "64", "--kv-mode", "full", "--threads", "1", *disk)
    with start_http_runtime(tiny_model, run_dir, *flags, api_key=key) as hr:
        rt = hr.rt
        async with trio.open_nursery() as nursery:
            caps = "&".join(f"cap_{k}={v}" for k, v in CAPS.items()) + "&window_s=30&refresh_ms=200"
            base = f"{hr.url}/dashboard"  # the HTTP API's server, with its API key
            await trio.to_thread.run_sync(drv.get, f"{base}?{caps}")

            async def key_asked() -> bool:  # 401 without the key; a busy machine may show
                src = await trio.to_thread.run_sync(lambda: drv.page_source)  # it late
                return "API key" in src

            await wait_until(key_asked, timeout=20, interval=0.2)
            await trio.to_thread.run_sync(drv.get, f"{base}?key={key}&{caps}")

            async def connected() -> bool:
                return (await _dom(drv, "return MR.stats().conn")) == "live"

            await wait_until(connected, timeout=20, interval=0.1)
            assert "key=" not in drv.current_url  # the page is live: the cookie holds the key
            t_open = trio.current_time()

            ids = ["dash-a", "dash-b", "dash-c"]
            results: dict[str, Any] = {}
            await _dom(drv, RECORD, [*ids, "dash-e", "dash-f"])

            async def run(c: Any, rid: str, ids_: list[int], n: int) -> None:
                results[rid] = await c.generate(
                    prompt_ids=ids_, max_tokens=n, ignore_eos=True, request_id=rid
                )

            async def shown_refused(rid: str) -> bool:
                seen = await _dom(drv, "return window.__seen")
                return any(o["why"] == "refused" for o in seen.get(rid, []))

            shared = prompt(96)
            async with open_client(rt.endpoint) as c:
                async with trio.open_nursery() as reqs:
                    for rid in ids:  # arriving in this order
                        reqs.start_soon(run, c, rid, prompt(100), 900)
                        await wait_until(lambda r=rid: rt.events("client.received", request_id=r))
                    # dash-a holds the pool until the page has shown dash-b refused (however far
                    # a busy machine makes the page lag); then it is cancelled, and dash-b runs
                    await wait_until(lambda: shown_refused("dash-b"), timeout=60, interval=0.1)
                    await c.cancel("dash-a")
                await run(c, "dash-e", shared + list(range(400, 420)), 8)
                await run(c, "dash-f", shared + list(range(420, 440)), 8)

            async def all_seen_finished() -> dict[str, list[Any]] | None:
                seen: dict[str, list[Any]] = await _dom(drv, "return window.__seen")
                done = all(any(o["table"] == "finished" for o in seen.get(i, [])) for i in results)
                return seen if done else None

            # the page's poll + render: each request seen finished
            obs = await wait_until(all_seen_finished, timeout=10, interval=0.1)

            refusals = {
                i: {
                    (e["blocks_needed"], e["blocks_free"], e["blocks_evictable"])
                    for e in rt.events("admission.refused")
                    if e["request_id"].split("@")[0] == i
                }
                for i in ids
            }
            assert refusals["dash-b"] and refusals["dash-c"], refusals
            for i in ("dash-b", "dash-c"):
                waits = [o for o in obs[i] if o["table"] == "waiting" and o["why"] == "refused"]
                assert waits, (i, obs[i])
                for o in waits:  # the numbers shown are the scheduler's, for this request
                    nums = (int(o["needed"]), int(o["free"]), int(o["evictable"]))
                    assert nums in refusals[i], (nums, refusals[i])
                    assert nums[0] > nums[1] + nums[2]  # refused for lack of blocks
                    assert (
                        f"needs {nums[0]} blocks, {nums[1]} free + {nums[2]} evictable" in o["text"]
                    )
                seen = [(o["t"], o["table"]) for o in obs[i]]
                assert _order(obs[i]) == ["waiting", "running", "finished"], seen
            assert _order(obs["dash-a"])[-2:] == ["running", "finished"]
            for i in ("dash-e", "dash-f"):  # prefix hits as the client was told
                final = [o for o in obs[i] if o["table"] == "finished"][-1]
                assert final["cached"] == results[i].usage["cached_tokens"], (i, final)
            assert results["dash-f"].usage["cached_tokens"] == 96
            assert results["dash-e"].usage["cached_tokens"] == 0
            hit = await _dom(drv, "return document.getElementById('hit-now').dataset.hitTokens")
            assert int(hit) == sum(r.usage["cached_tokens"] for r in results.values()) == 96
            # the KV pool panel shows the KV manager's own counts, once everything finished (the
            # page polls; on a busy machine its panel may still hold the poll before the last free)
            s = await kv_stats(rt)
            want = (s.free, s.in_use, s.cached_only)

            async def kv_shown() -> dict[str, str] | None:
                kv: dict[str, str] = await _dom(
                    drv, "return {...document.getElementById('kv-now').dataset}"
                )
                got = (int(kv["free"]), int(kv["inUse"]), int(kv["cachedOnly"]))
                return kv if got == want else None

            try:
                kv = await wait_until(kv_shown, timeout=10, interval=0.1)
            except trio.TooSlowError:
                last = await _dom(drv, "return {...document.getElementById('kv-now').dataset}")
                raise AssertionError(("the page's KV panel never matched", last, s)) from None
            assert s.in_use == 0 and s.cached_only > 0 and int(kv["total"]) == s.num_blocks == 64
            assert int(kv["diskBytes"]) == s.disk_bytes > 0, (kv, s)

            # a click opens the request's life, with every refusal it waited on
            await _dom(drv, "document.querySelector('tr[data-client-id=\"dash-c\"]').click()")
            life = await _dom(
                drv,
                "const h = document.querySelector('#life .life-head'); return {rid: h.dataset.rid,"
                " path: h.querySelector('.life-path').textContent, state: h.dataset.lifeState,"
                " refused: document.querySelectorAll('#life tr.wait[data-event=\"admission.refused\"]').length}",
            )
            assert life["rid"].split("@")[0] == "dash-c" and life["state"] == "finished"
            assert "waiting → running → finished" in life["path"]
            n_refused = len(
                [e for e in rt.events("admission.refused") if e["request_id"] == life["rid"]]
            )
            assert life["refused"] == n_refused >= 1
            _shot(drv, tmp_path, "dashboard-request.png")

            # 30 s of updates in all, under a mixed load: bounded buffers, heap and DOM
            until = t_open + 32

            async def queue_and_batch() -> bool:
                live = await _dom(drv, "return MR.stats().live")
                return live["waiting"] >= 2 and live["running"] >= 2

            async with trio.open_nursery() as loads:  # each load ends at `until`
                for s in range(8):
                    loads.start_soon(_load, rt.endpoint, until, shared, s)
                await trio.sleep_until(t_open + 14)
                mid = await _dom(drv, MEMORY)  # halfway through the load
                try:  # the screenshot: a moment with a queue and a batch, if one comes
                    await wait_until(queue_and_batch, timeout=8, interval=0.2)
                except trio.TooSlowError:
                    pass
                _shot(drv, tmp_path, "dashboard.png")
            end = await _dom(drv, MEMORY)
            print(
                "dashboard heap/nodes mid",
                mid["heap"],
                mid["nodes"],
                "end",
                end["heap"],
                end["nodes"],
            )
            nursery.cancel_scope.cancel()

    stats = end["stats"]
    assert stats["conn"] == "live" and end["step"] > mid["step"] > 0  # still updating
    for name, cap in CAPS.items():
        if name != "events_per_request":
            assert stats[name] <= cap, (name, stats)
    assert stats["events_per_request_max"] <= CAPS["events_per_request"]
    assert stats["requests"] == CAPS["requests"] and stats["steps"] == CAPS["steps"], stats
    assert stats["finished_order"] <= 2 * CAPS["requests"], stats
    assert stats["by_client"] <= CAPS["requests"] and stats["gone"] <= CAPS["requests"], stats
    assert stats["http_early"] <= 1000, stats
    assert end["heap"] < mid["heap"] * 1.2 + 1e6, (mid["heap"], end["heap"])
    assert end["nodes"] < mid["nodes"] * 1.3 + 200, (mid["nodes"], end["nodes"])

    # the static export of a request opens offline on its life
    out = tmp_path / "dash-c.html"
    assert export_html(run_dir, out, request_id="dash-c") == 0
    await trio.to_thread.run_sync(drv.get, out.as_uri())
    static = await _dom(
        drv,
        "return {conn: MR.stats().conn, rid: document.querySelector('#life .life-head').dataset.rid,"
        " refused: document.querySelectorAll('#life tr.wait[data-event=\"admission.refused\"]').length,"
        " fetched: performance.getEntriesByType('resource').length}",
    )
    assert static == {"conn": "static", "rid": life["rid"], "refused": n_refused, "fetched": 0}


def _replica_run(run_dir: Path) -> None:
    """Two replicas' merged logs (``minirt up --replicas 2`` layout), one request on each; the
    second was refused once for lack of blocks."""
    import json

    for i, name in enumerate(("replica-0", "replica-1")):
        d = run_dir / name / "events"
        d.mkdir(parents=True)
        rid, t = f"req-{i}@c1.x", 100.0 + i
        sched = [
            dict(event="scheduler.config", policy="fcfs", max_batch_size=4, ts=t),
            dict(event="request.queued", request_id=rid, prompt_tokens=40, ts=t + 0.1),
        ]
        if i == 1:
            sched.append(
                dict(
                    event="admission.refused",
                    request_id=rid,
                    blocks_needed=9,
                    blocks_free=2,
                    blocks_evictable=3,
                    running=1,
                    ts=t + 0.2,
                )
            )
        sched += [
            dict(event="request.admitted", request_id=rid, cached_tokens=16 * i, ts=t + 0.3),
            dict(event="request.finished", request_id=rid, finish_reason="length", ts=t + 0.5),
        ]
        kv = [
            dict(event="kv.config", num_blocks=8, block_size=16, ts=t),
            dict(event="kv.allocated", request_id=rid, free=5, ts=t + 0.3),
        ]
        for actor, evs in (("scheduler", sched), ("kv_manager", kv)):
            with (d / f"{actor}.jsonl").open("w") as f:
                for e in evs:  # no ``replica`` field: the page reads it from the path
                    f.write(json.dumps({**e, "actor": actor, "level": "info"}) + "\n")


async def test_export_of_a_replicated_run_has_a_replica_column(tmp_path, browser):
    from minirt.http.dashboard.export import render_html
    from minirt.http.dashboard.tail import LogTail

    _replica_run(tmp_path)
    # the export embeds what the live stream would send: every replica's lines, tagged by path
    events = []
    for src, lines in LogTail(tmp_path).backlog():
        import json

        events += [{**json.loads(x), "replica": src.split("/")[0]} for x in lines]
    out = tmp_path / "cluster.html"
    out.write_text(render_html(sorted(events, key=lambda e: e["ts"]), "cluster", "req-1"))
    await trio.to_thread.run_sync(browser.get, out.as_uri())
    got = await _dom(
        browser,
        "return {reps: [...document.querySelectorAll('#finished tbody tr')].map(r =>"
        " [r.dataset.clientId, r.querySelector('td.rep').textContent,"
        " getComputedStyle(r.querySelector('td.rep')).display]),"
        " config: document.getElementById('config').textContent,"
        " life: document.querySelector('#life .life-head').textContent,"
        " refused: document.querySelector('#life tr.wait td.detail').textContent}",
    )
    assert sorted(got["reps"]) == [
        ["req-0", "replica-0", "table-cell"],
        ["req-1", "replica-1", "table-cell"],
    ]
    assert "16 blocks" in got["config"] and "2 replicas" in got["config"]  # pools summed
    assert "on replica-1" in got["life"]
    assert "blocks_needed=9 blocks_free=2 blocks_evictable=3" in got["refused"]


@pytest.mark.deadline(120)
async def test_dashboard_shows_a_stopped_actor_suspect_then_alive(tiny_model, tmp_path, browser):
    """A stopped (SIGSTOP) executor is silent but alive: the page names it suspect (its peers'
    ``peer.suspect``), and clears it when it runs again (``peer.cleared``), never dead."""
    with start_http_runtime(tiny_model, tmp_path / "rt", api_key="k") as hr:
        await trio.to_thread.run_sync(browser.get, f"{hr.url}/dashboard?key=k&refresh_ms=200")

        async def connected() -> bool:
            return (await _dom(browser, "return MR.stats().conn")) == "live"

        await wait_until(connected, timeout=20, interval=0.1)
        pill = (
            "return [...document.querySelectorAll('#actors [data-actor]')]"
            ".map(p => [p.dataset.actor, p.dataset.state])"
        )
        pid = hr.rt.pid_of("executor")
        os.kill(pid, signal.SIGSTOP)
        try:

            async def shown_suspect() -> bool:
                return ["executor", "suspect"] in await _dom(browser, pill)

            await wait_until(shown_suspect, timeout=30, interval=0.1)
            _shot(browser, tmp_path, "dashboard-suspect.png")
        finally:
            os.kill(pid, signal.SIGCONT)

        async def cleared() -> bool:
            return await _dom(browser, pill) == []

        await wait_until(cleared, timeout=30, interval=0.1)
        assert [e for e in hr.rt.events("peer.cleared") if e["peer"] == "executor"]
        assert not hr.rt.events("peer.dead")


async def test_the_step_strip_shows_speculative_decodings_acceptance(smollm2, tmp_path, browser):
    """With ``--speculative-config``, the last-step line shows the step's drafts and the
    acceptance so far: the executor's own counts (its ``executor.step`` events)."""
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    flags = ("--speculative-config", spec, "--spec-max-rows", "16")  # drafts not priced on timings
    with start_http_runtime(smollm2, tmp_path / "rt", *flags, api_key="k") as hr:
        await trio.to_thread.run_sync(browser.get, f"{hr.url}/dashboard?key=k&refresh_ms=200")

        async def connected() -> bool:
            return (await _dom(browser, "return MR.stats().conn")) == "live"

        await wait_until(connected, timeout=20, interval=0.1)
        async with open_client(hr.rt.endpoint) as c:
            for name in ("assert", "break"):  # quoting a passage back: drafts are accepted
                ask = f"Repeat this text exactly:\n\n{topics[name][:400]}"
                await c.generate(
                    messages=[{"role": "user", "content": ask}], max_tokens=40, temperature=0
                )
        steps = hr.rt.events("executor.step")
        drafted = sum(e.get("spec_draft_tokens", 0) for e in steps)
        accepted = sum(e.get("spec_accepted", 0) for e in steps)
        assert accepted > 0

        async def shown() -> dict | None:
            d = await _dom(browser, "return {...document.getElementById('last-step').dataset}")
            return d if d.get("specDrafted") == str(drafted) else None

        d = await wait_until(shown, timeout=20, interval=0.1)
        assert d["specAccepted"] == str(accepted)
        text = await _dom(browser, "return document.getElementById('last-step').textContent")
        assert f"of {drafted} drafts accepted so far" in text, text
        # each request's own acceptance: the finished table's rows and the request's life
        per: dict[str, list[int]] = {}
        for e in steps:
            for rid, d, a in e.get("spec", []):
                per.setdefault(rid, [0, 0])
                per[rid][0] += d
                per[rid][1] += a

        async def finished() -> dict | None:  # once both requests' completions are read
            rows = await _dom(
                browser,
                "return [...document.querySelectorAll('#finished tbody tr[data-spec-drafted]')]"
                ".map((t) => [t.dataset.rid, +t.dataset.specDrafted, +t.dataset.specAccepted])",
            )
            got = {rid: [d, a] for rid, d, a in rows}
            return got if len(got) == len(per) else None

        assert await wait_until(finished, timeout=20, interval=0.1) == per
        rid, (d, a) = next(iter(per.items()))
        await _dom(browser, f"document.querySelector('#finished tr[data-rid=\"{rid}\"]').click()")

        async def fact() -> str | None:
            return await _dom(
                browser,
                "const f = document.querySelector('[data-fact=\"drafts accepted\"]');"
                "return f && f.textContent",
            )

        assert (await wait_until(fact, timeout=10, interval=0.1)).startswith(f"{a} of {d} (")


async def test_the_step_strip_shows_the_resident_lora_adapters(tiny_model, tmp_path, browser):
    """With ``--enable-lora``, the last-step line lists the adapters the executor holds: one
    loaded when first used, one evicted past ``--max-cpu-loras`` (its ``executor.lora_*``
    events)."""
    from tests.support.lora import make_adapter

    one, two = (make_adapter(tiny_model, tmp_path / n, 4, i) for i, n in enumerate(("one", "two")))
    flags = ("--enable-lora", "--lora-modules", f"one={one}", f"two={two}", "--max-cpu-loras", "1")
    with start_http_runtime(tiny_model, tmp_path / "rt", *flags, api_key="k") as hr:
        await trio.to_thread.run_sync(browser.get, f"{hr.url}/dashboard?key=k&refresh_ms=200")

        async def connected() -> bool:
            return (await _dom(browser, "return MR.stats().conn")) == "live"

        await wait_until(connected, timeout=20, interval=0.1)

        async def resident() -> str | None:
            d = await _dom(browser, "return {...document.getElementById('last-step').dataset}")
            return d.get("loras")

        async with open_client(hr.rt.endpoint) as c:
            await c.generate(prompt="hi", max_tokens=4, lora="one")
            assert await wait_until(lambda: resident(), timeout=20, interval=0.1) == "one"
            await c.generate(prompt="hi", max_tokens=4, lora="two")

        async def only_two() -> bool:
            return await resident() == "two"

        await wait_until(only_two, timeout=20, interval=0.1)
        assert [e["lora"] for e in hr.rt.events("executor.lora_evicted")] == ["one"]
        text = await _dom(browser, "return document.getElementById('last-step').textContent")
        assert "1 LoRA adapters this step; resident: two" in text, text
