/* minirt dashboard, the panels: render the model into the page's tables and text. */
(function (MR) {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s === null || s === undefined ? "" : s).replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const ms = (s) => (s === null || s === undefined || isNaN(s)) ? "" : (s * 1000).toFixed(s < 0.01 ? 2 : 0) + " ms";
  // whole seconds: a row's text then changes once a second, not at every render (less layout)
  const age = (s) => s < 1 ? "<1 s" : s < 120 ? Math.floor(s) + " s" : (s / 60).toFixed(1) + " min";
  const short = (id) => id.length > 14 ? id.slice(0, 12) + "…" : id;
  const ridCell = (r) => `<td class="rid" title="${esc(r.rid)}">${esc(short(r.clientId))}</td>`;
  MR.esc = esc;

  function rows(tbody, html) { if (tbody.dataset.html !== html) { tbody.innerHTML = html; tbody.dataset.html = html; } }
  function cachedCell(r) {
    if (r.cached === null) return `<td class="cached"></td>`;
    const pct = r.prompt ? Math.round((100 * r.cached) / (r.admitPrompt || r.prompt)) : 0;
    return `<td class="cached" data-cached="${r.cached}" data-prompt="${r.prompt}"><span class="hitbar" style="--p:${pct}%"></span><span class="v">${r.cached}<small> (${pct}%)</small></span></td>`;
  }
  function rep(r, show) { return show ? `<td class="rep">${esc(r.replica)}</td>` : ""; }

  MR.renderHeader = function (m, conn, rate) {
    const c = m.config, k = [];
    if (c.policy) k.push("policy " + c.policy);
    if (c.num_blocks) k.push(c.num_blocks + " blocks × " + c.block_size);
    if (c.kv_mode) k.push("kv " + c.kv_mode);
    if (c.max_batch_size) k.push("batch ≤ " + c.max_batch_size);
    if (c.step_budget) k.push("step ≤ " + c.step_budget + " tok");
    if (m.replicas.size) k.push(m.replicas.size + " replicas");
    $("config").textContent = k.join(" · ");
    $("conn").textContent = conn.text; $("conn").className = "pill " + conn.kind;
    const n = m.counts;
    const live = m.liveCounts();
    const down = [...m.actors.values()].filter((a) => a.state !== "alive");
    const pills = down.map((a) => {
      const who = (a.replica ? a.replica + "/" : "") + a.name;
      const why = a.state === "dead" ? a.reason : `silent ${a.silentS.toFixed(1)} s, requests wait`;
      return `<span class="pill ${a.state}" data-actor="${esc(who)}" data-state="${a.state}" title="${esc(why)}">${esc(who)} ${a.state}</span>`;
    }).join(" ");
    const el = $("actors");
    if (el.dataset.html !== pills) { el.innerHTML = pills; el.dataset.html = pills; }
    $("counts").textContent = `${live.waiting} waiting · ${live.running} running · ${n.finished} finished · ` +
      `${n.refusals} refusals · ${n.preemptions} preemptions · ${n.evictions} evicted blocks · ${rate.toFixed(0)} events/s`;
  };

  MR.renderWaiting = function (m, now, showRep) {
    const order = m.waitingOrder(), cap = m.caps.waiting_shown;
    const head = order[0], running = m.liveCounts().running;
    const html = order.slice(0, cap).map((r, i) => {
      const why = m.whyWaiting(r, i, head, running), sc = m.score(r), f = r.lastRefusal;
      const nums = why.kind === "refused" ? ` data-blocks-needed="${f.needed}" data-blocks-free="${f.free}" data-blocks-evictable="${f.evictable}"` : "";
      return `<tr data-rid="${esc(r.rid)}" data-client-id="${esc(r.clientId)}" data-state="waiting" data-why="${why.kind}"${nums} class="${why.kind}">` +
        `${rep(r, showRep)}${ridCell(r)}<td class="num">${age(Math.max(0, now - (r.waitSince || r.firstTs)))}</td>` +
        `<td class="num prompt">${r.prompt === null ? "" : r.prompt}</td><td class="score">${esc(sc.text)}</td><td class="num">${i + 1}</td>` +
        `<td class="why">${esc(why.text)}${r.refusals > 1 ? ` <small>(${r.refusals} refusals)</small>` : ""}</td></tr>`;
    }).join("") + (order.length > cap ? `<tr class="more"><td colspan="7">+ ${order.length - cap} more</td></tr>` : "");
    rows($("waiting").tBodies[0], html || `<tr class="none"><td colspan="7">nobody waits</td></tr>`);
    $("waiting-count").textContent = order.length ? order.length + " waiting" : "";
  };

  MR.renderRunning = function (m, now, showRep) {
    const live = [];
    for (const r of m.requests.values()) if (r.state === "running" || r.state === "preempting") live.push(r);
    const html = live.slice(0, 100).map((r) => {
      const phase = r.state === "preempting" ? "preempting" : r.prefillDoneTs ? "decode" : "prefill";
      return `<tr data-rid="${esc(r.rid)}" data-client-id="${esc(r.clientId)}" data-state="running" data-phase="${phase}">${rep(r, showRep)}` +
        `${ridCell(r)}<td class="phase ${phase}"${specData(r)}>${phase}${r.specDrafted ? ` <small>${specText(r)}</small>` : ""}</td>` +
        `<td class="num prompt">${r.prompt === null ? "" : r.prompt}</td>${cachedCell(r)}` +
        `<td class="num">${age(Math.max(0, now - (r.admittedTs || r.stateTs)))}</td><td class="num">${r.attempt}</td></tr>`;
    }).join("") + (live.length > 100 ? `<tr class="more"><td colspan="6">+ ${live.length - 100} more</td></tr>` : "");
    rows($("running").tBodies[0], html || `<tr class="none"><td colspan="6">nothing running</td></tr>`);
  };

  // a request's speculation so far: accepted of verified drafts, and how many times it explored
  const specText = (r) => r.specDrafted ? `${r.specAccepted} of ${r.specDrafted} (` +
    `${Math.round(100 * r.specAccepted / r.specDrafted)}%)` +
    (r.specExplored ? `, ${r.specExplored} explored` : "") : null;
  const specData = (r) => r.specDrafted === undefined ? "" :
    ` data-spec-drafted="${r.specDrafted}" data-spec-accepted="${r.specAccepted}"`;

  MR.renderFinished = function (m, showRep) {
    const out = [], cap = m.caps.finished_shown;
    for (let i = m.finishedOrder.length - 1; i >= 0 && out.length < cap; i--) {
      const r = m.requests.get(m.finishedOrder[i]);
      if (r && MR.TERMINAL.has(r.state)) out.push(r);
    }
    const html = out.map((r) => {
      const t = r.timings || {}, outcome = r.state === "finished" ? (r.finishReason || "finished") : r.state;
      return `<tr data-rid="${esc(r.rid)}" data-client-id="${esc(r.clientId)}" data-state="${r.state}" class="${r.state}"${specData(r)}>${rep(r, showRep)}` +
        `${ridCell(r)}<td class="outcome" title="${esc(r.error || "")}">${esc(outcome)}</td>` +
        `<td class="num prompt">${r.prompt === null ? "" : r.prompt}</td>${cachedCell(r)}` +
        `<td class="num">${r.outputTokens === null || isNaN(r.outputTokens) ? "" : r.outputTokens}</td>` +
        `<td class="num">${ms(t.queue_s)}</td><td class="num">${ms(t.ttft_s)}</td><td class="num">${ms(t.total_s)}</td>` +
        `<td class="num">${r.preemptions || ""}</td></tr>`;
    }).join("");
    rows($("finished").tBodies[0], html || `<tr class="none"><td colspan="9">none yet</td></tr>`);
  };

  MR.renderStep = function (m) {
    const s = m.steps.last();
    const el = $("last-step");
    if (!s) { el.textContent = "no step yet"; return; }
    const outside = s.stepS - s.forward + s.control;
    el.dataset.step = s.step; el.dataset.prefill = s.prefill; el.dataset.decode = s.decode;
    el.innerHTML = `step <b>${esc(s.step)}</b>${s.replica ? " (" + esc(s.replica) + ")" : ""}: ${s.requests} requests, ` +
      `<span class="k prefill">prefill ${s.prefill}</span> + <span class="k decode">decode ${s.decode}</span> tokens, ` +
      `step ${ms(s.stepS)}, forward ${ms(s.forward)}, <span class="k outside">outside the forward ${ms(outside)}</span>` +
      (s.skipped ? `, ${s.skipped} skipped` : "");
    if (m.loras) {  // LoRA: the adapters resident in the executor, and this step's
      const names = [...m.loras.values()].map((a) => a.name + (a.replica ? "@" + a.replica : "")).sort();
      el.dataset.loras = names.join(",");
      el.innerHTML += ` · <span class="k lora">${s.loras} LoRA adapters this step; resident: ` +
        `${esc(names.join(", ") || "none")}</span>`;
    }
    const sp = m.spec;
    if (sp) {  // speculative decoding: this step's drafts, and the acceptance so far
      el.dataset.specDrafted = sp.drafted; el.dataset.specAccepted = sp.accepted;
      const now = s.specK === null ? "" : s.specOff ? `speculation off (${esc(s.specOff)})`
        : `${s.specAccepted} of ${s.specDrafted} drafts accepted (k ${s.specK})`;
      const rate = sp.drafted ? ` · ${(100 * sp.accepted / sp.drafted).toFixed(0)}% of ${sp.drafted} drafts accepted so far` : "";
      const why = Object.entries(s.specWhy || {}).filter(([, n]) => n);  // the others: why not
      const none = why.length && !s.specOff ? `; none for ${why.map(([k, n]) => `${n} (${esc(k)})`).join(", ")}` : "";
      el.innerHTML += ` · <span class="k spec">${now}${none}${rate}</span>`;
    }
  };

  MR.renderKVNow = function (m) {
    const s = m.kvSamples.last();
    const el = $("kv-now");
    if (!s) { el.textContent = ""; return; }
    el.dataset.free = s.free; el.dataset.total = s.total;
    el.dataset.inUse = s.inUse === null ? "" : s.inUse;
    el.dataset.cachedOnly = s.cachedOnly === null ? "" : s.cachedOnly;
    el.innerHTML = s.inUse !== null
      ? `<span class="k inuse">in use ${s.inUse}</span> · <span class="k cached">cached-only ${s.cachedOnly}</span> · <span class="k free">free ${s.free}</span> of ${s.total}`
      : `<span class="k held">held ${s.held}</span> (in use + cached) · <span class="k free">free ${s.free}</span> of ${s.total}`;
    el.innerHTML += ` · <span class="k evict">▮ eviction</span> <span class="k preempt">▼ preemption</span>`;
    const d = m.disk;
    if (d) {
      const mb = (b) => (b / 1048576).toFixed(1) + " MiB";
      el.dataset.diskBytes = d.bytes; el.dataset.diskLoadedTokens = d.loadedTokens;
      el.innerHTML += ` · <span class="k disk">disk ${mb(d.bytes)} of ${mb(d.capacity)}, ` +
        `${d.loadedTokens} prompt tokens loaded${d.bad ? `, ${d.bad} bad files dropped` : ""}</span>`;
    }
  };

  MR.renderHitNow = function (m) {
    const el = $("hit-now"), rate = m.queriedTokens ? m.hitTokens / m.queriedTokens : 0;
    el.dataset.hitTokens = m.hitTokens; el.dataset.queriedTokens = m.queriedTokens;
    el.innerHTML = `<span class="k hit">hit rate ${(100 * rate).toFixed(1)}%</span> (${m.hitTokens} of ${m.queriedTokens} prompt tokens from cache) · <span class="k rolling">last 20 admissions</span>`;
  };

  MR.renderLife = function (m, rid, now) {
    const el = $("life");
    if (!rid) { el.innerHTML = `<p class="hint">Click a request in any table to see its life across the actors.</p>`; return; }
    const r = m.requests.get(rid) || m.requests.get(m.byClient.get(rid));  // full or client's id
    if (!r) { el.innerHTML = `<p class="hint">${esc(rid)}: not in the page's buffers (evicted, or not seen yet).</p>`; return; }
    const t0 = r.events.length ? Number(r.events[0].ts) : r.firstTs;
    const hist = [];
    for (const [s] of r.history) if (hist[hist.length - 1] !== s) hist.push(s);
    const t = r.timings || {};
    const facts = [["state", r.state + (r.finishReason ? " (" + r.finishReason + ")" : "")], ["prompt", r.prompt],
      ["cached (prefix hit)", r.cached], ["output", r.outputTokens], ["refusals", r.refusals],
      ["preemptions", r.preemptions], ["drafts accepted", specText(r)], ["queue", ms(t.queue_s)],
      ["ttft", ms(t.ttft_s)], ["e2e", ms(t.total_s)]]
      .filter(([, v]) => v !== null && v !== undefined && v !== "" && !(typeof v === "number" && isNaN(v)));
    const evs = r.events.map((e, i) => {
      const wait = MR.WAIT_EVENTS.has(e.event);
      const gap = i === 40 && r.dropped ? `<tr class="gap"><td colspan="4">… ${r.dropped} events dropped (buffer) …</td></tr>` : "";
      return gap + `<tr class="${wait ? "wait" : ""}" data-event="${esc(e.event)}"><td class="num">+${((Number(e.ts) - t0) * 1000).toFixed(3)} ms</td>` +
        `<td>${esc(e.actor || "?")}</td><td>${esc(e.event)}${wait ? " <b>← waited</b>" : ""}</td><td class="detail">${esc(m.detail(e))}</td></tr>`;
    }).join("");
    const html = `<div class="life-head" data-rid="${esc(r.rid)}" data-life-state="${r.state}"><b>${esc(r.rid)}</b>${r.replica ? " on " + esc(r.replica) : ""}` +
      `<span class="life-path">${esc(hist.join(" → "))}</span></div>` +
      `<dl>${facts.map(([k, v]) => `<dt>${esc(k)}</dt><dd data-fact="${esc(k)}">${esc(v)}</dd>`).join("")}</dl>` +
      MR.lifeSVG(r, now) +
      `<div class="legend"><span class="k waiting">waiting</span> <span class="k prefill">prefill</span> <span class="k decode">decode</span> <span class="k preempt">preempting</span></div>` +
      `<table class="life-events"><thead><tr><th>offset</th><th>actor</th><th>event</th><th>detail</th></tr></thead><tbody>${evs}</tbody></table>`;
    if (el.dataset.html !== html) { el.innerHTML = html; el.dataset.html = html; }
  };

  MR.renderTail = function (m) {
    const lines = m.tail.toArray().slice(-30).reverse().map((e) => {
      const d = new Date((Number(e.ts) || 0) * 1000);
      return `${d.toISOString().slice(11, 23)} ${(e.actor || "?").padEnd(10)} ${String(e.event).padEnd(22)} ${e.request_id ? "[" + String(e.request_id).slice(0, 12) + "] " : ""}${m.detail(e)}`;
    });
    $("tail").textContent = lines.join("\n");
  };

  MR.renderBuffers = function (m) {
    const b = m.bufferSizes(), c = b.caps;
    const el = $("buffers");
    el.dataset.json = JSON.stringify(b);
    el.textContent = `page buffers (bounded): requests ${b.requests}/${c.requests} · steps ${b.steps}/${c.steps} · ` +
      `KV samples ${b.kv}/${c.kv} · admissions ${b.hits}/${c.hits} · marks ${b.marks}/${c.marks} · ` +
      `events per request ≤ ${c.events_per_request} · ${m.counts.events} events seen`;
  };
})(window.MR = window.MR || {});
