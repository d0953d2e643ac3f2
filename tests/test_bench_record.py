"""bench.record: one file per run, with its provenance, named by when it started; the
newest is the one read back."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from bench.record import ROOT, BenchRun, command, newest, utc_stamp


def test_a_run_writes_a_new_file_with_its_provenance(tmp_path: Path) -> None:
    run = BenchRun("demo_bench", argv=["bench/demo_bench.py", "--quick"])
    path = run.write({"rows": [1, 2]}, results=tmp_path)
    assert path == run.path(tmp_path) and path.parent == tmp_path / "demo_bench"
    assert path.name == f"{utc_stamp(run.started)}.json"
    doc = json.loads(path.read_text())
    assert doc["rows"] == [1, 2]
    p = doc["provenance"]
    assert p["bench"] == "demo_bench" and p["command"] == "python -m bench.demo_bench --quick"
    assert set(p) >= {"started_utc", "wall_s", "git", "machine", "load_before", "load_after"}
    assert set(p["git"]) == {"commit", "dirty"}
    out = tmp_path / "elsewhere" / "part.json"  # --out: the file named, provenance and all
    assert run.write({"rows": []}, out=out) == out and "provenance" in json.loads(out.read_text())


def test_the_newest_file_is_the_latest_start(tmp_path: Path) -> None:
    assert newest("demo_bench", tmp_path) is None
    early = BenchRun("demo_bench")
    late = BenchRun("demo_bench")
    late.started = early.started + dt.timedelta(hours=1)
    late.write({}, results=tmp_path)
    early.write({}, results=tmp_path)
    assert newest("demo_bench", tmp_path) == late.path(tmp_path)


def test_the_command_names_the_module_and_no_folder_of_this_machine() -> None:
    argv = [str(ROOT / "bench" / "fidelity.py"), "--quick", "--cluster", str(ROOT / "x.yaml")]
    assert command(argv, "fidelity_quick") == "python -m bench.fidelity --quick --cluster x.yaml"
    assert command(["-c"], "links") == "python -m bench.links"
