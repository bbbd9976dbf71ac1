/* minirt dashboard, the model's views: the waiting queue in admission order, each request's
 * policy score and the reason it waits, buffer sizes. */
(function (MR) {
  "use strict";
  const P = MR.Model.prototype;
  const BASE = new Set(["ts", "actor", "event", "level", "request_id", "replica"]);

  P.liveCounts = function () {
    let waiting = 0, running = 0;
    for (const r of this.requests.values()) {
      if (r.state === "waiting") waiting++;
      else if (r.state === "running" || r.state === "preempting") running++;
    }
    return { waiting, running };
  };
  P.waitingOrder = function () {  // the order the scheduler's policy admits them in (front lane first)
    const policy = this.config.policy || "fcfs";
    const w = [];
    for (const r of this.requests.values()) if (r.state === "waiting") w.push(r);
    const key = (r) => policy === "sjf" ? (r.prompt || 0)
      : policy === "priority" ? (r.priority === null ? 0 : r.priority) : 0;
    w.sort((a, b) => (b.front - a.front) || (b.aged - a.aged) || (key(a) - key(b)) || (a.seq - b.seq));
    return w;
  };
  P.score = function (r) {
    const policy = this.config.policy || "fcfs";
    if (policy === "sjf") return { text: "prompt " + (r.prompt === null ? "?" : r.prompt), value: r.prompt };
    if (policy === "priority") return r.priority === null ? { text: "priority (not logged)", value: null }
      : { text: "priority " + r.priority, value: r.priority };
    if (policy === "lpm") return { text: "match (not logged)", value: null };
    return { text: "arrival #" + r.seq, value: r.seq };
  };
  P.whyWaiting = function (r, pos, head, running) {
    const parts = [];
    if (r.preemptions) parts.push("preempted ×" + r.preemptions + ", back in front");
    if (r.resumed) parts.push("resumed (" + r.resumed + "), back in front");
    if (r.deferredBehind) {
      parts.push("deferred behind " + r.deferredBehind.slice(0, 12) + " (shares " + r.deferTokens + " prefix tokens)");
      return { kind: "deferred", text: parts.join("; ") };
    }
    const f = r.lastRefusal;
    if (f && f.ts >= (r.waitSince || 0)) {
      parts.push("refused: needs " + f.needed + " blocks, " + f.free + " free + " + f.evictable +
        " evictable" + (f.running !== null && f.running !== undefined ? ", " + f.running + " running" : ""));
      return { kind: "refused", text: parts.join("; ") };
    }
    const max = this.config.max_batch_size;
    if (max && running >= max) {
      parts.push("batch full (" + running + "/" + max + " running)");
      return { kind: "batch_full", text: parts.join("; ") };
    }
    if (r.aged) parts.push("aged past max_wait_s: goes first");
    if (pos === 0) parts.push("next in line");
    else if (head && head.lastRefusal && head.lastRefusal.ts >= (head.waitSince || 0)) {
      parts.push("behind " + head.rid.slice(0, 12) + ", which waits for KV blocks");
    } else parts.push("behind " + pos + " earlier (" + (this.config.policy || "fcfs") + ")");
    return { kind: "queued", text: parts.join("; ") };
  };
  P.detail = function (e) {
    return Object.keys(e).filter((k) => !BASE.has(k))
      .map((k) => {  // long values (block hash lists) cut short: the full event is in the log
        const s = typeof e[k] === "string" ? e[k] : JSON.stringify(e[k]);
        return k + "=" + (s.length > 160 ? s.slice(0, 157) + "…" : s);
      }).join(" ");
  };
  P.bufferSizes = function () {
    let perRequestMax = 0;
    for (const r of this.requests.values()) perRequestMax = Math.max(perRequestMax, r.events.length);
    return { requests: this.requests.size, finished_order: this.finishedOrder.length,
      by_client: this.byClient.size, http_early: this.httpEarly.size, gone: this.gone.size,
      steps: this.steps.length, kv: this.kvSamples.length, hits: this.hits.length,
      marks: this.marks.length, tail: this.tail.length, events_per_request_max: perRequestMax,
      caps: this.caps };
  };
})(window.MR = window.MR || {});
