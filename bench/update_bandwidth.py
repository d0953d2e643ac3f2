"""The memory bandwidth the cost model's update term implies on this machine.

Cost-model rule 8 costs a stage's optimizer update as ``4 x params_bytes /
memory_bandwidth``. This times the update the executor's stage workers run (the default
:class:`executor.model.OptimizerConfig`: plain SGD; also SGD with momentum and Adam) on the
fidelity benchmark's models, one torch thread, gradients in place, after a warm-up, and
prints the bandwidth that makes rule 8 exact: ``4 x params_bytes / step time``. That is the
number ``memory_bandwidth_gbps`` of ``examples/clusters/local-hetero.yaml`` should hold (all
its emulated devices are this machine's CPU; the emulation does not slow the update).

    .venv/bin/python -m bench.update_bandwidth          # ~1 min
Writes ``bench/results/update_bandwidth/<UTC date-time>.json`` (:mod:`bench.record`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import MODELS, model_args, table
from bench.record import BenchRun, display
from pipeplan.executor.model import OptimizerConfig

OPTIMIZERS = {
    "sgd": OptimizerConfig(),
    "sgd+momentum": OptimizerConfig(momentum=0.9),
    "adam": OptimizerConfig(kind="adam", lr=1e-3),
}


def step_seconds(params: list[torch.nn.Parameter], config: OptimizerConfig, repeats: int) -> float:
    """Median wall time of one optimizer step (gradients set, as after a backward)."""
    optimizer = config.make(params)
    times = []
    for r in range(repeats + 2):
        for p in params:
            p.grad = torch.ones_like(p) * 1e-6
        t0 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if r >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    a, keys = model_args(__doc__, repeats=7)
    bench = BenchRun("update_bandwidth")
    from rich.console import Console

    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for key in keys:
        case = MODELS[key]
        model, _ = case.source.build()
        params = [p for p in model.parameters() if p.requires_grad]
        size = sum(p.numel() * p.element_size() for p in params)
        for name, config in OPTIMIZERS.items():
            t = step_seconds(params, config, a.repeats)
            rows.append(
                {
                    "model": case.label,
                    "optimizer": name,
                    "params_mb": size / 1e6,
                    "step_s": t,
                    "rule8_bandwidth_gbps": 4 * size / t / 1e9,
                }
            )
    shown = table(
        "optimizer step: rule 8's 4 x params / time",
        ("model", "optimizer", "params MB", "step ms", "4 x params / step, GB/s"),
        left=("model", "optimizer"),
    )
    for r in rows:
        shown.add_row(
            r["model"],
            r["optimizer"],
            f"{r['params_mb']:.0f}",
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['rule8_bandwidth_gbps']:.1f}",
        )
    console = Console(width=120)
    console.print(shown)
    sgd = [r["rule8_bandwidth_gbps"] for r in rows if r["optimizer"] == "sgd"]
    console.print(
        f"plain SGD (the executor's default): median {statistics.median(sgd):.1f} GB/s "
        f"(range {min(sgd):.1f}-{max(sgd):.1f})"
    )
    doc = {"threads": 1, "repeats": a.repeats, "rows": rows}
    out = bench.write(doc, out=Path(a.out) if a.out else None, indent=1)
    console.print(f"wrote {display(out)}")


if __name__ == "__main__":
    main()
