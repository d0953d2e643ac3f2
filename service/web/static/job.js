// A job's page: its figures (GET /v1/jobs/{id}), the chart of its search from its
// evaluation events (GET /v1/jobs/{id}/events, read incrementally), the plan panel drawn
// on the server (GET /jobs/{id}/plan, the best plan so far or the job's own), the tail of
// its log and the cancel button. Refreshed every second until the job has ended.
"use strict";

(() => {
  const REFRESH_MS = 1000;
  const LOG_EVERY_MS = 3000;
  const PLAN_EVERY_MS = 2000;
  const EVENTS_PAGE = 5000;
  const LOG_LINES = 300;
  const COLOURS = { best: "#1d2330", simulated: "#4C72B0", measured: "#DD8452", predicted: "#6b7280" };

  const jobId = document.body.dataset.jobId;
  const rayDashboard = document.body.dataset.rayDashboard;
  const $ = (id) => document.getElementById(id);
  const chartBox = $("chart");

  let job = null;
  let afterSeq = -1;
  const evals = []; // {seq, n, t, value, source, predicted}
  let bestSeq = null, bestValue = null; // the best evaluation that carries its plan
  let xMode = "evaluations";
  let chart = null;
  let planKey = null, planLoadedAt = 0;
  let logLoadedAt = 0;
  let finished = false;

  // --- figures -----------------------------------------------------------------------

  function fact(label, value, id) {
    return pp.el("div", {}, pp.el("dt", {}, label), pp.el("dd", id ? { id } : {}, value));
  }

  function rayJobLink(j) {
    if (!j.ray_job_id) return "-";
    if (!rayDashboard) return j.ray_job_id;
    return pp.el("a", { href: `${rayDashboard}/#/jobs/${encodeURIComponent(j.ray_job_id)}`,
      target: "_blank", rel: "noopener" }, j.ray_job_id);
  }

  // The job's summary; a search's best value and evaluations from its events too, which
  // may be ahead of the last progress report.
  function summary(j) {
    const s = pp.summarize(j);
    if (j.kind !== "plan" && j.kind !== "compare" || s.terminal) return s;
    const best = evals.reduce((low, p) => (p.value !== null && (low === null || p.value < low) ? p.value : low), null);
    if (best !== null && !(pp.finite(s.best) && s.best <= best)) s.bestLabel = pp.fmtValue(s.objective, best);
    const counted = Number(s.evaluations);
    if (!Number.isFinite(counted) || counted < evals.length) s.evaluations = String(evals.length);
    return s;
  }

  function renderJob(j) {
    const s = summary(j);
    const state = $("job-state");
    state.textContent = j.state;
    state.className = `badge ${j.state}`;
    $("job-name").textContent = j.name || "";
    const waitingFor = pp.waitingText(j.waiting_for);
    $("facts").replaceChildren(...[
      waitingFor ? fact("waiting for", waitingFor, "fact-waiting") : null,
      fact("kind", j.kind, "fact-kind"),
      fact("model", s.model, "fact-model"),
      fact("cluster", s.cluster, "fact-cluster"),
      fact("predictions", s.predictions, "fact-predictions"),
      fact("planner", s.planner, "fact-planner"),
      fact("objective", s.objective, "fact-objective"),
      fact("best value", s.bestLabel, "fact-best"),
      fact("evaluations", s.evaluations, "fact-evaluations"),
      fact("created", pp.fmtTime(j.created_at)),
      fact("started", s.started),
      fact("finished", pp.fmtTime(j.finished_at)),
      fact("duration", s.duration, "fact-duration"),
      fact("Ray job", rayJobLink(j)),
    ].filter(Boolean));
    const error = $("job-error");
    error.hidden = !j.error;
    error.textContent = j.error || "";
    $("cancel").hidden = s.terminal;
  }

  // --- the search chart --------------------------------------------------------------

  function addEvents(events) {
    const t0 = Date.parse(job.started_at || job.created_at);
    for (const e of events) {
      afterSeq = e.seq;
      if (e.type !== "evaluation") continue;
      const d = e.data || {};
      const value = pp.finite(d.value) ? d.value : null;
      const point = {
        seq: e.seq,
        n: evals.length + 1,
        t: Math.max(0, (Date.parse(e.received_at) - t0) / 1000),
        value,
        source: d.source === "measured" ? "measured" : "simulated",
        predicted: pp.finite(d.predicted_batch_time_s) ? d.predicted_batch_time_s : null,
        plan: Boolean(d.plan),
      };
      evals.push(point);
      if (value !== null && point.plan && (bestValue === null || value < bestValue)) {
        bestSeq = e.seq;
        bestValue = value;
      }
    }
  }

  function chartData(objective) {
    const scale = pp.unit(objective).scale;
    const showPredicted = objective !== "cost"; // the value is the batch time
    const points = evals.map((p) => ({ ...p, x: xMode === "evaluations" ? p.n : p.t }));
    if (xMode === "seconds") points.sort((a, b) => a.x - b.x || a.n - b.n);
    const xs = [], best = [], simulated = [], measured = [], predicted = [];
    let low = null;
    for (const p of points) {
      if (p.value !== null) low = low === null ? p.value : Math.min(low, p.value);
      xs.push(p.x);
      best.push(low === null ? null : low * scale);
      const v = p.value === null ? null : p.value * scale;
      simulated.push(p.source === "simulated" ? v : null);
      measured.push(p.source === "measured" ? v : null);
      predicted.push(p.source === "measured" && showPredicted && p.predicted !== null
        ? p.predicted * scale : null);
    }
    return [xs, best, simulated, measured, predicted];
  }

  // A thin line from each measured point to its prediction.
  function joinPredictions(u) {
    const [xs, , , measured, predicted] = u.data;
    const ctx = u.ctx;
    ctx.save();
    ctx.strokeStyle = COLOURS.predicted;
    ctx.lineWidth = 1;
    ctx.setLineDash([3, 3]);
    for (let i = 0; i < xs.length; i++) {
      if (measured[i] === null || predicted[i] === null) continue;
      const x = u.valToPos(xs[i], "x", true);
      ctx.beginPath();
      ctx.moveTo(x, u.valToPos(measured[i], "y", true));
      ctx.lineTo(x, u.valToPos(predicted[i], "y", true));
      ctx.stroke();
    }
    ctx.restore();
  }

  function dots(colour, size, fill) {
    return { stroke: colour, width: 0, paths: () => null,
      points: { show: true, size, stroke: colour, fill: fill || colour, width: 1.5 } };
  }

  function makeChart(objective, data) {
    const u = pp.unit(objective);
    const opts = {
      width: Math.max(320, chartBox.clientWidth),
      height: 320,
      scales: { x: { time: false } },
      axes: [
        xMode === "evaluations"
          ? { label: "plans evaluated", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 1e4, 2e4, 5e4, 1e5] }
          : { label: "seconds since the job started" },
        { label: u.label, size: 70 },
      ],
      series: [
        { label: xMode === "evaluations" ? "evaluation" : "seconds" },
        { label: "best so far", stroke: COLOURS.best, width: 2, spanGaps: true,
          paths: uPlot.paths.stepped({ align: 1 }), points: { show: false } },
        { label: "simulated", ...dots(COLOURS.simulated, 6) },
        { label: "measured", ...dots(COLOURS.measured, 9) },
        { label: "predicted", ...dots(COLOURS.predicted, 9, "#ffffff") },
      ],
      hooks: { draw: [joinPredictions] },
    };
    chartBox.replaceChildren();
    return new uPlot(opts, data, chartBox);
  }

  function updateChart() {
    if (chartBox === null) return; // a run or profile job: no search
    const objective = (job.spec && job.spec.objective) || "time";
    const summary = $("chart-summary");
    const feasible = evals.filter((p) => p.value !== null);
    const measured = feasible.filter((p) => p.source === "measured");
    chartBox.dataset.x = xMode;
    chartBox.dataset.evaluations = String(evals.length);
    chartBox.dataset.points = String(feasible.length);
    chartBox.dataset.measured = String(measured.length);
    if (!evals.length) {
      summary.textContent = "No plan evaluated yet.";
      return;
    }
    const best = feasible.reduce((a, p) => (a === null || p.value < a.value ? p : a), null);
    chartBox.dataset.best = best ? pp.fmtValue(objective, best.value) : "-";
    summary.textContent = `${evals.length} plan${evals.length === 1 ? "" : "s"} evaluated `
      + `(${measured.length} measured, ${evals.length - feasible.length} infeasible)`
      + (best ? ` · best ${pp.fmtValue(objective, best.value)} at evaluation ${best.n}` : "");
    const data = chartData(objective);
    if (chart === null) chart = makeChart(objective, data);
    else chart.setData(data);
  }

  function setMode(mode) {
    xMode = mode;
    $("x-evaluations").classList.toggle("on", mode === "evaluations");
    $("x-seconds").classList.toggle("on", mode === "seconds");
    if (chart !== null) {
      chart.destroy();
      chart = null;
    }
    if (job !== null) updateChart();
  }

  // --- the plan panel and the log ----------------------------------------------------

  async function loadPlan(key, seq) {
    planKey = key;
    planLoadedAt = Date.now();
    const url = `/jobs/${encodeURIComponent(jobId)}/plan${seq === null ? "" : `?seq=${seq}`}`;
    try {
      const r = await fetch(url, { credentials: "same-origin", cache: "no-store" });
      if (r.status === 401) { window.location.reload(); return; }
      $("plan-panel").innerHTML = await r.text();
    } catch (e) {
      planKey = null; // try again on the next round
    }
  }

  function maybeLoadPlan() {
    const seq = finished || bestSeq === null ? null : bestSeq;
    const key = finished ? "final" : seq === null ? "own" : `seq:${seq}`;
    if (key === planKey) return null;
    if (!finished && planKey !== null && Date.now() - planLoadedAt < PLAN_EVERY_MS) return null;
    return loadPlan(key, seq);
  }

  async function loadLog() {
    logLoadedAt = Date.now();
    const box = $("logs");
    try {
      const text = await pp.api(`/v1/jobs/${encodeURIComponent(jobId)}/logs`, { as: "text" });
      const lines = text.split("\n");
      const tail = lines.slice(-LOG_LINES).join("\n");
      const atEnd = box.scrollTop + box.clientHeight >= box.scrollHeight - 4;
      box.textContent = tail || "(no log yet)";
      if (atEnd) box.scrollTop = box.scrollHeight;
      $("logs-status").textContent = lines.length > LOG_LINES
        ? `the last ${LOG_LINES} of ${lines.length} lines` : "";
    } catch (e) {
      $("logs-status").textContent = `log not read: ${e.message}`;
    }
  }

  // --- the loop ----------------------------------------------------------------------

  // Every page of events read is also handed to the page's other charts (a train job's
  // curve, static/train.js) as a "pp:events" DOM event.
  async function readEvents() {
    for (;;) {
      const page = await pp.api(
        `/v1/jobs/${encodeURIComponent(jobId)}/events?after=${afterSeq}&limit=${EVENTS_PAGE}`);
      addEvents(page);
      document.dispatchEvent(new CustomEvent("pp:events", { detail: { job, events: page } }));
      if (page.length < EVENTS_PAGE) return;
    }
  }

  async function tick() {
    try {
      job = await pp.api(`/v1/jobs/${encodeURIComponent(jobId)}`);
      const ended = ["succeeded", "failed", "cancelled"].includes(job.state);
      await readEvents();
      renderJob(job);
      updateChart();
      finished = ended;
      const waits = [maybeLoadPlan()];
      if (finished || Date.now() - logLoadedAt >= LOG_EVERY_MS) waits.push(loadLog());
      await Promise.all(waits);
      const status = $("job-status");
      if (status.textContent.startsWith("not updated")) status.textContent = "";
    } catch (e) {
      $("job-status").textContent = `not updated: ${e.message}`;
    }
    if (!finished) setTimeout(tick, REFRESH_MS);
  }

  async function cancel() {
    if (!window.confirm(`Cancel job ${jobId}? Its work on the cluster is stopped.`)) return;
    const button = $("cancel");
    button.disabled = true;
    try {
      await pp.api(`/v1/jobs/${encodeURIComponent(jobId)}/cancel`, { method: "POST" });
    } catch (e) {
      $("job-status").textContent = `not cancelled: ${e.message}`;
    }
    button.disabled = false;
  }

  if (chartBox !== null) {
    $("x-evaluations").addEventListener("click", () => setMode("evaluations"));
    $("x-seconds").addEventListener("click", () => setMode("seconds"));
    window.addEventListener("resize", () => {
      if (chart !== null) chart.setSize({ width: Math.max(320, chartBox.clientWidth), height: 320 });
    });
  }
  $("cancel").addEventListener("click", cancel);
  tick();
})();
