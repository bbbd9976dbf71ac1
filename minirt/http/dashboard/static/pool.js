/* minirt dashboard, the model's KV pool and step strip: block counts over time (free, and
 * in use / cached-only when the KV manager's events carry them), evictions, steps. */
(function (MR) {
  "use strict";
  const P = MR.Model.prototype;

  P.kvOf = function (e) {
    const key = e.replica || "";
    let k = this.kv.get(key);
    if (!k) { k = { total: 0, blockSize: 0, free: null, inUse: null, cachedOnly: null }; this.kv.set(key, k); }
    return k;
  };
  P.kvSample = function (ts, e) {
    const k = this.kvOf(e);
    if (e.in_use !== undefined) k.inUse = Number(e.in_use);
    if (e.cached_only !== undefined) k.cachedOnly = Number(e.cached_only);
    else if (k.inUse !== null && k.free !== null) k.cachedOnly = Math.max(0, k.total - k.free - k.inUse);
    let total = 0, free = 0, inUse = 0, cachedOnly = 0, split = true;
    for (const v of this.kv.values()) {
      total += v.total; free += v.free === null ? v.total : v.free;
      if (v.inUse === null) split = false; else { inUse += v.inUse; cachedOnly += v.cachedOnly || 0; }
    }
    this.kvSamples.push({ ts, total, free, held: total - free, inUse: split ? inUse : null,
      cachedOnly: split ? cachedOnly : null });
  };

  P.kvConfig = function (e, r, ts) {
    const k = this.kvOf(e);
    k.total = Number(e.num_blocks) || 0; k.blockSize = Number(e.block_size) || 0;
    k.free = k.total; k.inUse = e.in_use === undefined ? null : 0; k.cachedOnly = null;
    let total = 0;  // every replica's pool, summed
    for (const v of this.kv.values()) total += v.total;
    this.config.num_blocks = total; this.config.block_size = k.blockSize;
    this.kvSample(ts, e);
  };
  P.kvAllocated = function (e, r, ts) {
    const k = this.kvOf(e); if (e.free !== undefined) k.free = Number(e.free);
    this.kvSample(ts, e);
  };
  P.kvExtended = function (e, r, ts) {
    const k = this.kvOf(e);
    if (e.free !== undefined) k.free = Number(e.free);
    else if (k.free !== null) k.free -= Array.isArray(e.blocks) ? e.blocks.length : Number(e.blocks) || 0;
    this.kvSample(ts, e);
  };
  P.kvEvicted = function (e, r, ts) {
    const n = Array.isArray(e.blocks) ? e.blocks.length : Number(e.blocks) || 0;
    const k = this.kvOf(e); if (k.free !== null && e.free === undefined) k.free += n;
    this.counts.evictions += n;
    this.marks.push({ ts, kind: "evict", n, rid: e.request_id || "" });
  };
  P.kvReleased = function (e, r, ts) {
    const k = this.kvOf(e); if (e.free !== undefined) k.free = Number(e.free);
    this.kvSample(ts, e);
  };
  P.kvShortage = function (e, r) { if (r) r.shortage = { needed: e.blocks_needed, free: e.blocks_free, evictable: e.blocks_evictable }; }
  P.kvReset = function (e, r, ts) {  // every request's blocks were dropped
    const k = this.kvOf(e);
    if (e.free !== undefined) k.free = Number(e.free);
    if (k.inUse !== null) k.inUse = 0;
    this.kvSample(ts, e);
  };
  P.kvDiskTier = function (e) {
    this.disk = { capacity: Number(e.capacity) || 0, bytes: Number(e.bytes) || 0, loadedTokens: 0, bad: 0 };
  };
  P.kvDisk = function (e) { if (this.disk && e.disk_bytes !== undefined) this.disk.bytes = Number(e.disk_bytes); };
  P.kvDiskDropped = function (e) { if (this.disk) this.disk.bad += Number(e.blocks) || 0; };
  P.step = function (e, r, ts) {
    this.steps.push({ ts, step: e.step, requests: Number(e.requests) || 0,
      prefill: Number(e.prefill_tokens) || 0, decode: Number(e.decode_tokens) || 0,
      skipped: Number(e.skipped) || 0, forward: Number(e.forward_s) || 0,
      stepS: Number(e.step_s) || 0, control: Number(e.control_s) || 0, replica: e.replica || "",
      specK: e.spec_k === undefined ? null : Number(e.spec_k),
      specDrafted: Number(e.spec_draft_tokens) || 0, specAccepted: Number(e.spec_accepted) || 0,
      specOff: e.spec_off || "", specWhy: e.spec_why || null, loras: Number(e.loras) || 0 });
    if (e.spec_k !== undefined) {  // the executor speculates (--speculative-config)
      const s = this.spec || (this.spec = { drafted: 0, accepted: 0 });
      s.drafted += Number(e.spec_draft_tokens) || 0; s.accepted += Number(e.spec_accepted) || 0;
      const explored = new Set(e.spec_explore || []);
      for (const [rid, d, a] of e.spec || []) {  // each request's own acceptance
        const q = this.req(rid, e);  // (the executor's log may be read before the front door's)
        q.specDrafted = (q.specDrafted || 0) + (Number(d) || 0);
        q.specAccepted = (q.specAccepted || 0) + (Number(a) || 0);
        if (explored.has(rid)) q.specExplored = (q.specExplored || 0) + 1;
      }
    }
  };
  // the executor's resident LoRA adapters (--enable-lora): loaded, evicted
  P.loraLoaded = function (e) {
    const m = this.loras || (this.loras = new Map());
    m.set((e.replica || "") + "/" + e.digest,
      { name: String(e.lora), rank: Number(e.rank) || 0, replica: e.replica || "" });
  };
  P.loraEvicted = function (e) { if (this.loras) this.loras.delete((e.replica || "") + "/" + e.digest); };
})(window.MR = window.MR || {});
