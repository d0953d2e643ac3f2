"""The service's queue under a burst of device jobs: utilisation, makespan, waits, overhead.

``pipeplan serve`` with its embedded cluster of the ``local-pipeline`` preset (three nodes,
six devices; ``ray start`` with token auth on free loopback ports; database, config and
cluster record in a temporary folder; ``PIPEPLAN_POOL_SIZE=0``: no planner pool, which
device jobs never use). ``--jobs`` ``run`` jobs of
the ``digits_cnn`` zoo model, drawn with a fixed seed: each a pipeline of 1 to 4 of the
preset's devices (one per stage, the eight layers split at random cuts), a number of steps
from :data:`STEPS` (so that the jobs take different times), and a few with a higher
``priority``. They are posted one after the other as fast as the service answers (a burst),
then the jobs list is polled every :data:`POLL_S` until every job has ended, noting each
``waiting_for`` seen.

From the jobs' own timestamps and events (``GET /v1/jobs/{id}``, ``/events``):

- **utilisation**: a job holds its plan's devices from ``started_at`` to ``finished_at``
  (``started_at`` is set by the job's first event, and set again when a job that waited for
  its devices gets them); the devices held over time are drawn as a PNG beside the JSON,
  with each device's jobs below (Ray reserves a node's devices of one type as a count, so
  a job naming a device another job holds may run meanwhile on a free one of the same
  type and node: :func:`assign_devices` says which);
- **makespan** (first ``created_at`` to last ``finished_at``) against the **bound**, the sum
  over jobs of run time x devices divided by the six devices: no schedule of these run
  times is shorter;
- **queue wait** p50 and p99, ``started_at - created_at``;
- **the scheduler's overhead**: ``started_at - created_at`` of the jobs that never waited
  (no ``waiting`` event naming devices, never seen ``waiting_for: {"behind": ...}``), and,
  for those that did, ``started_at`` minus the moment the devices it needs were last
  released before it started (or its submission, if later): what the queue adds once a
  job could have had its devices (held behind the head of the queue included: no
  backfilling);
- **the pace of starts**: the time between one job's ``started_at`` and the next's (a
  device job is handed to Ray only once the jobs before it that may want its devices have
  started, so such starts follow each other at least a driver's start-up apart);
- every job must end ``succeeded`` (else the run says which did not, and exits 1), and no
  ``pipeplan:`` placement group may be left in the cluster once they have ended (read with
  Ray's placement group table, from a process that joins the cluster with its token).

Prints a table; writes ``bench/results/scheduler/<UTC date-time>.json`` and ``.png``
(``--quick``: fewer jobs, under ``scheduler_quick/``; :mod:`bench.record`). The PNGs under
``bench/results/`` are not kept in git: ``--plot FILE`` draws a result file's figure again
from the jobs it recorded. The service is stopped with SIGTERM (it stops its cluster); what
might still run of the cluster is stopped by its pids.

    .venv/bin/python -m bench.scheduler           # 50 jobs
    .venv/bin/python -m bench.scheduler --quick   # 12 jobs
    .venv/bin/python -m bench.scheduler --plot bench/results/scheduler_quick/RUN.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from bench.common import OUT_HELP, fmt, table
from bench.record import BenchRun, display
from bench.service_load_ray import serve_process, stop_everything
from bench.service_load_server import ServerProcess
from pipeplan.core.cluster import parse_device_id

PRESET = "local-pipeline"
MODEL = "digits_cnn"
LAYERS = 8
"""``digits_cnn``'s layers in the zoo profile."""
GLOBAL_BATCH = 32
MICROBATCH = 8
STEPS = (10, 40, 80, 160)
SIZES = (1, 2, 3, 4)
SIZE_WEIGHTS = (0.35, 0.3, 0.2, 0.15)
"""How often a job's plan has 1, 2, 3 or 4 devices."""
HIGH_PRIORITY = 10
HIGH_SHARE = 0.15
"""The share of the jobs posted with :data:`HIGH_PRIORITY` (the others: 0)."""
SEED = 42
POLL_S = 0.5
START_TIMEOUT_S = 300.0
GROUPS_TIMEOUT_S = 60.0
TERMINAL = ("succeeded", "failed", "cancelled")
console = Console(width=shutil.get_terminal_size((120, 40)).columns)

Doc = dict[str, Any]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50, help="jobs to submit [50]")
    ap.add_argument("--seed", type=int, default=SEED, help=f"the jobs' draw [{SEED}]")
    ap.add_argument(
        "--timeout", type=float, default=None, help="seconds for all jobs to end [60 per job]"
    )
    ap.add_argument("--quick", action="store_true", help="12 jobs")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    ap.add_argument("--plot", default=None, help="only draw this result file's PNG again")
    a = ap.parse_args()
    if a.quick:
        a.jobs = 12
    if a.jobs < 1:
        ap.error(f"--jobs: must be >= 1, got {a.jobs}")
    if a.timeout is None:
        a.timeout = 60.0 * a.jobs
    return a


# --- the jobs ---------------------------------------------------------------------------------


def preset_devices() -> list[str]:
    from pipeplan.service.tasks.common import cluster_spec

    return list(cluster_spec(PRESET).device_ids)


def plan_doc(rng: random.Random, devices: Sequence[str], size: int) -> Doc:
    """A pipeline of ``size`` of ``devices`` (drawn), one per stage, the layers cut at
    random."""
    chosen = rng.sample(list(devices), size)
    cuts = sorted(rng.sample(range(1, LAYERS), size - 1))
    bounds = [0, *cuts, LAYERS]
    stages = [
        {"layers": [bounds[i], bounds[i + 1]], "devices": [d], "microbatch": MICROBATCH}
        for i, d in enumerate(chosen)
    ]
    return {"global_batch": GLOBAL_BATCH, "stages": stages}


def draw_jobs(n: int, seed: int, devices: Sequence[str]) -> list[Doc]:
    """``n`` jobs' plans, steps and priorities (module docstring), the same for a seed."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        size = rng.choices(SIZES, SIZE_WEIGHTS)[0]
        jobs.append(
            {
                "name": f"sched-{i}",
                "plan": plan_doc(rng, devices, size),
                "steps": rng.choice(STEPS),
                "priority": HIGH_PRIORITY if rng.random() < HIGH_SHARE else 0,
            }
        )
    return jobs


def plan_devices(plan: Doc) -> list[str]:
    return [d for s in plan["stages"] for d in s["devices"]]


# --- the figures (pure: the unit tests' part) -------------------------------------------------


def seconds(later: str | None, earlier: str | None) -> float | None:
    if later is None or earlier is None:
        return None
    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()


def timeline(intervals: Sequence[tuple[float, float, int]]) -> tuple[list[float], list[int]]:
    """The devices held as a step function of time: the times at which the count changes
    and the count from each until the next (the last is 0), from ``(start, end, devices)``
    per job."""
    deltas: dict[float, int] = {}
    for start, end, n in intervals:
        deltas[start] = deltas.get(start, 0) + n
        deltas[end] = deltas.get(end, 0) - n
    times = sorted(deltas)
    held, count = [], 0
    for t in times:
        count += deltas[t]
        held.append(count)
    return times, held


def busy_area(times: Sequence[float], held: Sequence[int]) -> float:
    """Device-seconds under the step function of :func:`timeline`."""
    return float(sum(h * (b - a) for a, b, h in zip(times, times[1:], held, strict=False)))


def bound(intervals: Sequence[tuple[float, float, int]], devices: int) -> float:
    """The shortest makespan of these run times on ``devices`` devices: the device-seconds
    they hold, divided by the devices."""
    return sum((end - start) * n for start, end, n in intervals) / devices


def percentiles(xs: Sequence[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50_s": None, "p99_s": None, "max_s": None, "n": 0}
    a = np.asarray(xs, dtype=float)
    return {
        "p50_s": float(np.percentile(a, 50)),
        "p99_s": float(np.percentile(a, 99)),
        "max_s": float(a.max()),
        "n": len(xs),
    }


def assign_devices(jobs: Sequence[Doc], devices: Sequence[str]) -> list[list[str]]:
    """Per job, the devices of ``devices`` it held: Ray reserves a node's devices of one type
    as a count, so a job naming a device another job holds gets a free one of the same type
    on the same node. In order of start, each device a job's plan names (``devices``) goes
    to the one named if it is free at the job's ``start``, else to a free one of its node
    and type; if none is (the timestamps are those of events, not of the reservation), to
    the one named, shared."""

    def kind(d: str) -> tuple[str, str]:
        node, dtype, _ = parse_device_id(d)
        return node, dtype

    free_at = dict.fromkeys(devices, -math.inf)
    out: list[list[str]] = [[] for _ in jobs]
    for k in sorted(range(len(jobs)), key=lambda k: jobs[k]["start"]):
        job = jobs[k]
        for d in job["devices"]:
            same = [d, *(o for o in devices if o != d and kind(o) == kind(d))]
            pick = next((o for o in same if o not in out[k] and free_at[o] <= job["start"]), d)
            free_at[pick] = max(free_at[pick], job["end"])
            out[k].append(pick)
    return out


def released_before(job: Doc, others: Sequence[Doc]) -> float:
    """When the devices ``job`` held were last released before it started (job times in
    seconds from the first submission: ``submit``, ``start``, ``end``, and ``held``, from
    :func:`assign_devices`), or its submission if later: the moment it could have
    started."""
    mine = set(job["held"])
    ends = [
        o["end"]
        for o in others
        if o is not job and mine & set(o["held"]) and o["end"] <= job["start"]
    ]
    return max([job["submit"], *ends])


def waited(events: Sequence[Doc], behind_seen: bool) -> bool:
    """Whether a job waited: a ``waiting`` event naming devices, or seen held behind
    others."""
    return behind_seen or any(
        e["type"] == "waiting" and (e.get("data") or {}).get("devices") for e in events
    )


def summarise(jobs: Sequence[Doc], devices: int) -> Doc:
    """The figures of the module docstring from the jobs' times (seconds from the first
    submission) and whether each waited."""
    intervals = [(j["start"], j["end"], len(j["devices"])) for j in jobs]
    times, held = timeline(intervals)
    makespan = max(j["end"] for j in jobs) - min(j["submit"] for j in jobs)
    low = bound(intervals, devices)
    free = [j["start"] - j["submit"] for j in jobs if not j["waited"]]
    after = [j["start"] - released_before(j, jobs) for j in jobs if j["waited"]]
    return {
        "makespan_s": makespan,
        "bound_s": low,
        "makespan_over_bound": makespan / low if low > 0 else None,
        "mean_utilisation": busy_area(times, held) / (devices * makespan) if makespan else None,
        "max_devices_held": max(held) if held else 0,
        "queue_wait": percentiles([j["start"] - j["submit"] for j in jobs]),
        "run_time": percentiles([j["end"] - j["start"] for j in jobs]),
        "overhead_no_wait": percentiles(free),
        "overhead_after_release": percentiles(after),
        "waited_for_devices_in_ray": percentiles(
            [j["ray_wait_s"] for j in jobs if j["ray_wait_s"] is not None]
        ),
        "start_interval": percentiles(list(np.diff(sorted(j["start"] for j in jobs)))),
        "jobs_waited": sum(j["waited"] for j in jobs),
    }


def plot(jobs: Sequence[Doc], devices: Sequence[str], path: Path) -> None:
    """The devices held over time, and below it each device's jobs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, held = timeline([(j["start"], j["end"], len(j["devices"])) for j in jobs])
    fig, (top, gantt) = plt.subplots(
        2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]}
    )
    top.step(times, held, where="post", color="tab:blue")
    top.fill_between(times, held, step="post", alpha=0.3, color="tab:blue")
    top.axhline(len(devices), color="grey", ls="--", lw=1)
    top.set_ylim(0, len(devices) + 0.5)
    top.set_ylabel("devices held")
    top.set_title(f"{len(jobs)} run jobs on {PRESET} ({len(devices)} devices, EMULATED)")
    colours = plt.get_cmap("tab20")
    for k, j in enumerate(jobs):
        for d in j["held"]:
            row = devices.index(d)
            gantt.barh(
                row,
                j["end"] - j["start"],
                left=j["start"],
                height=0.8,
                color=colours(k % 20),
                edgecolor="black" if j["priority"] > 0 else "none",
                linewidth=1.5,
            )
            gantt.text(j["start"], row, f" {k}", va="center", fontsize=6)
    gantt.set_xlim(left=0)
    gantt.set_yticks(range(len(devices)), devices)
    gantt.invert_yaxis()
    gantt.set_xlabel("seconds since the first submission (black edge: higher priority)")
    gantt.set_ylabel("devices held (assign_devices)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the run ----------------------------------------------------------------------------------


def spec(job: Doc, profile: Doc) -> Doc:
    return {"plan": job["plan"], "profile": profile, "cluster": PRESET, "steps": job["steps"]}


def submit_all(server: ServerProcess, jobs: Sequence[Doc], profile: Doc) -> list[str]:
    ids = []
    with server.client(timeout_s=60) as c:
        for j in jobs:
            body = {"kind": "run", "spec": spec(j, profile), "name": j["name"]}
            r = c.post("/v1/jobs", json=body | {"priority": j["priority"]})
            if r.status_code != 201:
                raise RuntimeError(f"submit: {r.status_code} {r.text[:300]}")
            ids.append(r.json()["id"])
    return ids


def poll(server: ServerProcess, ids: Sequence[str], timeout_s: float) -> dict[str, Doc]:
    """Until every job has ended: per job, whether it was seen held behind others, the
    devices it was seen waiting for, and the most jobs seen queued at once."""
    seen: dict[str, Doc] = {i: {"behind": False, "devices": False} for i in ids}
    t0 = time.perf_counter()
    with server.client(timeout_s=60) as c:
        while time.perf_counter() - t0 < timeout_s:
            page = c.get("/v1/jobs", params={"limit": 1000, "kind": "run"}).json()["items"]
            states = {}
            for job in page:
                if job["id"] not in seen:
                    continue
                states[job["id"]] = job["state"]
                w = job.get("waiting_for") or {}
                seen[job["id"]]["behind"] |= bool(w.get("behind"))
                seen[job["id"]]["devices"] |= bool(w.get("devices"))
            if len(states) == len(ids) and all(s in TERMINAL for s in states.values()):
                return seen
            time.sleep(POLL_S)
    raise RuntimeError(f"the jobs did not all end in {timeout_s:.0f} s")


def collect(server: ServerProcess, ids: Sequence[str], seen: dict[str, Doc]) -> list[Doc]:
    """Each job as the service has it, with its events."""
    out = []
    with server.client(timeout_s=60) as c:
        for i in ids:
            job = c.get(f"/v1/jobs/{i}").json()
            events = c.get(f"/v1/jobs/{i}/events").json()
            out.append({"job": job, "events": events, "seen": seen[i]})
    return out


def times(raw: Sequence[Doc], drawn: Sequence[Doc]) -> list[Doc]:
    """The jobs' times in seconds from the first submission, their devices and waits."""
    first = min(r["job"]["created_at"] for r in raw)
    rows = []
    for r, d in zip(raw, drawn, strict=True):
        job, events = r["job"], r["events"]
        granted = [
            e["data"]["waited_s"]
            for e in events
            if e["type"] == "waiting" and "waited_s" in (e.get("data") or {})
        ]
        rows.append(
            {
                "id": job["id"],
                "name": job["name"],
                "state": job["state"],
                "priority": job["priority"],
                "devices": plan_devices(d["plan"]),
                "steps": d["steps"],
                "submit": seconds(job["created_at"], first),
                "start": seconds(job["started_at"], first),
                "end": seconds(job["finished_at"], first),
                "waited": waited(events, r["seen"]["behind"]),
                "seen_behind": r["seen"]["behind"],
                "waiting_events": sum(
                    e["type"] == "waiting" and bool((e.get("data") or {}).get("devices"))
                    for e in events
                ),
                "ray_wait_s": granted[-1] if granted else None,
            }
        )
    return rows


GROUPS_CHILD = """
import json, sys
from ray.util.placement_group import placement_group_table
from pipeplan.executor import runtime
runtime.connect(sys.argv[1])
table = placement_group_table()
print(json.dumps([{"name": g.get("name"), "state": g.get("state")} for g in table.values()]))
runtime.shutdown()
"""


def placement_groups_left(address: str) -> Doc:
    """The ``pipeplan:`` placement groups not removed, read from a process that joins the
    cluster at ``address`` (Ray removes a job's group with its driver, a moment after the
    job ends: read again until none is left or :data:`GROUPS_TIMEOUT_S`)."""
    t0 = time.perf_counter()
    left: list[Doc] = []
    while time.perf_counter() - t0 < GROUPS_TIMEOUT_S:
        done = subprocess.run(
            [sys.executable, "-c", GROUPS_CHILD, address],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode:  # the message may name paths: on the console only
            print(f"placement groups: {done.stderr[-1500:]}", file=sys.stderr)
            return {"checked": False}
        groups = json.loads(done.stdout.strip().splitlines()[-1])
        left = [
            g for g in groups if str(g["name"]).startswith("pipeplan:") and g["state"] != "REMOVED"
        ]
        if not left:
            return {"checked": True, "groups_seen": len(groups), "left": []}
        time.sleep(2.0)
    return {"checked": True, "left": left}


def run(a: argparse.Namespace, tmp: Path, drawn: Sequence[Doc], profile: Doc) -> Doc:
    """The service, the burst, the polling, the jobs' records, the group check, the stop."""
    from pipeplan.executor.local.persistent_cluster import read_state

    server = serve_process(tmp, secrets.token_urlsafe(24))
    server.argv[server.argv.index("--cluster") + 1] = PRESET
    server.env["PIPEPLAN_POOL_SIZE"] = "0"
    out: Doc = {}
    try:
        server.start()
        out["service_start_s"] = server.wait_healthy(START_TIMEOUT_S)
        t0 = time.perf_counter()
        ids = submit_all(server, drawn, profile)
        out["submit_all_s"] = time.perf_counter() - t0
        console.print(f"submitted {len(ids)} jobs in {out['submit_all_s']:.1f} s")
        seen = poll(server, ids, a.timeout)
        out["poll_s"] = time.perf_counter() - t0
        out["raw"] = collect(server, ids, seen)
        out["placement_groups"] = placement_groups_left(read_state(tmp / "state").address)
    except Exception as e:  # named in the results; the service's log tail on stderr
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"{e}\n{server.tail()}", file=sys.stderr)
    finally:
        out |= stop_everything(server, tmp / "state")
    return out


def print_table(rows: Sequence[Doc], s: Doc) -> None:
    t = table(
        "scheduler: a burst of run jobs on local-pipeline (s)", ["figure", "value"], ["figure"]
    )

    def p(key: str) -> str:
        v = s[key]
        return f"p50 {fmt(v['p50_s'], '.1f')}, p99 {fmt(v['p99_s'], '.1f')} (n={v['n']})"

    t.add_row("jobs (succeeded)", f"{len(rows)} ({sum(r['state'] == 'succeeded' for r in rows)})")
    t.add_row("makespan", fmt(s["makespan_s"], ".1f"))
    t.add_row("bound (sum run x devices / 6)", fmt(s["bound_s"], ".1f"))
    t.add_row("makespan / bound", fmt(s["makespan_over_bound"], ".2f", "x"))
    t.add_row("mean utilisation", fmt(s["mean_utilisation"], ".1%"))
    t.add_row("run time", p("run_time"))
    t.add_row("queue wait", p("queue_wait"))
    t.add_row("overhead, no wait (submit -> running)", p("overhead_no_wait"))
    t.add_row("overhead, waited (released -> running)", p("overhead_after_release"))
    t.add_row("waited in Ray for devices", p("waited_for_devices_in_ray"))
    t.add_row("between one start and the next", p("start_interval"))
    console.print(t)


def replot(path: Path) -> None:
    """The PNG of result file ``path`` (beside it), from the jobs it recorded."""
    doc = json.loads(path.read_text())
    ok = [j for j in doc["jobs"] if j["state"] == "succeeded"]
    plot(ok, doc["parameters"]["devices"], path.with_suffix(".png"))
    print(f"wrote {display(path.with_suffix('.png'))}")


def main() -> None:
    a = parse_args()
    if a.plot:
        replot(Path(a.plot))
        return
    bench = BenchRun("scheduler_quick" if a.quick else "scheduler")
    from pipeplan.service.tasks.common import zoo_profile
    from pipeplan.service.tasks.progress import QUIET

    devices = preset_devices()
    drawn = draw_jobs(a.jobs, a.seed, devices)
    profile = zoo_profile(MODEL, None, QUIET).to_dict()
    with tempfile.TemporaryDirectory(prefix="pipeplan-bench-") as tmp:
        res = run(a, Path(tmp), drawn, profile)
    raw = res.pop("raw", [])
    rows = times(raw, drawn) if raw else []
    failed = [r for r in raw if r["job"]["state"] != "succeeded"]
    for r in failed:  # on the console only: the errors may name paths of this machine
        print(f"job {r['job']['id']} {r['job']['state']}: {r['job']['error']}", file=sys.stderr)
    ok = [r for r in rows if r["state"] == "succeeded"]
    for r, held in zip(ok, assign_devices(ok, devices), strict=True):
        r["held"] = held
    s = summarise(ok, len(devices)) if ok else {}
    if s:
        print_table(rows, s)
    path = Path(a.out) if a.out else bench.path()
    groups = res.get("placement_groups", {})
    out = {
        "parameters": {
            "jobs": a.jobs,
            "seed": a.seed,
            "preset": PRESET,
            "devices": devices,
            "model": MODEL,
            "global_batch": GLOBAL_BATCH,
            "microbatch": MICROBATCH,
            "steps": list(STEPS),
            "sizes": dict(zip(map(str, SIZES), SIZE_WEIGHTS, strict=True)),
            "high_priority": HIGH_PRIORITY,
            "poll_s": POLL_S,
            "pool_size": 0,
        },
        "all_succeeded": bool(raw) and not failed,
        "failed": [{"id": r["job"]["id"], "state": r["job"]["state"]} for r in failed],
        "placement_groups_left": groups.get("left") if groups.get("checked") else None,
        "figure": path.with_suffix(".png").name if ok else None,
        "summary": s,
        "service": res,
        "jobs": rows,
    }
    written = bench.write(out, out=path)
    if ok:
        plot(ok, devices, written.with_suffix(".png"))
    print(f"wrote {display(written)}" + (" and .png" if ok else ""))
    if not out["all_succeeded"] or "error" in res:
        print(f"FAILED: {len(failed)} of {len(raw)} jobs did not succeed", file=sys.stderr)
        sys.exit(1)
    if groups.get("left"):
        print(f"FAILED: placement groups left: {groups['left']}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
