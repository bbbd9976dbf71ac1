/* minirt dashboard, the model: folds the runtime's events into bounded state. No DOM here
 * (pool.js adds the KV pool and step handlers, views.js what the panels ask of it).
 * Every event the page understands is named once, in EVENTS: an upstream rename is a one-line
 * change there. Every buffer is bounded (caps below; the page's URL can lower or raise them). */
(function (MR) {
  "use strict";

  // event name (as the actors write it: one name, one actor) -> handler below
  MR.EVENTS = {
    "scheduler.config": "schedConfig",      // scheduler
    "request.queued": "queued",
    "request.resumed": "resumed",           // resubmitted by the front door after an actor died
    "admission.refused": "refused",         // the scheduler's record of a refusal (counted)
    "request.deferred": "deferred",
    "request.aged": "aged",
    "request.admitted": "admitted",
    "request.preempted": "preempted",
    "request.requeued": "requeued",
    "request.finished": "finished",
    "request.aborted": "aborted",
    "request.failed": "failed",
    "request.overloaded": "overloaded",
    "scheduler.reset": "schedReset",
    "kv.config": "kvConfig",                // KV manager
    "kv.refused": "kvRefused",              // its numbers behind a refusal
    "prefix.matched": "prefixMatched",
    "kv.allocated": "kvAllocated",
    "kv.extended": "kvExtended",
    "kv.evicted": "kvEvicted",
    "kv.released": "kvReleased",
    "kv.shortage": "kvShortage",
    "kv.reset": "kvReset",
    "kv.disk_tier": "kvDiskTier",           // its disk tier (--kv-disk-dir)
    "kv.disk_spill": "kvDisk",
    "kv.disk_saved": "kvDisk",
    "kv.disk_evicted": "kvDisk",
    "kv.disk_dropped": "kvDiskDropped",
    "executor.config": "execConfig",        // executor
    "executor.running": "running",
    "executor.prefill_done": "prefillDone",
    "executor.step": "step",
    "executor.rejected": "rejected",
    "executor.lora_loaded": "loraLoaded",
    "executor.lora_evicted": "loraEvicted",
    "client.received": "received",          // tokenizer (front door)
    "client.completed": "completed",
    "client.aborted": "aborted",
    "client.failed": "failed",
    "client.rejected": "rejected",
    "peer.suspect": "peerSuspect",          // every actor, of a peer: liveness
    "peer.cleared": "peerCleared",
    "peer.dead": "peerDead",
    "peer.alive": "peerAlive",
  };
  // events that explain a wait (the request's life marks them, as `minirt trace` does)
  MR.WAIT_EVENTS = new Set(["admission.refused", "kv.refused", "request.preempted",
    "request.requeued", "kv.shortage", "request.deferred"]);
  const TERMINAL = new Set(["finished", "aborted", "failed", "rejected"]);

  MR.DEFAULT_CAPS = { requests: 2000, events_per_request: 300, steps: 600, kv: 2000,
    hits: 2000, marks: 500, tail: 100, finished_shown: 50, waiting_shown: 100 };

  class Ring {
    constructor(cap) { this.cap = Math.max(1, cap); this.a = []; this.start = 0; }
    push(x) {
      if (this.a.length < this.cap) this.a.push(x);
      else { this.a[this.start] = x; this.start = (this.start + 1) % this.cap; }
    }
    get length() { return this.a.length; }
    last() { return this.a.length ? this.a[(this.start + this.a.length - 1) % this.a.length] : null; }
    toArray() { return this.a.slice(this.start).concat(this.a.slice(0, this.start)); }
  }
  MR.Ring = Ring;

  class Model {
    constructor(caps) {
      this.caps = Object.assign({}, MR.DEFAULT_CAPS, caps || {});
      this.reset();
    }
    reset() {
      const c = this.caps;
      this.requests = new Map();   // rid -> record, insertion (arrival) order
      this.byClient = new Map();   // the client's own id -> rid (for the HTTP leg's events)
      this.httpEarly = new Map();  // HTTP events seen before their request's first event
      this.finishedOrder = [];     // rids in the order they ended: evicted first
      this.gone = new Set();       // recently evicted rids: their late events make no ghost
      this.steps = new Ring(c.steps);
      this.kvSamples = new Ring(c.kv);
      this.marks = new Ring(c.marks);   // evictions and preemptions, for the KV chart
      this.hits = new Ring(c.hits);     // one per admission: cached vs prompt tokens
      this.tail = new Ring(c.tail);     // the latest raw events
      this.disk = null;                 // the disk tier: {capacity, bytes, loadedTokens, bad}
      this.spec = null;                 // speculative decoding so far: {drafted, accepted}
      this.loras = null;                // LoRA adapters resident: "replica/digest" -> {name, rank}
      this.kv = new Map();              // replica -> {total, blockSize, free, inUse, cachedOnly}
      this.config = {};
      this.sched = { running: 0, waiting: 0 };
      this.replicas = new Set();
      this.actors = new Map();          // "replica/actor" -> what its peers say of it (peerState)
      this.hitTokens = 0; this.queriedTokens = 0;
      this.counts = { events: 0, finished: 0, failed: 0, refusals: 0, preemptions: 0, evictions: 0 };
      this.firstTs = null; this.lastTs = null; this.seq = 0;
    }

    apply(e) {
      if (!e || typeof e !== "object" || typeof e.event !== "string") return;
      const ts = Number(e.ts) || 0;
      if (this.firstTs === null || ts < this.firstTs) this.firstTs = ts;
      if (this.lastTs === null || ts > this.lastTs) this.lastTs = ts;
      if (e.replica) this.replicas.add(String(e.replica));
      this.counts.events++;
      this.tail.push(e);
      const name = MR.EVENTS[e.event];
      const rid = e.request_id || null;
      if (rid && e.event.startsWith("http.")) { this.httpEvent(e, String(rid)); return; }
      const r = rid && !this.gone.has(rid) ? this.req(rid, e) : null;
      if (r) this.note(r, e);
      if (e.for_request && e.for_request !== rid && this.requests.has(e.for_request)) {
        this.note(this.requests.get(e.for_request), e);
      }
      if (name && this[name]) this[name](e, r, ts);
    }

    req(rid, e) {
      let r = this.requests.get(rid);
      if (!r) {
        const at = rid.lastIndexOf("@");  // runtime-wide ids are CLIENT_ID@CONNECTION
        r = { rid, clientId: at > 0 ? rid.slice(0, at) : rid, replica: e.replica || "", seq: ++this.seq, state: "received", stateTs: 0,
          firstTs: Number(e.ts) || 0, waitSince: null, prompt: null, priority: null,
          attempt: 0, refusals: 0, lastRefusal: null, deferredBehind: null, deferTokens: 0,
          aged: false, preemptions: 0, generated: 0, cached: null, admitPrompt: null,
          admittedTs: null, prefillDoneTs: null, ttft: null, endTs: null, finishReason: null,
          outputTokens: null, usage: null, timings: null, error: null, front: false,
          events: [], dropped: 0, history: [] };
        this.requests.set(rid, r);
        this.byClient.set(r.clientId, rid);
        const early = this.httpEarly.get(r.clientId);
        if (early) { this.httpEarly.delete(r.clientId); for (const h of early) this.note(r, h); }
        this.evict();
      }
      if (e.replica && !r.replica) r.replica = String(e.replica);
      return r;
    }

    httpEvent(e, id) {  // the HTTP leg: ids are the client's own (X-Request-Id)
      const rid = this.byClient.get(id);
      const r = rid && this.requests.get(rid);
      if (r) { this.note(r, e); return; }
      const early = this.httpEarly.get(id) || [];
      if (early.length < 8) early.push(e);
      this.httpEarly.set(id, early);
      while (this.httpEarly.size > 1000) this.httpEarly.delete(this.httpEarly.keys().next().value);
    }

    note(r, e) {  // the request's own event list: the first 40 and the latest, bounded
      const cap = this.caps.events_per_request;
      if (r.events.length < cap) { r.events.push(e); return; }
      r.events.splice(40, 1); r.events.push(e); r.dropped++;
    }

    evict() {
      const cap = this.caps.requests;
      const drop = (rid) => {
        const r = this.requests.get(rid);
        if (r && this.byClient.get(r.clientId) === rid) this.byClient.delete(r.clientId);
        this.requests.delete(rid);
        this.gone.add(rid);
        if (this.gone.size > cap) this.gone.delete(this.gone.values().next().value);
      };
      while (this.requests.size > cap && this.finishedOrder.length) drop(this.finishedOrder.shift());
      while (this.requests.size > cap) drop(this.requests.keys().next().value);  // only live ones left
      if (this.finishedOrder.length > 2 * cap) {
        this.finishedOrder = this.finishedOrder.filter((rid) => this.requests.has(rid));
      }
    }

    setState(r, state, ts) {
      if (TERMINAL.has(r.state) && !TERMINAL.has(state)) return;  // a late event of an ended request
      if (!TERMINAL.has(state) && ts < r.stateTs) return;         // arrived out of order
      if (TERMINAL.has(r.state) && TERMINAL.has(state)) return;   // the first end wins
      r.state = state; r.stateTs = ts;
      if (r.history.length < 64) r.history.push([state, ts]);
      else r.history[r.history.length - 1] = [state, ts];
      if (TERMINAL.has(state)) { r.endTs = ts; this.finishedOrder.push(r.rid); }
    }

    // ------------------------------------------------------------------ handlers
    configure(e, keys) { for (const k of keys) if (e[k] !== undefined && e[k] !== null) this.config[k] = e[k]; }
    schedConfig(e) { this.configure(e, ["policy", "max_batch_size", "max_waiting", "max_wait_s", "kv_mode", "block_size"]); }
    execConfig(e) { this.configure(e, ["chunk_cap", "step_budget", "device", "dtype", "model"]); }
    received(e, r, ts) { if (r) this.setState(r, "received", ts); }
    queued(e, r, ts) {
      if (!r) return;
      r.prompt = Number(e.prompt_tokens);
      if (e.priority !== undefined) r.priority = Number(e.priority);
      r.waitSince = ts; this.setState(r, "waiting", ts);
      this.sched.waiting = Number(e.waiting) || 0; this.sched.running = Number(e.running) || 0;
    }
    kvRefused(e, r, ts) {
      if (!r) return;
      const prev = r.lastRefusal && ts - r.lastRefusal.ts < 1 ? r.lastRefusal : null;
      r.lastRefusal = { needed: e.blocks_needed, free: e.blocks_free, evictable: e.blocks_evictable,
        reason: e.reason || "", fatal: !!e.fatal, ts, running: prev ? prev.running : null };
      r.deferredBehind = null;
    }
    refused(e, r, ts) {
      if (!r) return;
      this.kvRefused(e, r, ts);
      if (e.running !== undefined) { r.lastRefusal.running = Number(e.running); this.sched.running = Number(e.running); }
      r.refusals++; this.counts.refusals++;
      if (r.state !== "waiting") this.setState(r, "waiting", ts);
    }
    resumed(e, r) {
      if (!r) return;
      r.front = true; r.resumed = e.reason || "resumed";
      r.generated = Number(e.output_tokens) || 0;
    }
    deferred(e, r, ts) {
      if (!r) return;
      r.deferredBehind = e.prefix_of || "?"; r.deferTokens = Number(e.prefix_tokens) || 0;
      this.setState(r, "waiting", ts);
    }
    aged(e, r) { if (r) r.aged = true; }
    admitted(e, r, ts) {
      if (!r) return;
      r.attempt = Number(e.attempt) || r.attempt + 1;
      r.cached = Number(e.cached_tokens) || 0; r.admittedTs = ts; r.deferredBehind = null;
      r.admitPrompt = (r.prompt || 0) + r.generated;
      if (e.running !== undefined) this.sched.running = Number(e.running);
      this.setState(r, "running", ts);
      this.hitTokens += r.cached; this.queriedTokens += r.admitPrompt;
      this.hits.push({ ts, rid: r.rid, cached: r.cached, prompt: r.admitPrompt,
        rate: this.queriedTokens ? this.hitTokens / this.queriedTokens : 0 });
    }
    prefixMatched(e, r) {
      if (r && r.cached === null) r.cached = Number(e.cached_tokens) || 0;
      if (this.disk && e.disk_tokens) this.disk.loadedTokens += Number(e.disk_tokens) || 0;
    }
    running(e, r, ts) {
      if (!r) return;
      if (r.prompt === null && e.prompt_tokens !== undefined) r.prompt = Number(e.prompt_tokens) - r.generated;
      if (r.cached === null) r.cached = Number(e.cached_tokens) || 0;
      r.runningTs = ts; r.prefillDoneTs = null;
    }
    prefillDone(e, r, ts) { if (r) { r.prefillDoneTs = ts; if (r.ttft === null) r.ttft = Number(e.ttft_s); } }
    preempted(e, r, ts) {
      if (!r) return;
      this.counts.preemptions++;
      this.marks.push({ ts, kind: "preempt", n: 1, rid: r.rid, for: e.for_request });
      this.setState(r, "preempting", ts);
    }
    requeued(e, r, ts) {
      if (!r) return;
      r.preemptions = Number(e.preemptions) || r.preemptions + 1;
      r.generated = Number(e.generated) || 0; r.waitSince = ts; r.front = true; r.lastRefusal = null;
      this.setState(r, "waiting", ts);
    }
    finished(e, r, ts) {
      if (!r) return;
      r.finishReason = e.finish_reason || r.finishReason; r.outputTokens = Number(e.output_tokens);
      if (r.state !== "finished") this.counts.finished++;
      this.setState(r, "finished", ts);
    }
    completed(e, r, ts) {
      if (!r) return;
      r.usage = e.usage || null; r.timings = e.timings || null;
      r.finishReason = e.finish_reason || r.finishReason;
      if (r.usage) {
        if (r.usage.cached_tokens !== undefined) r.cached = Number(r.usage.cached_tokens);
        if (r.prompt === null) r.prompt = Number(r.usage.prompt_tokens);
        r.outputTokens = Number(r.usage.completion_tokens);
      }
      if (!TERMINAL.has(r.state)) this.counts.finished++;
      this.setState(r, e.finish_reason === "abort" ? "aborted" : "finished", ts);
    }
    aborted(e, r, ts) { if (r) { r.error = r.error || ("aborted: " + (e.reason || "")); this.setState(r, "aborted", ts); } }
    failed(e, r, ts) {
      if (!r) return; r.error = (e.code ? e.code + ": " : "") + (e.reason || "");
      if (!TERMINAL.has(r.state)) this.counts.failed++;
      this.setState(r, "failed", ts);
    }
    rejected(e, r, ts) {
      if (!r) return; r.error = "rejected" + (e.field ? " (" + e.field + ")" : "") + ": " + (e.reason || "");
      if (!TERMINAL.has(r.state)) this.counts.failed++;
      this.setState(r, "rejected", ts);
    }
    overloaded(e, r, ts) { if (r) { r.error = "overloaded: " + e.waiting + " waiting"; this.setState(r, "failed", ts); } }
    schedReset(e) { this.sched.running = 0; this.sched.waiting = 0; }
    // liveness, as the peers report it: suspect while any peer finds it silent (slow, starved,
    // stopped: requests wait), dead once one saw its process exit, alive again when it answers
    peer(e) {
      const key = (e.replica || "") + "/" + e.peer;
      let a = this.actors.get(key);
      if (!a) { a = { name: String(e.peer), replica: e.replica || "", state: "alive", by: new Set(), silentS: 0, reason: "", ts: 0 }; this.actors.set(key, a); }
      return a;
    }
    peerSuspect(e, r, ts) {
      const a = this.peer(e);
      if (a.state === "dead") return;
      a.by.add(e.actor); a.silentS = Math.max(a.silentS, Number(e.silent_s) || 0);
      if (a.state !== "suspect") { a.state = "suspect"; a.ts = ts; }
    }
    peerCleared(e, r, ts) {
      const a = this.peer(e);
      a.by.delete(e.actor);
      if (a.state === "suspect" && !a.by.size) { a.state = "alive"; a.silentS = 0; a.ts = ts; }
    }
    peerDead(e, r, ts) { const a = this.peer(e); a.state = "dead"; a.reason = e.reason || ""; a.by.clear(); a.ts = ts; }
    peerAlive(e, r, ts) {
      const a = this.peer(e);
      a.by.delete(e.actor);
      if (a.state === "dead" || !a.by.size) { a.state = "alive"; a.silentS = 0; a.reason = ""; a.ts = ts; }
    }
  }
  MR.Model = Model;
  MR.TERMINAL = TERMINAL;
})(window.MR = window.MR || {});
