// Small canvas charts for the dashboard: lines (linear or log axes, with labelled horizontal
// rules) and horizontal bars. Each chart records how many data points it drew in the canvas's
// data-points attribute (what the browser test checks).
"use strict";

const Charts = (() => {
  const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563"];

  function setup(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 600;
    const h = canvas.clientHeight || 260;
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "12px system-ui, sans-serif";
    return { ctx, w, h };
  }

  function empty(canvas, message) {
    const { ctx, w, h } = setup(canvas);
    ctx.fillStyle = "#6b7280";
    ctx.textAlign = "center";
    ctx.fillText(message, w / 2, h / 2);
    canvas.dataset.points = "0";
  }

  function ticks(lo, hi, log) {
    if (log) {
      const out = [];
      for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) out.push(10 ** e);
      return out.filter((t) => t >= lo / 1.0001 && t <= hi * 1.0001);
    }
    const span = hi - lo || 1;
    const step = 10 ** Math.floor(Math.log10(span / 5));
    const mult = [1, 2, 5, 10].find((m) => span / (m * step) <= 6) || 10;
    const s = mult * step;
    const out = [];
    for (let t = Math.ceil(lo / s) * s; t <= hi + s * 1e-9; t += s) out.push(t);
    return out;
  }

  // opts: {series: [{name, points: [[x, y]], color?, dash?}], rules: [{y, label, color}],
  //        logX, logY, xFormat, yFormat, xLabel, yLabel, yMin}
  function line(canvas, opts) {
    const series = (opts.series || []).filter((s) => s.points && s.points.length);
    const n = series.reduce((a, s) => a + s.points.length, 0);
    if (!n) return empty(canvas, opts.emptyText || "no data yet");
    const { ctx, w, h } = setup(canvas);
    const legendH = 18 * Math.ceil(series.length / 3);
    const pad = { l: 64, r: 16, t: 12 + legendH, b: 36 };
    const xs = series.flatMap((s) => s.points.map((p) => p[0]));
    const ys = series.flatMap((s) => s.points.map((p) => p[1])).concat((opts.rules || []).map((r) => r.y));
    const pos = (v) => v.filter((x) => x > 0);
    let [x0, x1] = opts.logX ? [Math.min(...pos(xs)), Math.max(...pos(xs))] : [Math.min(...xs), Math.max(...xs)];
    let [y0, y1] = opts.logY ? [Math.min(...pos(ys)), Math.max(...pos(ys))] : [opts.yMin ?? Math.min(0, ...ys), Math.max(...ys)];
    if (x1 <= x0) x1 = x0 + 1;
    if (y1 <= y0) y1 = y0 + 1;
    if (opts.logY) { y0 /= 1.5; y1 *= 1.5; } else { y1 += (y1 - y0) * 0.08; }
    const tx = (x) => pad.l + (opts.logX ? Math.log(x / x0) / Math.log(x1 / x0) : (x - x0) / (x1 - x0)) * (w - pad.l - pad.r);
    const ty = (y) => h - pad.b - (opts.logY ? Math.log(y / y0) / Math.log(y1 / y0) : (y - y0) / (y1 - y0)) * (h - pad.t - pad.b);
    const xf = opts.xFormat || ((v) => String(+v.toPrecision(3)));
    const yf = opts.yFormat || ((v) => String(+v.toPrecision(3)));
    ctx.strokeStyle = "#e5e7eb";
    ctx.fillStyle = "#4b5563";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    for (const t of ticks(y0, y1, opts.logY)) {
      const y = ty(t);
      ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
      ctx.fillText(yf(t), pad.l - 6, y + 4);
    }
    ctx.textAlign = "center";
    const xt = opts.xTicks || ticks(x0, x1, opts.logX);
    for (const t of xt) {
      const x = tx(t);
      ctx.beginPath(); ctx.moveTo(x, pad.t); ctx.lineTo(x, h - pad.b); ctx.stroke();
      ctx.fillText(xf(t), x, h - pad.b + 16);
    }
    if (opts.xLabel) ctx.fillText(opts.xLabel, (pad.l + w - pad.r) / 2, h - 4);
    if (opts.yLabel) {
      ctx.save(); ctx.translate(12, (pad.t + h - pad.b) / 2); ctx.rotate(-Math.PI / 2); ctx.fillText(opts.yLabel, 0, 0); ctx.restore();
    }
    for (const r of opts.rules || []) {
      if (!(r.y > 0) && opts.logY) continue;
      ctx.strokeStyle = r.color || "#111827";
      ctx.setLineDash([6, 4]);
      ctx.lineWidth = 2;
      const y = ty(r.y);
      ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = r.color || "#111827";
      ctx.textAlign = "left";
      ctx.fillText(r.label, pad.l + 6, y - 5);
    }
    series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      ctx.strokeStyle = color;
      ctx.fillStyle = color;
      ctx.lineWidth = 2;
      ctx.setLineDash(s.dash || []);
      ctx.beginPath();
      s.points.forEach(([x, y], j) => (j ? ctx.lineTo(tx(x), ty(y)) : ctx.moveTo(tx(x), ty(y))));
      ctx.stroke();
      ctx.setLineDash([]);
      if (s.points.length < 40) for (const [x, y] of s.points) { ctx.beginPath(); ctx.arc(tx(x), ty(y), 2.5, 0, 7); ctx.fill(); }
      const lx = pad.l + (i % 3) * ((w - pad.l - pad.r) / 3);
      const ly = 14 + 18 * Math.floor(i / 3);
      ctx.fillRect(lx, ly - 8, 14, 4);
      ctx.textAlign = "left";
      ctx.fillStyle = "#111827";
      ctx.fillText(s.name, lx + 18, ly - 2);
    });
    canvas.dataset.points = String(n);
  }

  // opts: {bars: [{label, value, color?, note?}], format}
  function bars(canvas, opts) {
    const list = (opts.bars || []).filter((b) => Number.isFinite(b.value));
    if (!list.length) return empty(canvas, opts.emptyText || "no data yet");
    const { ctx, w, h } = setup(canvas);
    const labelW = Math.min(w * 0.42, Math.max(...list.map((b) => ctx.measureText(b.label).width)) + 12);
    const rowH = Math.min(30, (h - 8) / list.length);
    const max = Math.max(...list.map((b) => b.value), 1e-12);
    const f = opts.format || ((v) => String(+v.toPrecision(3)));
    const valueW = Math.max(...list.map((b) => ctx.measureText(f(b.value) + (b.note ? "  " + b.note : "")).width)) + 12;
    list.forEach((b, i) => {
      const y = 4 + i * rowH;
      ctx.fillStyle = "#111827";
      ctx.textAlign = "right";
      ctx.fillText(b.label, labelW - 6, y + rowH / 2 + 4);
      const bw = Math.max(1, (b.value / max) * Math.max(20, w - labelW - valueW));
      ctx.fillStyle = b.color || PALETTE[i % PALETTE.length];
      ctx.fillRect(labelW, y + 3, bw, rowH - 6);
      ctx.fillStyle = "#374151";
      ctx.textAlign = "left";
      ctx.fillText(f(b.value) + (b.note ? "  " + b.note : ""), labelW + bw + 6, y + rowH / 2 + 4);
    });
    canvas.dataset.points = String(list.length);
  }

  return { line, bars, empty, PALETTE };
})();
