"""``pipeplan plan --planner tapp --policy FILE``: warm-starts TAPP from a saved policy (its
``pretrained`` option, also in ``submit plan``'s request); refused, naming the flag, for a
planner that takes no policy and for a file that is missing or holds no TAPP policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeplan.agents.tapp import TAPPPolicy
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.service.cli.console import CliError
from pipeplan.service.cli.options import parse_options
from tests.service.runner import run_cli as run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "alexnet.json"
    load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100").save(path)
    return path


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("policies") / "policy.pt"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        TAPPPolicy(16, 8).save(path)
    return path


def plan_args(profile: Path, planner: str, *more: str) -> list[str]:
    return [
        "plan", "--profile", str(profile), "--cluster", "local-hetero", "--batch", "16",
        "--planner", planner, *more,
    ]  # fmt: skip


def test_tapp_starts_from_the_policy(monkeypatch, capsys, profile_path, policy_path) -> None:  # type: ignore[no-untyped-def]
    args = plan_args(
        profile_path, "tapp", "--policy", str(policy_path), "--iterations", "1",
        "-O", "batch_size=4", "-O", "frozen=true", "--json",
    )  # fmt: skip
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == 0, err
    assert json.loads(out)["evaluations"] >= 1


@pytest.mark.parametrize(
    ("planner", "file", "message"),
    [
        ("dp", "policy", "error: --policy: only applies to tapp, not 'dp'"),
        ("tapp", "absent", "error: --policy: no policy file at"),
        ("tapp", "junk", "error: --policy: tapp.pretrained: "),
    ],
)
def test_a_bad_policy_is_refused_naming_the_flag(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, tmp_path, profile_path, policy_path, planner, file, message
) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a policy")
    path = {"policy": policy_path, "absent": tmp_path / "absent.pt", "junk": junk}[file]
    code, _, err = run(
        monkeypatch, capsys, *plan_args(profile_path, planner, "--policy", str(path))
    )
    assert code == 2 and err.startswith(message), err
    if file == "junk":
        assert "is not a TAPP policy" in err


def test_the_flag_maps_onto_pretrained_for_plan_and_submit(tmp_path: Path) -> None:
    got = parse_options("tapp", ["batch_size=8"], None, None, Path("policy.pt"))
    assert got == {"batch_size": 8, "pretrained": str(Path("policy.pt").absolute())}
    with pytest.raises(CliError, match="--policy: only applies to tapp, not 'ppo'"):
        parse_options("ppo", [], None, None, tmp_path / "p.pt")
