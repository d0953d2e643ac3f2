// The jobs page: the table of GET /v1/jobs, filtered by state and kind, refreshed every
// two seconds.
"use strict";

(() => {
  const REFRESH_MS = 2000;
  const LIMIT = 100;
  const body = document.getElementById("jobs-body");
  const status = document.getElementById("jobs-status");
  const more = document.getElementById("jobs-more");
  const stateSel = document.getElementById("filter-state");
  const kindSel = document.getElementById("filter-kind");
  let timer = null;

  function row(job) {
    const s = pp.summarize(job);
    const link = pp.el("a", { href: `/jobs/${encodeURIComponent(job.id)}` }, job.id);
    const name = job.name ? pp.el("span", { class: "job-sub" }, job.name) : null;
    return pp.el("tr", { "data-job-id": job.id, "data-state": job.state },
      pp.el("td", {}, link, name),
      pp.el("td", { title: pp.waitingText(job.waiting_for) }, pp.badge(job.state),
        job.waiting_for && job.waiting_for.devices && job.waiting_for.devices.length
          ? pp.el("span", { class: "job-sub" }, "waiting") : null),
      pp.el("td", {}, job.kind),
      pp.el("td", {}, s.model),
      pp.el("td", {}, s.cluster),
      pp.el("td", {}, s.planner),
      pp.el("td", {}, s.objective),
      pp.el("td", { class: "num" }, s.bestLabel),
      pp.el("td", { class: "num" }, s.evaluations),
      pp.el("td", {}, s.started),
      pp.el("td", { class: "num" }, s.duration));
  }

  function query() {
    const q = new URLSearchParams();
    if (stateSel.value) q.set("state", stateSel.value);
    if (kindSel.value) q.set("kind", kindSel.value);
    return q;
  }

  async function refresh() {
    clearTimeout(timer);
    const q = query();
    q.set("limit", String(LIMIT));
    try {
      const page = await pp.api(`/v1/jobs?${q}`);
      body.replaceChildren(...page.items.map(row));
      if (!page.items.length) {
        body.append(pp.el("tr", {}, pp.el("td", { colspan: 11, class: "note" }, "No jobs.")));
      }
      more.hidden = !page.next;
      more.textContent = page.next ? `The newest ${LIMIT} jobs are shown.` : "";
      status.textContent = `${page.items.length} job${page.items.length === 1 ? "" : "s"}, updated ${new Date().toLocaleTimeString()}`;
    } catch (e) {
      status.textContent = `not updated: ${e.message}`;
    }
    timer = setTimeout(refresh, REFRESH_MS);
  }

  function filtersChanged() {
    const q = query().toString();
    history.replaceState(null, "", q ? `/?${q}` : "/");
    refresh();
  }

  stateSel.addEventListener("change", filtersChanged);
  kindSel.addEventListener("change", filtersChanged);
  refresh();
})();
