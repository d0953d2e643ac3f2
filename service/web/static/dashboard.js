// pipeplan dashboard: what every page's script shares. Plain JavaScript, no build step.
// The JSON API is read with the login cookie (same origin); a request that changes state
// sends the CSRF header the service asks of cookie-authenticated requests.
"use strict";

const pp = (() => {
  const CSRF_HEADER = document.body.dataset.csrfHeader;

  class ApiError extends Error {
    constructor(status, detail) {
      super(detail);
      this.status = status;
    }
  }

  // GET (or `method`) a JSON API path; `as`: "json" or "text". A 401 means the login is
  // gone: the page is reloaded, which shows the login form.
  async function api(path, { method = "GET", as = "json" } = {}) {
    const headers = { Accept: as === "json" ? "application/json" : "text/plain" };
    if (method !== "GET") headers[CSRF_HEADER] = "1";
    let r;
    try {
      r = await fetch(path, { method, headers, credentials: "same-origin", cache: "no-store" });
    } catch (e) {
      throw new ApiError(0, `the service does not answer (${e.message})`);
    }
    if (r.status === 401) {
      window.location.reload();
      throw new ApiError(401, "not logged in");
    }
    if (!r.ok) {
      let detail = `${r.status} ${r.statusText}`;
      try { detail = (await r.json()).detail || detail; } catch (_) { /* not JSON */ }
      throw new ApiError(r.status, detail);
    }
    return as === "json" ? r.json() : r.text();
  }

  // An element: el("td", {class: "num"}, "text", child...).
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : String(c));
    }
    return node;
  }

  const finite = (x) => typeof x === "number" && Number.isFinite(x);

  // The objective's display: batch time in ms (time, throughput), $ per million samples (cost).
  function unit(objective) {
    return objective === "cost"
      ? { scale: 1e6, label: "$ per million samples", short: (v) => `$${v.toPrecision(4)}/M` }
      : { scale: 1e3, label: "batch time (ms)", short: (v) => `${v.toPrecision(4)} ms` };
  }

  function fmtValue(objective, value) {
    if (!finite(value)) return "-";
    const u = unit(objective);
    return u.short(value * u.scale);
  }

  function fmtDuration(seconds) {
    if (!finite(seconds) || seconds < 0) return "-";
    if (seconds < 60) return `${seconds.toFixed(1)} s`;
    const m = Math.floor(seconds / 60), s = Math.round(seconds % 60);
    if (m < 60) return `${m} min ${s} s`;
    return `${Math.floor(m / 60)} h ${m % 60} min`;
  }

  function fmtTime(iso) {
    if (!iso) return "-";
    const t = new Date(iso);
    const today = new Date().toDateString() === t.toDateString();
    return today ? t.toLocaleTimeString() : t.toLocaleString();
  }

  // What a job's row and facts show, from the job document of the API.
  function summarize(job) {
    const spec = job.spec || {}, result = job.result || {}, progress = job.progress || {};
    const searches = job.kind === "plan" || job.kind === "compare";
    const objective = searches ? spec.objective || "time" : null;
    const cluster = typeof spec.cluster === "string" ? spec.cluster
      : spec.cluster && spec.cluster.name ? spec.cluster.name
      : spec.address ? `live (${spec.address})` : "-";
    // whether the job's predictions use a calibration (the service's from use, or the
    // request's own): its cluster document then holds a calibration block
    const calibration = spec.cluster && typeof spec.cluster === "object" ? spec.cluster.calibration : null;
    const fit = (calibration && calibration.fit) || {};
    const predicts = searches || job.kind === "run" || job.kind === "train";
    const predictions = !predicts ? "-" : !calibration ? "uncalibrated spec"
      : fit.source === "service" ? `calibrated from ${fit.runs} runs (fitted ${fit.fitted_at || "?"})`
      : "calibrated (the request's own)";
    const model = spec.model || (spec.profile && spec.profile.name) || "-";
    const planner = spec.planner || (Array.isArray(spec.planners) ? spec.planners.join(", ")
      : job.kind === "compare" ? "default set" : "-");
    let best = null, bestLabel = "-";
    if (job.kind === "plan" && result.estimate) {
      best = objective === "cost" ? result.estimate.cost_per_sample : result.estimate.batch_time_s;
    } else if (job.kind === "compare" && Array.isArray(result.results)) {
      const values = result.results.filter((r) => r.ok && finite(r.value)).map((r) => r.value);
      best = values.length ? Math.min(...values) : null;
    } else if (searches) {
      best = progress.best_value;
    }
    if (searches) bestLabel = fmtValue(objective, best);
    if (job.kind === "run" && result.measured) {
      bestLabel = `${(result.measured.batch_time_s * 1e3).toPrecision(4)} ms measured`;
    }
    if (job.kind === "train" && Number.isInteger(progress.step) && finite(progress.loss)) {
      bestLabel = `loss ${progress.loss.toPrecision(4)} at step ${progress.step}`;
    }
    const evaluations = finite(result.evaluations) ? result.evaluations
      : finite(progress.evaluations) && searches ? progress.evaluations : null;
    const start = job.started_at ? Date.parse(job.started_at) : null;
    const end = job.finished_at ? Date.parse(job.finished_at) : Date.now();
    return {
      model, cluster, planner, objective: objective || "-", best, bestLabel, predictions,
      evaluations: evaluations === null ? "-" : String(evaluations),
      started: fmtTime(job.started_at),
      duration: start === null ? "-" : fmtDuration((end - start) / 1000),
      terminal: ["succeeded", "failed", "cancelled"].includes(job.state),
    };
  }

  function badge(state) {
    return el("span", { class: `badge ${state}` }, state);
  }

  // A queued job's waiting_for for people, as the CLI words it (service/web/format.py):
  // "2 x mid on n1, held by job pp-...". "" when it waits for nothing.
  function waitingText(reason) {
    if (!reason || !Array.isArray(reason.devices) || reason.devices.length === 0) return "";
    const groups = new Map();
    for (const device of reason.devices) {
      const [node, rest = ""] = String(device).split("/");
      const key = `${rest.split(":")[0]} on ${node}`;
      groups.set(key, (groups.get(key) || 0) + 1);
    }
    const what = [...groups].map(([key, n]) => `${n} x ${key}`).join(" and ");
    const held = Array.isArray(reason.held_by) ? reason.held_by : [];
    const by = held.length ? `job${held.length > 1 ? "s" : ""} ${held.join(", ")}` : "other actors";
    return `${what}, held by ${by}`;
  }

  return {
    api, ApiError, el, finite, unit, fmtValue, fmtDuration, fmtTime, summarize, badge, waitingText,
  };
})();
