"""The service under load, on loopback only: concurrent clients, bounded in count and time.

1. ``GET /v1/jobs`` (one page, the default limit) with ``--jobs`` jobs stored (SQLite in a
   temporary folder): p50 and p99 latency from 4 and 16 concurrent clients (threads, each
   with its own httpx client), against the real app under uvicorn in a process of its own
   with a bench backend that accepts submissions and runs nothing
   (:mod:`bench.service_load_server`).
2. Events ingested per second on one job (target: >= 1,000 events/s on SQLite), and whether
   the stored events are exactly those posted:
   a. one event a request: ``--events`` events posted to the control endpoint with the
      job's own token by ``--posters`` concurrent posters (distinct seqs): what the
      request path costs;
   b. as a job sends them: ``--events`` evaluation events emitted by one job's own
      EventChannel as fast as the loop can (in order, from one sender thread; what
      queues behind a post goes out in the next post, as a batch): the sender's capacity;
   c. the same paced at ``--rate`` events a second, as a steady search reports them:
      the rate delivered and the lag after the last emit.
   The target is judged on b and c: they are how a job's events reach the service.
3. Submit to running on the real Ray Jobs backend: ``pipeplan serve`` with its embedded
   one-node cluster, ``--ray-jobs`` small plan jobs one after the other, median and max
   (:mod:`bench.service_load_ray`; ``--no-ray`` skips it).
4. The restart scenario ``--fault-runs`` times: a job posts its events through the job
   side's EventChannel while the service is killed with SIGKILL and restarted on the same
   database; events lost, events doubled and jobs lost must all be 0
   (:mod:`bench.service_load_fault`).

Every process it starts (the services, the embedded Ray cluster) is stopped by its pid, on
free loopback ports. Prints one table per part and a summary; writes
``bench/results/service_load/<UTC date-time>.json`` (``--quick``: under
``service_load_quick/``; :mod:`bench.record`).

    .venv/bin/python -m bench.service_load            # the full run
    .venv/bin/python -m bench.service_load --quick    # a smoke run, 3 fault runs
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import OUT_HELP, table
from bench.record import BenchRun, display
from bench.service_load_fault import DELIVERY, fault_runs
from bench.service_load_http import (
    deliver,
    ingest,
    list_load,
    seed_jobs,
    stored_check,
    submit_job,
)
from bench.service_load_ray import submit_to_running
from bench.service_load_server import bench_server, job_tokens

PAGE = 50
"""``GET /v1/jobs``'s default limit."""
TARGET_EVENTS_PER_S = 1000
console = Console(width=shutil.get_terminal_size((120, 40)).columns)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: small counts, 3 fault runs")
    ap.add_argument("--jobs", type=int, default=1000, help="jobs stored for part 1")
    ap.add_argument("--clients", default="4,16", help="concurrent clients of part 1")
    ap.add_argument("--requests", type=int, default=None, help="requests per client count")
    ap.add_argument("--events", type=int, default=None, help="events posted in part 2")
    ap.add_argument("--posters", type=int, default=4, help="concurrent posters of part 2a")
    ap.add_argument("--rate", type=float, default=2000.0, help="events/s of part 2c")
    ap.add_argument("--ray-jobs", type=int, default=None, help="jobs timed on Ray in part 3")
    ap.add_argument("--no-ray", action="store_true", help="skip part 3 (Ray)")
    ap.add_argument("--fault-runs", type=int, default=None, help="restart scenarios [20]")
    ap.add_argument("--fault-events", type=int, default=None, help="events per fault run")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per load, at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    a = ap.parse_args()
    defaults = (200, 1000, 2, 3, 200) if a.quick else (1000, 5000, 4, 20, 300)
    for name, value in zip(
        ("requests", "events", "ray_jobs", "fault_runs", "fault_events"), defaults, strict=True
    ):
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.clients = [int(c) for c in a.clients.split(",")]
    return a


def http_parts(a: argparse.Namespace, tmp: Path, token: str) -> dict[str, Any]:
    """Parts 1 and 2 on one bench service (module docstring)."""
    db = f"sqlite:///{tmp / 'jobs.db'}"
    out: dict[str, Any] = {"seed_s": seed_jobs(db, a.jobs)}
    server = bench_server(tmp, db, token)
    try:
        server.start()
        server.wait_healthy(120)
        list_load(server.client, 2, 20, PAGE, time.perf_counter() + a.time_limit)  # warm-up
        out["list"] = {
            str(n): list_load(
                server.client, n, a.requests, PAGE, time.perf_counter() + a.time_limit
            ).summary()
            for n in a.clients
        }
        with server.client() as c:
            job_id = submit_job(c, "events")
            until = time.perf_counter() + a.time_limit
            t = ingest(server.url, job_id, job_tokens(tmp)[job_id], a.events, a.posters, until)
            out["events"] = t.summary() | stored_check(c, job_id, t.done)
            sender_job = submit_job(c, "sender")
            sender_token = job_tokens(tmp)[sender_job]
            out["sender"] = deliver(c, server.url, sender_job, sender_token, a.events)
            paced_job = submit_job(c, "paced")
            paced_token = job_tokens(tmp)[paced_job]
            out["paced"] = deliver(c, server.url, paced_job, paced_token, a.events, a.rate)
    finally:
        server.stop()
    return out


def fault_part(a: argparse.Namespace, tmp: Path, token: str) -> dict[str, Any]:
    """Part 4 on a bench service of its own (a fresh database)."""
    server = bench_server(tmp, f"sqlite:///{tmp / 'jobs.db'}", token)
    try:
        server.start()
        server.wait_healthy(120)
        return fault_runs(server, tmp, a.fault_runs, a.fault_events, a.seed)
    finally:
        server.stop()


def secs(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f} ms" if x < 10 else f"{x:,.1f} s"


def print_http(a: argparse.Namespace, r: dict[str, Any]) -> None:
    t = table(
        f"1. GET /v1/jobs (page of {PAGE}) with {a.jobs:,} jobs stored",
        ("clients", "requests", "errors", "p50", "p99", "max", "requests/s"),
    )
    for n, s in r["list"].items():
        row = (s["requests"], s["errors"], f"{s['p50_ms']:.1f} ms", f"{s['p99_ms']:.1f} ms")
        t.add_row(n, *map(str, row), f"{s['max_ms']:.1f} ms", f"{s['per_s']:,.0f}")
    console.print(t)
    e, b, c = r["events"], r["sender"], r["paced"]
    one_row(
        f"2a. events ingested on one job, one a request ({a.posters} posters)",
        {
            "events": e["requests"],
            "errors": e["errors"],
            "events/s": f"{e['per_s']:,.0f}",
            "p50": f"{e['p50_ms']:.1f} ms",
            "p99": f"{e['p99_ms']:.1f} ms",
        }
        | {k: e[k] for k in ("stored", "distinct", "exact")},
    )
    one_row(
        "2b. events ingested on one job, as the job sends them (its EventChannel)",
        {
            "events": b["events"],
            "posts": b["posts"],
            "events/post": f"{b['events'] / b['posts'] if b['posts'] else 0.0:,.1f}",
            "events/s": f"{b['per_s']:,.0f}",
        }
        | {k: b[k] for k in ("stored", "distinct", "exact")},
    )
    one_row(
        f"2c. the same, paced at {c['rate_asked']:,.0f} events/s (a steady search)",
        {
            "events": c["events"],
            "posts": c["posts"],
            "events/post": f"{c['events'] / c['posts'] if c['posts'] else 0.0:,.1f}",
            "events/s": f"{c['per_s']:,.0f}",
            "lag after last": secs(c["lag_s"]),
        }
        | {k: c[k] for k in ("stored", "distinct", "exact")},
    )


def one_row(title: str, cells: dict[str, Any]) -> None:
    """A table of one row: the cells' keys are its columns."""
    t = table(title, list(cells))
    t.add_row(*map(str, cells.values()))
    console.print(t)


def print_ray(r: dict[str, Any]) -> None:
    t = table(
        "3. submit to running, real Ray Jobs (pipeplan serve, embedded 1-node cluster)",
        ("job", "state", "POST answered", "seen running", "started_at - created_at", "done"),
    )
    for i, j in enumerate(r.get("jobs", [])):
        t.add_row(
            str(i),
            j["state"],
            secs(j["submit_s"]),
            secs(j["to_running_s"]),
            secs(j["to_running_server_s"]),
            secs(j["to_done_s"]),
        )
    for k in ("median", "max"):
        t.add_row(
            k,
            "",
            "",
            secs(r["to_running_s"][k]),
            secs(r["to_running_server_s"][k]),
            secs(r["to_done_s"][k]),
        )
    console.print(t)
    console.print(
        f"service start (with its cluster): {secs(r.get('service_start_s'))}; "
        f"after SIGTERM: exit {r['serve_exit_code']}, "
        f"cluster left running: {r['cluster_left_running']}"
    )


def print_fault(r: dict[str, Any]) -> None:
    cols = ("run", "events", "sent at kill", "acked at kill", "retries", "down", "stored")
    t = table(
        f"4. restart scenario x{r['totals']['runs']} (SIGKILL, restart, same db)",
        (*cols, "lost", "doubled", "jobs acked", "jobs lost", "state"),
    )
    keys: tuple[str, ...] = ("events_sent", "emitted_at_kill", "acked_at_kill", "retries")
    keys += ("down_s", "events_stored", "events_lost", "events_doubled", "jobs_acked", "jobs_lost")
    for i, x in enumerate(r["runs"]):
        cells = [secs(x[k]) if k == "down_s" else str(x[k]) for k in keys]
        t.add_row(str(i), *cells, x["job_state"])
    console.print(t)


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, and whether each target was met."""
    e, f, lists = res["http"]["events"], res["fault"]["totals"], res["http"]["list"]
    s: dict[str, Any] = {}
    for n in lists:
        s |= {f"list_p50_ms_{n}_clients": lists[n]["p50_ms"]}
        s |= {f"list_p99_ms_{n}_clients": lists[n]["p99_ms"]}
    b, c = res["http"]["sender"], res["http"]["paced"]
    s |= {"events_per_s_one_a_request": e["per_s"], "events_per_s_job_sender": b["per_s"]}
    s |= {"events_per_s_paced": c["per_s"], "paced_lag_s": c["lag_s"]}
    s["events_stored_exact"] = bool(e["exact"] and b["exact"] and c["exact"])
    met = all(x["per_s"] >= TARGET_EVENTS_PER_S and x["exact"] for x in (b, c))
    s["events_target_met"] = bool(met)
    if "ray" in res:
        s["to_running_median_s"] = res["ray"]["to_running_s"]["median"]
        s["to_running_max_s"] = res["ray"]["to_running_s"]["max"]
        s["ray_jobs_succeeded"] = res["ray"]["succeeded"]
    s |= {k: f[k] for k in ("events_lost", "events_doubled", "jobs_lost")}
    fault_ok = f["runs_not_succeeded"] == 0 and f["delivery_errors"] == 0
    s["fault_target_met"] = bool(
        fault_ok and f["events_lost"] == 0 and f["events_doubled"] == 0 and f["jobs_lost"] == 0
    )
    return s


def print_summary(s: dict[str, Any]) -> None:
    t = Table(title="summary")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for k, v in s.items():
        t.add_row(k, f"{v:,.3f}" if isinstance(v, float) else str(v))
    console.print(t)


def parameters(a: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "quick",
        "jobs",
        "clients",
        "requests",
        "events",
        "posters",
        "rate",
        "ray_jobs",
        "no_ray",
        "fault_runs",
        "fault_events",
        "time_limit",
        "seed",
    )
    return {k: getattr(a, k) for k in keys} | {
        "page": PAGE,
        "database": "sqlite (WAL), a temporary file",
        "server": "the app under uvicorn, one process, log level info (as pipeplan serve)",
        "fault_delivery": {
            "first_wait_s": DELIVERY.first_wait_s,
            "max_wait_s": DELIVERY.max_wait_s,
        },
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    token = secrets.token_urlsafe(24)
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pipeplan-bench-") as tmp:
        for name in ("http", "ray", "fault"):
            (Path(tmp) / name).mkdir()
        res["http"] = http_parts(a, Path(tmp) / "http", token)
        print_http(a, res["http"])
        if not a.no_ray:
            res["ray"] = submit_to_running(Path(tmp) / "ray", token, a.ray_jobs)
            print_ray(res["ray"])
        res["fault"] = fault_part(a, Path(tmp) / "fault", token)
        print_fault(res["fault"])
    return res


def main() -> None:
    a = parse_args()
    bench = BenchRun("service_load_quick" if a.quick else "service_load")
    t0 = time.perf_counter()
    res = run(a)
    s = summary(res)
    print_summary(s)
    out = {
        "wall_s": time.perf_counter() - t0,
        "parameters": parameters(a),
        "targets": {
            "events_per_s": TARGET_EVENTS_PER_S,
            "events_lost": 0,
            "events_doubled": 0,
            "jobs_lost": 0,
        },
        "summary": s,
        **res,
    }
    print(f"wrote {display(bench.write(out, out=a.out))}")


if __name__ == "__main__":
    main()
