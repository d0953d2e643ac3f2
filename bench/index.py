"""The index of the benchmarks' results: a README per folder of ``bench/results/``.

Each ``bench/results/<bench>/README.md`` lists that benchmark's runs, newest first: when
(UTC, from the file's name), the commit, the load average before and after (1 minute), the
wall time and the benchmark's headline figure where one is obvious (:data:`HEADLINES`), each
linking to its file. ``bench/results/README.md`` lists the benchmarks with their newest run.
A figure a run does not record (runs from before :mod:`bench.record`) shows as ``?``.

    .venv/bin/python -m bench.index          # after a run: rewrites every README
    .venv/bin/python -m bench.index --check  # exit 1 if a README is not up to date

Reads the JSON files only: no torch, no Ray.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.record import RESULTS

Doc = dict[str, Any]


# --- the headline figures ---------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x:.1%}"


def fidelity(d: Doc) -> str:
    line = f"median \\|error\\| {_pct(d.get('median_abs_rel_error'))}, worst "
    line += _pct(d.get("max_abs_rel_error"))
    plan = d.get("verdicts", {}).get("calibrated (held-out plan)")
    if plan:
        line += f"; held out by plan {_pct(plan['median'])} / {_pct(plan['max'])}"
    return line


def tapp_table(d: Doc) -> str:
    speedups = [
        f"{m['model']} {m['claim']['measured_speedup_vs_bsp']:.2f}x"
        for m in d["models"]
        if m["claim"].get("measured_speedup_vs_bsp") is not None
    ]
    own = [
        f"{m['model']} {r['speedup_vs_bsp']:.2f}x"
        for m in d["models"]
        for r in m["rows"]
        if r["method"] == "TAPP" and r.get("speedup_vs_bsp") is not None
    ]
    line = "Planned over BSP: " + ", ".join(speedups)
    return line + ("; TAPP's own plan: " + ", ".join(own) if own else "")


def links(d: Doc) -> str:
    return "; ".join(
        f"{cls} {c['fit']['bandwidth_gbps']:.2f} Gbit/s, {c['fit']['latency_us']:.0f} us"
        for cls, c in d["classes"].items()
    )


def calibration_refit(d: Doc) -> str:
    p99 = {k: d[k]["p99_ms"] for k in ("idle", "fit_in_api_thread", "fit_in_worker_process")}
    return (
        f"p99 {p99['fit_in_api_thread']:.0f} ms fitting in the API thread, "
        f"{p99['fit_in_worker_process']:.0f} ms in the worker ({p99['idle']:.0f} idle)"
    )


def cluster_use(d: Doc) -> str:
    ppo = " / ".join(f"{r['samples_per_s']:.0f}" for r in d["ppo"])
    evals = " / ".join(f"{r['evaluations_per_hour']:.0f}" for r in d["measured"])
    return f"PPO samples/s with 0/1/2 runners {ppo}; evaluations/hour alone/at once {evals}"


def grad_accumulation(d: Doc) -> str:
    ratio = statistics.median(r["ratio"] for r in d["rows"])
    return f"accumulating / fresh backward: median {ratio:.2f}x"


def update_bandwidth(d: Doc) -> str:
    sgd = [r["rule8_bandwidth_gbps"] for r in d["rows"] if r["optimizer"] == "sgd"]
    return f"plain SGD: median {statistics.median(sgd):.1f} GB/s"


def idle_slowdown(d: Doc) -> str:
    return "; ".join(f"{r['case']} {r['median_cpu_over_profile']:.2f}x" for r in d["rows"])


def ppo_quality(d: Doc) -> str:
    worst = max(r["ppo_gap"] for i in d["instances"] for r in i["runs"])
    return f"worst gap {worst:+.2%} (target {d['target']:.0%}: {'met' if d['met'] else 'NOT met'})"


def service_load(d: Doc) -> str:
    s = d["summary"]
    return (
        f"{s['events_per_s_job_sender']:,.0f} events/s (job sender), "
        f"lost {s['events_lost']}, doubled {s['events_doubled']}"
    )


def simulator_speed(d: Doc) -> str:
    case = d["cases"]["gpipe, M=8"]
    return f"GPipe M=8: {case['vectorised_plans_per_s']:,.0f} plans/s"


def plan_quality_realistic(d: Doc) -> str:
    worst = {
        lb: max(i["learned"][lb]["worst_gap"] for i in d["instances"])
        for lb in d["instances"][0]["learned"]
    }
    return "worst gap " + ", ".join(f"{lb} {g:+.2%}" for lb, g in worst.items())


def train(d: Doc) -> str:
    s = d["summary"]
    single = ", ".join(f"{m} {r:.2f}x" for m, r in s["planned_vs_single"].items())
    bsp = ", ".join(f"{r:.2f}x" for r in s["planned_vs_bsp"].values())
    worst = s["max_abs_loss_difference"]
    return f"planned over single device: {single}; over BSP {bsp}; loss vs one process {worst:.1e}"


def service_latency(d: Doc) -> str:
    r = d["summary"]["rows"]
    one = [
        f"{k[:-3]} {v['ray_jobs_p50_s']:.1f} -> {v['pool_p50_s']:.2f}"
        for k, v in r.items()
        if k.endswith(" x1")
    ]
    return "p50 s, one job, Ray Jobs -> pool: " + ", ".join(one)


def scheduler(d: Doc) -> str:
    s = d["summary"]
    return (
        f"{len(d['jobs'])} jobs: makespan {s['makespan_s']:.0f} s = "
        f"{s['makespan_over_bound']:.2f}x the bound, queue wait p50 "
        f"{s['queue_wait']['p50_s']:.0f} s, overhead without a wait p50 "
        f"{s['overhead_no_wait']['p50_s']:.1f} s"
    )


def scale(d: Doc) -> str:
    runs = [r for i in d["instances"] for r in i["planners"].values()]
    answered = sum(r["status"] == "ok" for r in runs)
    best = [i["best_ratio_to_bound"] for i in d["instances"] if i["best_ratio_to_bound"]]
    line = f"{answered} of {len(runs)} planner runs answered"
    if best:
        line += f"; best per instance {min(best):.2f}x-{max(best):.2f}x the bound"
    none = sum(i["best_ratio_to_bound"] is None for i in d["instances"])
    return line + (f"; {none} of {len(d['instances'])} instances without a plan" if none else "")


def elastic(d: Doc) -> str:
    s = d["summary"]

    def ranged(part: str, way: str, scale: float = 1.0, unit: str = "") -> str:
        r = s[part][way]
        return f"{r['median'] * scale:.0f}{unit} ({r['min'] * scale:.0f}-{r['max'] * scale:.0f})"

    return "; ".join(
        f"{way}: resumed in {ranged('resumed_s', way, unit=' s')}, "
        f"{ranged('after_samples_per_s', way)} samples/s after "
        f"vs {ranged('before_samples_per_s', way)} before"
        for way in ("elastic", "by hand")
    )


def runtime(d: Doc) -> str:
    s = d["summary"]
    line = (
        f"old/new step time over {s['plans']} plans: median {s['ratio_median']:.2f}x "
        f"({s['ratio_min']:.2f}x-{s['ratio_max']:.2f}x)"
    )
    slower = s.get("new_slower_on") or []
    return line + (f"; new slower on {', '.join(slower)}" if slower else "; new never slower")


HEADLINES: dict[str, Callable[[Doc], str]] = {
    "runtime": runtime,
    "elastic": elastic,
    "train": train,
    "train_quick": train,
    "fidelity": fidelity,
    "fidelity_quick": fidelity,
    "tapp_table": tapp_table,
    "tapp_table_quick": tapp_table,
    "links": links,
    "calibration_refit": calibration_refit,
    "cluster_use": cluster_use,
    "grad_accumulation": grad_accumulation,
    "update_bandwidth": update_bandwidth,
    "idle_slowdown": idle_slowdown,
    "ppo_quality": ppo_quality,
    "service_load": service_load,
    "service_load_quick": service_load,
    "service_latency": service_latency,
    "service_latency_quick": service_latency,
    "scheduler": scheduler,
    "scheduler_quick": scheduler,
    "simulator_speed": simulator_speed,
    "plan_quality_realistic": plan_quality_realistic,
    "scale": scale,
    "scale_quick": scale,
}
"""Benchmark -> its headline figure (``links_<cluster>`` reads as ``links``)."""


def headline(bench: str, doc: Doc) -> str:
    """The run's headline figure, or ``-`` where the benchmark has none (or the run lacks it)."""
    fn = HEADLINES.get("links" if bench.startswith("links_") else bench)
    if fn is None:
        return "-"
    try:
        return fn(doc)
    except (KeyError, TypeError, ValueError, IndexError, statistics.StatisticsError):
        return "-"


# --- the tables -------------------------------------------------------------------------------


def _load(values: Any) -> str:
    return f"{values[0]:.1f}" if isinstance(values, list) and values else "?"


def _commit(p: Doc) -> str:
    git = p.get("git", {})
    if isinstance(git, dict) and git.get("commit", "unknown") != "unknown":
        return git["commit"][:7] + (" (uncommitted changes)" if git.get("dirty") is True else "")
    if isinstance(git, dict) and git.get("added_in"):
        return f"? (file added in {git['added_in'][:7]})"
    return "?"


def _wall(p: Doc) -> str:
    wall = p.get("wall_s")
    if not isinstance(wall, int | float):
        return "?"
    return f"{wall:.0f} s" if wall < 120 else f"{wall / 60:.1f} min"


def _when(path: Path) -> str:
    """``2026-11-28T07-05-09Z`` -> ``2026-11-28 07:05:09``."""
    day, _, time = path.stem.partition("T")
    return f"{day} {time.rstrip('Z').replace('-', ':')}"


def row(bench: str, path: Path) -> list[str]:
    """One run's cells: run, commit, load before -> after, wall, headline."""
    doc = json.loads(path.read_text())
    p = doc.get("provenance", {})
    load = f"{_load(p.get('load_before'))} -> {_load(p.get('load_after'))}"
    return [f"[{_when(path)}]({path.name})", _commit(p), load, _wall(p), headline(bench, doc)]


def _markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def runs(folder: Path) -> list[Path]:
    """The folder's result files, newest first."""
    return sorted(folder.glob("*.json"), reverse=True)


def command_of(bench: str) -> str:
    """The command whose runs land in ``bench``'s folder (a variant is a name of its own)."""
    if bench.endswith("_quick"):
        return f"python -m bench.{bench.removesuffix('_quick')} --quick"
    if bench.startswith("links_"):
        return f"python -m bench.links --cluster examples/clusters/{bench[6:]}.yaml"
    variants = {
        "plan_quality_realistic": "python -m bench.plan_quality --realistic",
        "umpipe_sweep_measured": "python -m bench.umpipe_sweep --measure DEPTHS",
    }
    return variants.get(bench, f"python -m bench.{bench}")


def bench_readme(folder: Path) -> str:
    bench = folder.name
    header = ["run (UTC)", "commit", "load (1 min) before -> after", "wall", "headline"]
    lines = [
        f"# `{bench}` runs",
        "",
        f"Every run of `{command_of(bench)}` writes a file here (`bench/record.py`),",
        "named by when it started; newest first. A run from before that is named by the date",
        "its file recorded, or by its commit's where it recorded none, and `?` is what it did",
        "not record (each file's `provenance` says which). Written by `python -m bench.index`.",
        "",
        *_markdown(header, [row(bench, p) for p in runs(folder)]),
    ]
    return "\n".join(lines) + "\n"


def results_readme(folders: list[Path]) -> str:
    rows = []
    for folder in folders:
        files = runs(folder)
        newest = files[0]
        rows.append(
            [
                f"[`{folder.name}`]({folder.name}/README.md)",
                str(len(files)),
                f"[{_when(newest)}]({folder.name}/{newest.name})",
                headline(folder.name, json.loads(newest.read_text())),
            ]
        )
    lines = [
        "# Benchmark results",
        "",
        "One folder per benchmark, one JSON file per run (`bench/record.py`), named by when",
        "it started (UTC); each folder's README lists its runs. Written by",
        "`python -m bench.index`.",
        "",
        *_markdown(["benchmark", "runs", "newest (UTC)", "headline of the newest"], rows),
    ]
    return "\n".join(lines) + "\n"


def pages(results: Path = RESULTS) -> dict[Path, str]:
    """Every README this writes, by path."""
    folders = sorted(f for f in results.iterdir() if f.is_dir() and any(f.glob("*.json")))
    out = {f / "README.md": bench_readme(f) for f in folders}
    out[results / "README.md"] = results_readme(folders)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a README is out of date")
    ap.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    stale = []
    for path, text in pages(a.results).items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not a.check:
            path.write_text(text)
    verb = "out of date" if a.check else "written"
    for path in stale:
        print(f"{verb}: {path.relative_to(a.results.parent.parent)}")
    if a.check and stale:
        sys.exit(1)


if __name__ == "__main__":
    main()
