"""What adding into existing gradients costs a backward, on this machine.

A pipeline stage's backward adds its gradients into those of the step's earlier
microbatches (``grad += new``) for every microbatch but the first; a backward into fresh
gradients (``grad is None``) only stores them. :mod:`models.profiler` times every backward the
first way, as a pipeline runs it. This measures the difference on the fidelity benchmark's
models: the whole model's backward (with the training loss, one torch thread, CPU time) at
the microbatch size of its pipelines (a quarter of its global batch), after a pause as long
as the backward itself (an emulated device sleeps between operations), the two ways
alternating, median of the repeats -- and sets the difference beside the cost model's term
for it (:mod:`core.costmodel`, rule 2's accumulation: ``4 x params_bytes / memory
bandwidth``, the bandwidth of ``local-hetero``'s device types).

    .venv/bin/python -m bench.grad_accumulation          # ~1 min
Writes bench/results/grad_accumulation.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.fidelity import CLUSTER, MODELS, model_keys
from pipeplan.core.cluster import ClusterSpec
from pipeplan.executor.local.keep_awake import KeepAwake
from pipeplan.executor.model import timing_loss

RESULTS = Path(__file__).parent / "results"


def backward_seconds(model: torch.nn.Module, batch: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median CPU seconds of the backward into fresh and into existing gradients."""
    times: dict[str, list[float]] = {"fresh": [], "accumulating": []}
    for r in range(repeats + 2):
        for mode, samples in times.items():
            if mode == "fresh":
                for p in model.parameters():
                    p.grad = None
            loss = timing_loss(model(batch))
            t0 = time.thread_time()
            loss.backward()
            took = time.thread_time() - t0
            if r >= 2:
                samples.append(took)
            time.sleep(took)
    for p in model.parameters():
        p.grad = None
    return {mode: statistics.median(samples) for mode, samples in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "grad_accumulation.json"))
    a = ap.parse_args()
    keys = model_keys(ap, a.models)
    if a.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {a.repeats}")
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(1)
    bandwidth = min(
        t.memory_bandwidth_gbps for t in ClusterSpec.load(CLUSTER).device_types.values()
    )
    rows: list[dict[str, Any]] = []
    with KeepAwake():  # as on an emulated cluster: cores kept out of idle between backwards
        for key in keys:
            case = MODELS[key]
            model, example = case.source.build()
            model.train()
            n = max(case.batch // 4, 1)
            shape = (n, *example.shape[1:])
            if example.is_floating_point():
                batch = torch.randn(shape, generator=torch.Generator().manual_seed(0))
            else:
                batch = example[:1].expand(shape).contiguous()
            t = backward_seconds(model, batch, a.repeats)
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            rows.append(
                {
                    "model": case.label,
                    "samples": n,
                    "params_mb": params / 1e6,
                    "fresh_s": t["fresh"],
                    "accumulating_s": t["accumulating"],
                    "ratio": t["accumulating"] / t["fresh"],
                    "extra_s": t["accumulating"] - t["fresh"],
                    "cost_model_s": 4.0 * params / (bandwidth * 1e9),
                }
            )
    title = "backward into fresh vs existing gradients (CPU time)"
    table = Table(title=title, title_justify="left")
    cols = ("model", "samples", "params MB", "fresh ms", "accumulating ms", "ratio", "extra ms")
    for col in (*cols, f"4 x params / {bandwidth:g} GB/s, ms"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        table.add_row(
            r["model"],
            str(r["samples"]),
            f"{r['params_mb']:.0f}",
            f"{r['fresh_s'] * 1e3:.1f}",
            f"{r['accumulating_s'] * 1e3:.1f}",
            f"{r['ratio']:.2f}x",
            f"{r['extra_s'] * 1e3:.1f}",
            f"{r['cost_model_s'] * 1e3:.1f}",
        )
    console = Console(width=120)
    console.print(table)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"threads": 1, "repeats": a.repeats, "memory_bandwidth_gbps": bandwidth, "rows": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
