// A train job's page: the loss and samples/s of every step over the steps trained, and its
// checkpoints. The curve as the page was rendered comes in the page (#train-data, JSON);
// the events job.js reads afterwards ("pp:events") extend it while the job runs.
"use strict";

(() => {
  const COLOURS = { loss: "#4C72B0", rate: "#DD8452", checkpoint: "#6b7280" };
  const box = document.getElementById("loss-chart");
  const summary = document.getElementById("train-summary");
  const initial = JSON.parse(document.getElementById("train-data").textContent || "{}");

  const points = new Map(); // step -> [loss, samples/s]; a step reported again: the latest
  const checkpoints = [];
  let after = Number.isFinite(initial.after) ? initial.after : -1;
  let total = null; // the steps asked for (null: epochs, or the default)
  let chart = null;

  (initial.steps || []).forEach((step, i) => {
    points.set(step, [initial.loss[i], initial.samples_per_s[i]]);
  });
  checkpoints.push(...(initial.checkpoints || []));

  function add(events) {
    for (const e of events) {
      if (e.seq <= after) continue; // in the page already
      after = e.seq;
      const d = e.data || {};
      if (!Number.isInteger(d.step)) continue;
      if (e.type === "checkpoint") checkpoints.push(d.step);
      else if (e.type === "progress") {
        points.set(d.step, [pp.finite(d.loss) ? d.loss : null,
          pp.finite(d.samples_per_s) ? d.samples_per_s : null]);
      }
    }
  }

  function data() {
    const steps = [...points.keys()].sort((a, b) => a - b);
    return [steps, steps.map((s) => points.get(s)[0]), steps.map((s) => points.get(s)[1])];
  }

  // A dashed vertical line at each step a checkpoint was taken after.
  function markCheckpoints(u) {
    const ctx = u.ctx;
    ctx.save();
    ctx.strokeStyle = COLOURS.checkpoint;
    ctx.lineWidth = 1;
    ctx.setLineDash([4, 4]);
    for (const step of checkpoints) {
      const x = u.valToPos(step, "x", true);
      ctx.beginPath();
      ctx.moveTo(x, u.bbox.top);
      ctx.lineTo(x, u.bbox.top + u.bbox.height);
      ctx.stroke();
    }
    ctx.restore();
  }

  function makeChart(d) {
    const opts = {
      width: Math.max(320, box.clientWidth),
      height: 320,
      scales: { x: { time: false }, loss: {}, rate: {} },
      axes: [
        { label: "steps trained" },
        { label: "loss", scale: "loss", size: 70 },
        { label: "samples/s", scale: "rate", side: 1, size: 70, grid: { show: false } },
      ],
      series: [
        { label: "step" },
        { label: "loss", scale: "loss", stroke: COLOURS.loss, width: 2, spanGaps: true },
        { label: "samples/s", scale: "rate", stroke: COLOURS.rate, width: 1.5, spanGaps: true },
      ],
      hooks: { draw: [markCheckpoints] },
    };
    box.replaceChildren();
    return new uPlot(opts, d, box);
  }

  function fmt(x, digits) {
    return pp.finite(x) ? x.toLocaleString(undefined, { maximumFractionDigits: digits }) : "-";
  }

  function render() {
    const d = data();
    const n = d[0].length;
    box.dataset.steps = String(n);
    box.dataset.checkpoints = String(checkpoints.length);
    if (!n) {
      summary.textContent = "No step trained yet.";
      return;
    }
    const last = d[0][n - 1];
    const of = total !== null ? ` of ${total}` : "";
    const saved = checkpoints.length
      ? ` · ${checkpoints.length} checkpoint${checkpoints.length === 1 ? "" : "s"} (the last after step ${checkpoints[checkpoints.length - 1]})`
      : "";
    summary.textContent = `step ${last}${of} · loss ${fmt(d[1][n - 1], 4)} `
      + `(first ${fmt(d[1][0], 4)}) · ${fmt(d[2][n - 1], 1)} samples/s${saved}`;
    if (chart === null) chart = makeChart(d);
    else chart.setData(d);
  }

  document.addEventListener("pp:events", (e) => {
    const spec = (e.detail.job && e.detail.job.spec) || {};
    total = Number.isInteger(spec.steps) ? spec.steps : null;
    add(e.detail.events);
    render();
  });
  window.addEventListener("resize", () => {
    if (chart !== null) chart.setSize({ width: Math.max(320, box.clientWidth), height: 320 });
  });
  render();
})();
