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
Writes ``bench/results/grad_accumulation/<UTC date-time>.json`` (:mod:`bench.record`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import MODELS, model_args, table
from bench.fidelity import CLUSTER
from bench.record import BenchRun, display
from pipeplan.core.cluster import ClusterSpec
from pipeplan.executor.local.keep_awake import KeepAwake
from pipeplan.executor.model import timing_loss


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
    a, keys = model_args(__doc__, repeats=9)
    bench = BenchRun("grad_accumulation")
    from rich.console import Console

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
    cols = ("model", "samples", "params MB", "fresh ms", "accumulating ms", "ratio", "extra ms")
    shown = table(
        "backward into fresh vs existing gradients (CPU time)",
        (*cols, f"4 x params / {bandwidth:g} GB/s, ms"),
        left=("model",),
    )
    for r in rows:
        shown.add_row(
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
    console.print(shown)
    doc = {"threads": 1, "repeats": a.repeats, "memory_bandwidth_gbps": bandwidth, "rows": rows}
    out = bench.write(doc, out=Path(a.out) if a.out else None, indent=1)
    console.print(f"wrote {display(out)}")


if __name__ == "__main__":
    main()
