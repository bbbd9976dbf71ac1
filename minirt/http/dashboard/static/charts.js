/* minirt dashboard, the charts: plain canvas, no library. Each draw* takes a canvas and plain
 * arrays from the model and redraws it whole. */
(function (MR) {
  "use strict";
  const C = { prefill: "#e8833a", decode: "#3a7be8", step: "#222", outside: "#b03060",
    free: "#d9dde3", cached: "#7cc47f", inUse: "#3a7be8", held: "#6a8fd0", evict: "#e8a13a",
    preempt: "#d62828", hit: "#2a9d5c", rolling: "#8d5cc4", grid: "#eef0f3", text: "#555" };
  MR.COLORS = C;

  function setup(canvas) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 300, h = canvas.clientHeight || 120;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
    }
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    g.font = "11px system-ui, sans-serif";
    return { g, w, h };
  }
  function axisLabel(g, text, x, y, align) {
    g.fillStyle = C.text; g.textAlign = align || "left"; g.fillText(text, x, y);
  }
  function empty(g, w, h, text) { axisLabel(g, text, w / 2, h / 2, "center"); }

  // The step strip: one column per step in three lanes, each scaled to its own maximum:
  // prefill tokens, decode tokens, and time (whole step incl. control, and outside the forward).
  MR.drawSteps = function (canvas, steps, n) {
    const { g, w, h } = setup(canvas);
    const shown = steps.slice(-n);
    if (!shown.length) return empty(g, w, h, "no steps yet");
    const left = 52, right = w - 4, lane = (h - 6) / 3, bw = (right - left) / n;
    const X = (i) => left + (n - shown.length + i) * bw;
    const lanes = [
      ["prefill", (s) => s.prefill, C.prefill, (v) => v + " tok"],
      ["decode", (s) => s.decode, C.decode, (v) => v + " tok"],
      ["time", (s) => (s.stepS + s.control) * 1000, C.step, (v) => v.toFixed(1) + " ms"],
    ];
    lanes.forEach(([name, f, color, fmt], li) => {
      const top = 3 + li * lane, bottom = top + lane - 3;
      const max = Math.max(li === 2 ? 0.001 : 1, ...shown.map(f));
      g.fillStyle = C.grid; g.fillRect(left, top, right - left, bottom - top);
      shown.forEach((s, i) => {
        const v = f(s), hv = (v / max) * (bottom - top);
        if (v <= 0) return;
        g.fillStyle = color; g.fillRect(X(i), bottom - Math.max(1, hv), Math.max(1, bw - 0.5), Math.max(1, hv));
        if (li === 2) {  // the part outside the forward, over the step time
          const o = Math.max(0, s.stepS - s.forward + s.control) * 1000, ho = (o / max) * (bottom - top);
          g.fillStyle = C.outside; g.fillRect(X(i), bottom - ho, Math.max(1, bw - 0.5), ho);
        }
      });
      axisLabel(g, name, 2, top + 10);
      axisLabel(g, "≤ " + fmt(max), 2, top + 21);
    });
  };

  function timeAxis(g, t0, t1, left, right, bottom) {
    const span = t1 - t0;
    axisLabel(g, "-" + span.toFixed(span < 10 ? 1 : 0) + " s", left, bottom + 12);
    axisLabel(g, "now", right, bottom + 12, "right");
  }

  // The KV pool over time: in use / cached-only / free stacked (or held / free when the events
  // carry only the free count), evictions and preemptions marked along the top.
  MR.drawKV = function (canvas, samples, marks, t0, t1) {
    const { g, w, h } = setup(canvas);
    if (!samples.length) return empty(g, w, h, "no KV events yet");
    const top = 16, bottom = h - 16, left = 4, right = w - 4;
    const span = Math.max(1e-3, t1 - t0);
    const X = (ts) => left + ((ts - t0) / span) * (right - left);
    const total = Math.max(1, ...samples.map((s) => s.total));
    const Y = (v) => bottom - (v / total) * (bottom - top);
    g.fillStyle = C.free; g.fillRect(left, top, right - left, bottom - top);
    const band = (lo, hi, color) => {  // step-wise area between lo(s) and hi(s)
      const pts = [];
      samples.forEach((s, i) => {
        const next = samples[i + 1];
        const x0 = Math.max(left, X(s.ts)), x1 = Math.min(right, next ? X(next.ts) : right);
        if (x1 > left && x0 < right) pts.push([x0, x1, lo(s), hi(s)]);
      });
      if (!pts.length) return;
      g.fillStyle = color; g.beginPath(); g.moveTo(pts[0][0], Y(pts[0][2]));
      for (const [x0, x1, , hv] of pts) { g.lineTo(x0, Y(hv)); g.lineTo(x1, Y(hv)); }
      for (let i = pts.length - 1; i >= 0; i--) { g.lineTo(pts[i][1], Y(pts[i][2])); g.lineTo(pts[i][0], Y(pts[i][2])); }
      g.closePath(); g.fill();
    };
    const split = samples[samples.length - 1].inUse !== null;
    if (split) {
      band(() => 0, (s) => s.inUse || 0, C.inUse);
      band((s) => s.inUse || 0, (s) => (s.inUse || 0) + (s.cachedOnly || 0), C.cached);
    } else band(() => 0, (s) => s.held, C.held);
    marks.forEach((m) => {
      if (m.ts < t0) return;
      const x = X(m.ts);
      g.fillStyle = m.kind === "preempt" ? C.preempt : C.evict;
      g.beginPath();
      if (m.kind === "preempt") { g.moveTo(x - 4, 2); g.lineTo(x + 4, 2); g.lineTo(x, 11); }
      else g.rect(x - 1.5, 2, 3, 9);
      g.fill();
      if (m.kind === "preempt") { g.strokeStyle = C.preempt; g.beginPath(); g.moveTo(x, top); g.lineTo(x, bottom); g.stroke(); }
    });
    axisLabel(g, total + " blocks", left + 2, top + 11);
    timeAxis(g, t0, t1, left, right, bottom);
  };

  // Prefix cache: the cumulative hit rate (cached / prompt tokens at admission) and the rate over
  // the last `win` admissions, as lines; each admission a dot at its own rate.
  MR.drawHits = function (canvas, hits, t0, t1, win) {
    const { g, w, h } = setup(canvas);
    if (!hits.length) return empty(g, w, h, "no admissions yet");
    const top = 8, bottom = h - 16, left = 28, right = w - 4;
    const span = Math.max(1e-3, t1 - t0);
    const X = (ts) => left + ((ts - t0) / span) * (right - left);
    const Y = (v) => bottom - v * (bottom - top);
    [0, 0.5, 1].forEach((v) => { g.strokeStyle = C.grid; g.beginPath(); g.moveTo(left, Y(v)); g.lineTo(right, Y(v)); g.stroke(); axisLabel(g, (v * 100) + "%", 2, Y(v) + 4); });
    const vis = hits.filter((x) => x.ts >= t0);
    g.fillStyle = C.hit;
    vis.forEach((x) => { g.globalAlpha = 0.35; g.fillRect(X(x.ts) - 1.5, Y(x.prompt ? x.cached / x.prompt : 0) - 1.5, 3, 3); });
    g.globalAlpha = 1;
    const path = (vals, color) => {
      g.strokeStyle = color; g.lineWidth = 1.5; g.beginPath();
      vals.forEach(([ts, v], i) => { if (i) g.lineTo(X(ts), Y(v)); else g.moveTo(X(ts), Y(v)); });
      g.stroke();
    };
    path(vis.map((x) => [x.ts, x.rate]), C.hit);
    let c = 0, p = 0; const q = [];
    const roll = hits.map((x) => { q.push(x); c += x.cached; p += x.prompt; if (q.length > win) { const o = q.shift(); c -= o.cached; p -= o.prompt; } return [x.ts, p ? c / p : 0]; });
    path(roll.filter(([ts]) => ts >= t0), C.rolling);
    timeAxis(g, t0, t1, left, right, bottom);
  };

  // A request's life: one bar, a segment per state (waiting, prefill, decode, preempting).
  MR.lifeSVG = function (r, now) {
    const t0 = r.firstTs, t1 = Math.max(r.endTs || now, t0 + 1e-3), span = t1 - t0, W = 600;
    const colors = { received: "#c9ccd1", waiting: "#f2c14e", running: C.prefill, decode: C.decode,
      preempting: C.preempt };
    const segs = [];
    const hist = r.history.slice();
    if (r.prefillDoneTs) hist.push(["decode", r.prefillDoneTs]);
    hist.sort((a, b) => a[1] - b[1]);
    hist.forEach(([state, ts], i) => {
      const end = i + 1 < hist.length ? hist[i + 1][1] : (MR.TERMINAL.has(state) ? ts : t1);
      if (MR.TERMINAL.has(state) || end <= ts) return;
      const x = ((ts - t0) / span) * W, wd = Math.max(1, ((end - ts) / span) * W);
      segs.push(`<rect x="${x.toFixed(1)}" y="4" width="${wd.toFixed(1)}" height="18" fill="${colors[state] || "#999"}"><title>${state === "running" ? "prefill" : state} ${((end - ts) * 1000).toFixed(1)} ms</title></rect>`);
    });
    return `<svg viewBox="0 0 ${W} 26" preserveAspectRatio="none" class="life-bar">${segs.join("")}</svg>` +
      `<div class="life-scale"><span>0 ms</span><span>${(span * 1000).toFixed(1)} ms</span></div>`;
  };
})(window.MR = window.MR || {});
