/* minirt dashboard, the wiring: the event source (live SSE, or the events embedded by a static
 * export), batching in time order, the render loop, clicks. URL parameters: request=ID (open
 * its life), window_s=60 (chart span), refresh_ms=500 (render period), cap_NAME=N (buffer caps,
 * see MR.DEFAULT_CAPS). */
(function (MR) {
  "use strict";
  const params = new URLSearchParams(location.search);
  const embedded = document.getElementById("minirt-events");
  const exported = embedded ? JSON.parse(document.getElementById("minirt-export").textContent) : null;
  const caps = exported ? { requests: 20000, steps: 5000, kv: 20000, hits: 20000, marks: 5000 } : {};
  for (const k of Object.keys(MR.DEFAULT_CAPS)) {
    const v = parseInt(params.get("cap_" + k), 10);
    if (v > 0) caps[k] = Math.min(v, 1000000);
  }
  const model = new MR.Model(caps);
  const ui = { selected: params.get("request") || (exported && exported.focus) || null,
    windowS: Math.max(1, parseFloat(params.get("window_s")) || 60), offset: 0,
    refreshMs: Math.max(100, parseInt(params.get("refresh_ms"), 10) || 500),
    conn: { text: "connecting…", kind: "wait" }, lastTick: 0, rate: 0, loading: false };
  let pending = [], dirty = true, seenAt = [];
  MR.model = model; MR.ui = ui;
  MR.stats = () => Object.assign(model.bufferSizes(), { pending: pending.length,
    live: model.liveCounts(), conn: ui.conn.kind, renders: ui.renders || 0,
    render_ms: Math.round(ui.renderMs || 0) });

  // A finished or replayed run (its last event over 30 s old) is shown as of its last event.
  const clockNow = () => Date.now() / 1000 + ui.offset;
  const historic = () => !!exported || (model.lastTs !== null && clockNow() - model.lastTs > 30);
  const now = () => historic() ? (model.lastTs || 0) : clockNow();

  function flush() {
    if (!pending.length) return;
    pending.sort((a, b) => (Number(a.ts) || 0) - (Number(b.ts) || 0));
    for (const e of pending) model.apply(e);
    seenAt.push([Date.now(), pending.length]);
    pending = []; dirty = true;
  }
  function take(data) {  // one SSE message: {"src": FILE} then one event per line
    const lines = data.split("\n");
    let replica = "";
    try {  // events/NAME.jsonl, events/REPLICA/NAME.jsonl or REPLICA/events/NAME.jsonl
      const parts = String(JSON.parse(lines[0]).src || "").split("/");
      replica = parts[0] === "events" ? (parts.length === 3 ? parts[1] : "") : parts.length === 3 ? parts[0] : "";
    } catch (err) { return; }
    for (let i = 1; i < lines.length; i++) {
      let e; try { e = JSON.parse(lines[i]); } catch (err) { continue; }  // a torn line: skip
      if (replica && !e.replica) e.replica = replica;
      pending.push(e);
    }
    if (!ui.loading && pending.length > 20000) flush();
  }
  function clock(data) { try { ui.offset = JSON.parse(data).now - Date.now() / 1000; } catch (err) { /* keep */ } }

  function connect() {
    const es = new EventSource("dashboard/events");
    es.addEventListener("hello", (ev) => {
      model.reset(); pending = []; ui.loading = true; clock(ev.data);
      ui.conn = { text: "loading the log…", kind: "wait" }; dirty = true;
    });
    es.addEventListener("backlog", (ev) => take(ev.data));
    es.addEventListener("ready", (ev) => {
      clock(ev.data); ui.loading = false; flush(); ui.lastTick = Date.now();
      ui.conn = { text: "live", kind: "live" }; dirty = true;
    });
    es.addEventListener("events", (ev) => take(ev.data));
    es.addEventListener("tick", (ev) => { clock(ev.data); ui.lastTick = Date.now(); });
    es.onerror = () => { ui.conn = { text: "reconnecting…", kind: "down" }; dirty = true; };
    MR.source = es;
  }

  function render() {
    if (document.hidden && !exported) return;
    const start = performance.now();
    const t = now(), cutoff = Date.now() - 5000;
    seenAt = seenAt.filter(([at]) => at >= cutoff);
    ui.rate = seenAt.reduce((a, [, n]) => a + n, 0) / 5;
    if (ui.conn.kind === "live" && Date.now() - ui.lastTick > 5000) ui.conn = { text: "stalled (no tick for 5 s)", kind: "down" };
    else if (ui.conn.kind === "down" && ui.conn.text.startsWith("stalled") && Date.now() - ui.lastTick < 5000) ui.conn = { text: "live", kind: "live" };
    const showRep = model.replicas.size > 0;
    document.body.classList.toggle("replicas", showRep);
    const conn = !exported && ui.conn.kind === "live" && historic()
      ? { text: "live · idle: showing the log as of its last event", kind: "live" } : ui.conn;
    // the canvases first: reading their sizes after the DOM updates below would force a layout
    const t0 = exported ? (model.firstTs || 0) : Math.max(model.firstTs || 0, t - ui.windowS);
    MR.drawSteps(document.getElementById("c-steps"), model.steps.toArray(), 120);
    MR.drawKV(document.getElementById("c-kv"), model.kvSamples.toArray(), model.marks.toArray(), t0, t);
    MR.drawHits(document.getElementById("c-hits"), model.hits.toArray(), t0, t, 20);
    MR.renderHeader(model, conn, ui.rate);
    MR.renderWaiting(model, t, showRep);
    MR.renderRunning(model, t, showRep);
    MR.renderFinished(model, showRep);
    MR.renderStep(model);
    MR.renderKVNow(model);
    MR.renderHitNow(model);
    MR.renderLife(model, ui.selected, t);
    MR.renderTail(model);
    MR.renderBuffers(model);
    dirty = false;
    ui.renders = (ui.renders || 0) + 1;
    ui.renderMs = (ui.renderMs || 0) + (performance.now() - start);
  }
  MR.render = render;

  document.addEventListener("click", (ev) => {
    const row = ev.target.closest("[data-rid]");
    if (!row || row.classList.contains("life-head")) return;
    ui.selected = row.dataset.rid;
    const q = new URLSearchParams(location.search); q.set("request", ui.selected);
    if (!exported) history.replaceState(null, "", "?" + q.toString());
    render();
    document.getElementById("p-life").scrollIntoView({ block: "nearest" });
  });

  if (exported) {
    document.title = exported.title || document.title;
    ui.conn = { text: "static export · " + (exported.title || ""), kind: "static" };
    for (const e of JSON.parse(embedded.textContent)) pending.push(e);
    flush(); render();
    window.addEventListener("resize", render);
  } else {
    connect();
    setInterval(() => { if (!ui.loading) flush(); }, 100);
    setInterval(() => { if (dirty || !document.hidden) render(); }, ui.refreshMs);
  }
})(window.MR = window.MR || {});
