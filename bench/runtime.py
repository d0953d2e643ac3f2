"""The stage runtime on torch.distributed against the object-ref runtime it replaced.

Two measurements, each engine in the same run:

1. **Step time per plan.** On ``local-pipeline`` and ``local-hetero``, for AlexNet@224, a
   small GPT (2 layers, d_model 256, context 32) and VGG-16@32: a two-stage plan under GPipe
   and under 1F1B, and the same cut with its second stage replicated on two devices. Each
   plan trains ``--warmup`` + ``--steps`` batches of synthetic data without emulation (the
   emulated sleeps would add the same seconds to both engines and hide the transport),
   ``--rounds`` times on each engine, the engines taking turns plan by plan (old then new,
   then new then old, ...): both engines' clusters stay up side by side, so a minute when
   another process slows this 2-core machine falls on both engines' runs of a plan rather
   than on one engine's. The table gives the mean step time of each engine over every
   round's measured steps and their ratio (old / new: above 1 means the new runtime is
   faster), and the ratio of the steps' medians, which one slowed step moves less.
2. **One transfer.** Two probe actors on two Ray nodes pass one tensor of 0.5, 4 and 64 MB:
   the old way (the sender returns it as a numpy array, the receiver takes the object ref as
   an argument: Ray's object store) and the new way (``isend``/``irecv`` over a gloo process
   group). Each is timed from the driver, the median of ``--repeats``.

The **old** engine is the object-ref runtime as it was at ``--baseline`` (a commit before the
torch.distributed runtime): the bench checks it out into a temporary git worktree and runs
the same plan code there, in a subprocess whose ``PYTHONPATH`` points at that tree (its
packages were still top-level ``core``, ``executor``, ...). The **new** engine is this
checkout. Each engine gets its own local Ray cluster per preset, started and stopped here, with the
object store it needs (:data:`STORE_MB`).

    .venv/bin/python -m bench.runtime            # ~25 minutes on a 2-core machine
    .venv/bin/python -m bench.runtime --quick    # AlexNet and the GPT on local-hetero only

Prints a table and writes ``bench/results/runtime/<UTC date-time>.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "a8ba6fc"
"""The last commit of the object-ref runtime (its ring all-reduce passed by the driver)."""
CLUSTERS = ("local-pipeline", "local-hetero")
GPT_OPTIONS = {"n_layer": 2, "d_model": 256, "n_head": 4, "n_ctx": 32, "vocab_size": 4096}
MODELS: dict[str, dict[str, Any]] = {
    "alexnet@224": {"name": "alexnet", "input_size": 224, "batch": 32, "micro": 8},
    "gpt-2L@32": {"name": "gpt", "input_size": 32, "batch": 16, "micro": 4, "options": GPT_OPTIONS},
    "vgg16@32": {"name": "vgg16", "input_size": 32, "batch": 16, "micro": 4},
}
DEVICES = {  # (first stage, second stage, the second stage replicated)
    "local-pipeline": ("n0/fast:0", "n1/mid:0", ("n1/mid:1", "n1/mid:2")),
    "local-hetero": ("n0/fast:0", "n1/mid:0", ("n2/slow:0", "n2/slow:1")),
}
PLANS = ("gpipe", "1f1b", "replicated")
SIZES_MB = (0.5, 4.0, 64.0)
STORE_MB = {"": 2400, "pipeplan.": 300}
"""Object store per Ray node, per engine (by its module prefix): the old runtime moved every
activation, gradient and ring chunk through the store (bench.fidelity gave it 2400 MB, so
that a VGG-16 ring chunk and its copy fit without spilling); the new one moves only the
batch there."""


# --- the worker side: runs in either tree ------------------------------------------------------


def _modules(prefix: str) -> dict[str, Any]:
    names = {
        "cluster": "core.cluster",
        "plan": "core.plan",
        "local": "executor.local_cluster",
        "model": "executor.model",
        "pipeline": "executor.pipeline",
        "partition": "executor.partition",
    }
    return {k: importlib.import_module(prefix + v) for k, v in names.items()}


def _plans(m: dict[str, Any], cluster: str, layers: int, case: dict[str, Any]) -> list[Any]:
    Plan, Stage, Schedule = m["plan"].Plan, m["plan"].Stage, m["plan"].Schedule
    first, second, pair = DEVICES[cluster]
    cut, batch, micro = layers // 2, case["batch"], case["micro"]

    def two(devices: tuple[str, ...], schedule: Any) -> Any:
        return Plan(
            batch,
            (Stage((0, cut), (first,), micro), Stage((cut, layers), devices, micro)),
            schedule,
        )

    return [  # in the order of PLANS
        ("gpipe", two((second,), Schedule.GPIPE)),
        ("1f1b", two((second,), Schedule.ONE_F_ONE_B)),
        ("replicated", two(pair, Schedule.GPIPE)),
    ]


ROW = "@@row "
"""Marks a line of a serving worker's stdout as its answer (Ray writes its own lines there)."""


def serve(prefix: str, cluster: str, steps: int, warmup: int) -> None:
    """Keep a local cluster of this tree's engine up and run, one by one, the plans the driver
    names on stdin (``MODEL PLAN`` a line), each answered by a row on stdout."""
    m = _modules(prefix)
    spec = m["cluster"].ClusterSpec.load(ROOT / "examples" / "clusters" / f"{cluster}.yaml")
    config = m["pipeline"].RunConfig(
        steps=steps, warmup=warmup, emulate=False, data="synthetic", timeout_s=600
    )
    built: dict[str, tuple[Any, dict[str, Any]]] = {}
    with m["local"].LocalCluster(spec, object_store_mb=STORE_MB[prefix]):
        print(ROW + json.dumps({"ready": cluster}), flush=True)
        for line in sys.stdin:
            key, label = line.split()
            case = MODELS[key]
            if key not in built:
                source = m["model"].ModelSource(
                    case["name"], case["input_size"], options=case.get("options", {})
                )
                layers = m["partition"].count_layers(source.build()[0])
                built[key] = source, dict(_plans(m, cluster, layers, case))
            source, plans = built[key]
            meas = m["pipeline"].run(plans[label], source, spec, config)
            row = {
                "cluster": cluster,
                "model": key,
                "plan": label,
                "steps_s": list(meas.batch_times_s),
                "transfer_s": sum(st.transfer_s for st in meas.stages),
                "allreduce_s": sum(st.allreduce_s for st in meas.stages),
            }
            print(ROW + json.dumps(row), flush=True)


def transfer_probe(prefix: str, repeats: int) -> list[dict]:
    """One transfer between two Ray nodes, the old way and the new way (module docstring).
    The gloo pair is ``bench.links``' probes (a send posted, its receive posted ahead);
    both ways are timed from the driver, call to answer."""
    import numpy as np
    import ray
    import torch

    from bench import links
    from pipeplan.executor.live_cluster import node_resource

    @ray.remote(num_cpus=0)
    class ObjectProbe:
        """One end of a transfer through the object store, as the old stages made them."""

        def emit(self, n: int) -> np.ndarray:
            return np.ones(n, dtype=np.uint8)

        def take(self, array: np.ndarray) -> int:
            return int(torch.from_numpy(np.array(array)).numel())

    m = _modules(prefix)
    spec = m["cluster"].ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    devices = ["n0/fast:0", "n1/mid:0"]
    rows = []
    with m["local"].LocalCluster(spec, object_store_mb=300):
        # on the devices' nodes by their markers: the devices themselves are the gloo pair's
        a, b = (
            ObjectProbe.options(resources={node_resource(d.split("/")[0]): 0.001}).remote()  # type: ignore[attr-defined]
            for d in devices
        )
        sender, receiver = links.group(devices)
        for mb in SIZES_MB:
            n = int(mb * 2**20)
            old, new = [], []
            for _ in range(repeats + 1):  # the first of each is a warm-up
                t0 = time.perf_counter()
                ray.get(b.take.remote(a.emit.remote(n)))
                old.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ray.get([sender.send.remote(n, 1), receiver.recv.remote(n, 0)])
                new.append(time.perf_counter() - t0)
            rows.append(
                {
                    "mb": mb,
                    "object_ref_s": statistics.median(old[1:]),
                    "gloo_s": statistics.median(new[1:]),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


# --- the driver side ---------------------------------------------------------------------------


def _engine(tree: Path, prefix: str, what: str, args: list[str], env: dict[str, str]) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        what,
        "--prefix",
        prefix,
        "--out",
        str(out),
        *args,
    ]
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    rows: list[dict] = json.loads(out.read_text())
    out.unlink()
    return rows


def _baseline_tree(rev: str, where: Path) -> Path:
    tree = where / "baseline"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), rev],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return tree


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per plan")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--rounds", type=int, default=2, help="times each plan runs on each engine, alternating"
    )
    ap.add_argument("--repeats", type=int, default=5, help="transfers per size and engine")
    ap.add_argument("--baseline", default=BASELINE, help="commit of the object-ref runtime")
    ap.add_argument("--quick", action="store_true", help="AlexNet and the GPT on local-hetero")
    ap.add_argument("--worker", choices=["serve", "transfer"], help=argparse.SUPPRESS)
    ap.add_argument("--prefix", default="pipeplan.", help=argparse.SUPPRESS)
    ap.add_argument("--cluster", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        sys.path.insert(0, os.getcwd())
        if a.worker == "serve":
            serve(a.prefix, a.cluster, a.steps, a.warmup)
        else:
            Path(a.out).write_text(json.dumps(transfer_probe(a.prefix, a.repeats)))
        return
    drive(a)


class _Server:
    """One engine's :func:`serve` worker in its own tree: a plan per call, its cluster kept up
    in between, so the two engines' runs of a plan can alternate minute by minute."""

    def __init__(self, tree: Path, prefix: str, args: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "serve"]
        self.name = "new" if prefix else "old"
        self.proc = subprocess.Popen(
            [*cmd, "--prefix", prefix, *args],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._answer()  # the cluster is up

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(ROW):
                row: dict[str, Any] = json.loads(line[len(ROW) :])
                return row
            sys.stdout.write(line)
        raise RuntimeError(f"the {self.name} engine's worker ended (exit {self.proc.wait()})")

    def run(self, model: str, plan: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{model} {plan}\n")
        self.proc.stdin.flush()
        row = self._answer()
        print(json.dumps({"engine": self.name, **row}), file=sys.stderr, flush=True)
        return row

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the worker's loop ends, its cluster stops
        try:
            self.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _compare(cluster: str, model: str, plan: str, got: dict[str, list[dict]]) -> dict[str, Any]:
    """One plan's row: every measured step of every round, per engine."""
    old = [t for row in got["old"] for t in row["steps_s"]]
    new = [t for row in got["new"] for t in row["steps_s"]]

    def mean(engine: str, what: str) -> float:
        return statistics.mean(row[what] for row in got[engine])

    return {
        "cluster": cluster,
        "model": model,
        "plan": plan,
        "old_step_s": statistics.mean(old),
        "new_step_s": statistics.mean(new),
        "ratio_old_over_new": statistics.mean(old) / statistics.mean(new),
        "old_transfer_s": mean("old", "transfer_s"),
        "new_transfer_s": mean("new", "transfer_s"),
        "old_allreduce_s": mean("old", "allreduce_s"),
        "new_allreduce_s": mean("new", "allreduce_s"),
        "old_steps_s": old,
        "new_steps_s": new,
        "ratio_of_medians": statistics.median(old) / statistics.median(new),
    }


def drive(a: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from bench.record import BenchRun

    run = BenchRun("runtime_quick" if a.quick else "runtime")
    clusters = ("local-hetero",) if a.quick else CLUSTERS
    models = ["alexnet@224", "gpt-2L@32"] if a.quick else list(MODELS)
    console = Console(width=140)
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = _baseline_tree(a.baseline, Path(tmp))
        try:
            env_old = {**os.environ, "PYTHONPATH": str(old_tree)}
            env_new = dict(os.environ)  # a PYTHONPATH of the caller's holds for this tree
            common = ["--steps", str(a.steps), "--warmup", str(a.warmup)]
            runs: dict[tuple[str, str, str], dict[str, list[dict]]] = {}
            for cluster in clusters:
                console.print(f"[bold]{cluster}[/bold]: both runtimes, {a.rounds} rounds a plan")
                args = [*common, "--cluster", cluster]
                with (
                    _Server(old_tree, "", args, env_old) as old,
                    _Server(ROOT, "pipeplan.", args, env_new) as new,
                ):
                    for key in models:
                        for label in PLANS:
                            got = runs[cluster, key, label] = {"old": [], "new": []}
                            for r in range(a.rounds):  # old first, then new first, ...
                                pair = (("old", old), ("new", new))
                                for engine, server in pair if r % 2 == 0 else pair[::-1]:
                                    got[engine].append(server.run(key, label))
            console.print("[bold]transfers[/bold] (old and new, one cluster)")
            transfers = _engine(
                ROOT, "pipeplan.", "transfer", ["--repeats", str(a.repeats)], env_new
            )
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=False
            )
    plans = [_compare(*where, got) for where, got in runs.items()]
    table = Table(
        title="step time: object-ref runtime (old) vs torch.distributed (new), no emulation"
    )
    cols = ("cluster", "model", "plan", "old ms", "new ms", "old/new", "medians", "xfer old",
            "xfer new")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("cluster", "model", "plan") else "right")
    for p in plans:
        table.add_row(
            p["cluster"],
            p["model"],
            p["plan"],
            f"{p['old_step_s'] * 1e3:.0f}",
            f"{p['new_step_s'] * 1e3:.0f}",
            f"{p['ratio_old_over_new']:.2f}x",
            f"{p['ratio_of_medians']:.2f}x",
            f"{p['old_transfer_s'] * 1e3:.0f}",
            f"{p['new_transfer_s'] * 1e3:.0f}",
        )
    console.print(table)
    xt = Table(title="one transfer between two Ray nodes (median)")
    for col in ("MB", "object ref ms", "gloo ms", "ratio"):
        xt.add_column(col, justify="right")
    for t in transfers:
        ratio = t["object_ref_s"] / t["gloo_s"]
        xt.add_row(
            f"{t['mb']:g}",
            f"{t['object_ref_s'] * 1e3:.1f}",
            f"{t['gloo_s'] * 1e3:.1f}",
            f"{ratio:.1f}x",
        )
    console.print(xt)
    ratios = [p["ratio_old_over_new"] for p in plans]
    summary = {
        "plans": len(plans),
        "ratio_min": min(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
        "new_slower_on": [
            f"{p['cluster']} {p['model']} {p['plan']}"
            for p in plans
            if p["ratio_old_over_new"] < 1.0
        ],
        "new_slower_by_medians_on": [
            f"{p['cluster']} {p['model']} {p['plan']}" for p in plans if p["ratio_of_medians"] < 1.0
        ],
    }
    console.print(
        f"old/new step time over {len(plans)} plans: min {summary['ratio_min']:.2f}x, "
        f"median {summary['ratio_median']:.2f}x, max {summary['ratio_max']:.2f}x; "
        f"new slower on: {summary['new_slower_on'] or 'none'} (by the steps' medians: "
        f"{summary['new_slower_by_medians_on'] or 'none'})"
    )
    path = run.write(
        {
            "baseline": a.baseline,
            "steps": a.steps,
            "warmup": a.warmup,
            "emulate": False,
            "summary": summary,
            "plans": plans,
            "transfers": transfers,
        }
    )
    console.print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
