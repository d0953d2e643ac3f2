// The cluster page: its live part (GET /cluster/nodes, drawn on the server) reloaded
// every five seconds.
"use strict";

(() => {
  const REFRESH_MS = 5000;
  const live = document.getElementById("cluster-live");

  async function refresh() {
    try {
      const r = await fetch("/cluster/nodes", { credentials: "same-origin", cache: "no-store" });
      if (r.status === 401) {
        window.location.reload();
        return;
      }
      if (r.ok) live.innerHTML = await r.text();
    } catch (_) {
      // the service does not answer: keep what is shown, try again
    }
    setTimeout(refresh, REFRESH_MS);
  }

  setTimeout(refresh, REFRESH_MS);
})();
