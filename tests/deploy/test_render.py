"""``pipeplan deploy render`` (:mod:`service.tasks.deploy`): what it writes for a spec keeps
the spec's devices (the invariants of :mod:`tests.deploy.common`) on the presets, on specs
written for the test and on random ones; the committed deploy/ files are what it writes;
bad specs are refused naming the field and the value."""

from __future__ import annotations

import copy
import time
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.core._io import read_document
from pipeplan.core.errors import PipeplanError
from pipeplan.service.tasks.common import presets
from pipeplan.service.tasks.deploy import (
    RAY_VERSION,
    DeployError,
    DeployRenderRequest,
    DeployTarget,
    Rendered,
    load_spec,
    render,
    worker_groups,
)
from tests.deploy.common import (
    COMPOSE,
    COMPOSE_SPEC,
    EXAMPLE_RENDERED,
    EXAMPLE_SPEC,
    ROOT,
    check_rendered,
    command_resources,
    group_resources,
    yaml_docs,
)
from tests.service.runner import run_cli
from tests.work import AT_ONCE, counting_calls

REGENERATE = (
    "the committed files differ from what `pipeplan deploy render` writes now; render them "
    "again (deploy/README.md, 'Render for your spec') and review the diff"
)


def spec_doc(types: dict[str, dict[str, Any]], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    full = {t: {"flops": 1e12, "memory_gb": 16, **extra} for t, extra in types.items()}
    return {"name": "test", "device_types": full, "nodes": nodes}


def both(doc: Any) -> tuple[DeployRenderRequest, Any]:
    request = DeployRenderRequest(spec=doc)
    return request, render(request)


# --- the committed files ----------------------------------------------------------------------


def test_the_k8s_example_is_what_render_writes_for_its_spec() -> None:
    request = DeployRenderRequest(spec=read_document(EXAMPLE_SPEC), target=DeployTarget.K8S)
    committed = {p.name: p.read_text() for p in EXAMPLE_RENDERED.iterdir()}
    assert committed == dict(render(request).files), REGENERATE


def test_the_compose_ray_cluster_is_what_render_writes_for_local_hetero() -> None:
    files = render(DeployRenderRequest(spec=COMPOSE_SPEC, target=DeployTarget.COMPOSE)).files
    committed = {name: (COMPOSE / name).read_text() for name in files}
    assert committed == dict(files), REGENERATE


def test_ray_version_is_the_installed_ray_which_the_lock_pins() -> None:
    (rc,) = yaml_docs((EXAMPLE_RENDERED / "raycluster.yaml").read_text())
    assert rc["spec"]["rayVersion"] == RAY_VERSION == ray.__version__
    lock = (ROOT / "requirements.lock").read_text().splitlines()
    assert f"ray=={ray.__version__}" in lock
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("ray[")]
    assert f">={ray.__version__}" in pin  # the lowest version tested is the one installed


def test_the_example_has_one_group_per_device_type_sized_by_the_spec() -> None:
    dep = load_spec(read_document(EXAMPLE_SPEC))
    table = [(g.name, g.per_pod, g.replicas, g.gpu) for g in worker_groups(dep)]
    assert table == [("cpu", 1, 2, False), ("t4", 1, 2, True), ("a100", 4, 1, True)]


# --- specs written for the test ---------------------------------------------------------------


@pytest.mark.parametrize("preset", presets())
def test_every_preset_renders_what_its_spec_says(preset: str) -> None:
    check_rendered(*both(preset))


def test_a_node_of_several_types_and_unequal_counts() -> None:
    doc = spec_doc(
        {"cpu": {}, "t4": {"accelerator": "cuda"}},
        [{"name": "n0", "devices": {"t4": 2, "cpu": 1}}, {"name": "n1", "devices": {"t4": 4}}],
    )
    request, rendered = both(doc)
    check_rendered(request, rendered)
    (rc,) = yaml_docs(rendered.files["k8s/raycluster.yaml"])
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert group_resources(groups["t4"]) == {"device:t4": 2} and groups["t4"]["replicas"] == 3
    assert group_resources(groups["cpu"]) == {"device:cpu": 1} and groups["cpu"]["replicas"] == 1
    compose = yaml.safe_load(rendered.files["compose/ray-cluster.yaml"])["services"]
    assert command_resources(compose["ray-node-n0"]["command"]) == {
        "device:t4": 2.0,
        "device:cpu": 1.0,
        "pipeplan_node:n0": 1.0,
    }
    ids = [
        compose[f"ray-node-{n}"]["deploy"]["resources"]["reservations"]["devices"][0]
        for n in ("n0", "n1")
    ]
    assert [d["device_ids"] for d in ids] == [["0", "1"], ["2", "3", "4", "5"]]


def test_a_node_count_deploys_the_nodes_it_stands_for() -> None:
    doc = spec_doc(
        {"a100": {"accelerator": "cuda"}}, [{"name": "gpu", "devices": {"a100": 2}, "count": 3}]
    )
    request, rendered = both(doc)
    check_rendered(request, rendered)
    assert [n.name for n in load_spec(doc).spec.nodes] == ["gpu-0", "gpu-1", "gpu-2"]
    (rc,) = yaml_docs(rendered.files["k8s/raycluster.yaml"])
    (group,) = rc["spec"]["workerGroupSpecs"]
    assert (group["replicas"], group["rayStartParams"]["num-gpus"]) == (3, "2")


def test_a_type_no_node_holds_gets_no_group() -> None:
    doc = spec_doc({"cpu": {}, "spare": {}}, [{"name": "n0", "devices": {"cpu": 1, "spare": 0}}])
    request, rendered = both(doc)
    check_rendered(request, rendered)
    assert [g.device_type for g in worker_groups(load_spec(doc))] == ["cpu"]


def test_node_selectors_can_be_left_out() -> None:
    request = DeployRenderRequest(spec="cloud-mix", node_selectors=False, target=DeployTarget.K8S)
    (rc,) = yaml_docs(render(request).files["raycluster.yaml"])
    assert all("nodeSelector" not in g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"])


def test_a_target_alone_goes_straight_into_out() -> None:
    assert set(render(DeployRenderRequest(spec="cloud-mix")).files) == {
        "k8s/kustomization.yaml",
        "k8s/raycluster.yaml",
        "k8s/cluster-spec.yaml",
        "compose/ray-cluster.yaml",
        "compose/cluster.yaml",
    }
    compose = render(DeployRenderRequest(spec="cloud-mix", target=DeployTarget.COMPOSE)).files
    assert set(compose) == {"ray-cluster.yaml", "cluster.yaml"}


@pytest.mark.parametrize(
    ("path", "old", "new"),
    [
        ("k8s/raycluster.yaml", "    replicas: 1\n", "    replicas: 2\n"),
        ("k8s/raycluster.yaml", "nvidia.com/gpu: '2'", "nvidia.com/gpu: '1'"),
        ("compose/ray-cluster.yaml", '"device:t4": 2.0', '"device:t4": 1.0'),
        ("compose/ray-cluster.yaml", "- '1'\n", "- '0'\n"),
    ],
)
def test_the_invariants_catch_a_wrong_deployment(path: str, old: str, new: str) -> None:
    """The checks above can fail: a deployment that lost or doubled a device is caught."""
    doc = spec_doc({"t4": {"accelerator": "cuda"}}, [{"name": "n0", "devices": {"t4": 2}}])
    request, rendered = both(doc)
    files = dict(rendered.files)
    assert old in files[path]
    files[path] = files[path].replace(old, new, 1)
    with pytest.raises((AssertionError, jsonschema.ValidationError)):
        check_rendered(request, Rendered(rendered.spec_name, files))


# --- bad specs --------------------------------------------------------------------------------

GOOD = spec_doc({"t4": {"accelerator": "cuda"}}, [{"name": "n0", "devices": {"t4": 1}}])


def with_types(*names: str) -> dict[str, Any]:
    return spec_doc({n: {} for n in names}, [{"name": "n0", "devices": dict.fromkeys(names, 1)}])


def with_node(**fields: Any) -> dict[str, Any]:
    doc = copy.deepcopy(GOOD)
    doc["nodes"][0].update(fields)
    return doc


def with_accelerator(value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(GOOD)
    doc["device_types"]["t4"]["accelerator"] = value
    return doc


BAD = [
    (with_accelerator("rocm"), "device_types.t4.accelerator: 'rocm' is not one of cuda"),
    (with_accelerator(True), "device_types.t4.accelerator: expected a name such as 'cuda'"),
    (with_types("t 4"), "device_types.t 4: the name 't 4' may hold only letters"),
    (with_types("a$b"), "device_types.a$b: the name 'a$b' may hold only letters"),
    (
        with_types("___"),
        "device_types.___: '___' is not a valid Kubernetes name after normalisation (''",
    ),
    (with_types("x" * 64), f"device_types.{'x' * 64}: '{'x' * 64}' is not a valid Kubernetes"),
    (
        with_types("A100", "a100"),
        "device_types.a100: 'a100' and 'A100' both become the Kubernetes name 'a100'",
    ),
    (with_types("gpu_v2", "gpu.v2"), "both become the Kubernetes name 'gpu-v2'"),
    (with_node(count=0), "nodes[0].count: must be >= 1, got 0"),
    (with_node(count="two"), "nodes[0].count: expected an integer, got 'two'"),
    (with_node(count=10**9), "nodes (counts included): 1,000,000,000 nodes is over the limit"),
    (with_node(devices={"v100": 1}), "unknown device type 'v100'"),
    ("no-such-preset", "spec: unknown preset 'no-such-preset' (one of cloud-catalogue, cloud-mix"),
]


@pytest.mark.parametrize(("doc", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_a_bad_spec_is_refused_naming_the_field_and_the_value(doc: Any, message: str) -> None:
    with pytest.raises(PipeplanError) as e, counting_calls() as work:
        render(DeployRenderRequest(spec=doc))
    assert message in str(e.value)
    assert work.calls < AT_ONCE  # a billion nodes are refused, not made


# --- random specs -----------------------------------------------------------------------------

ODD = st.text("abcXYZ019_.-", min_size=1, max_size=10).filter(lambda s: s.strip("_.-") != "")
"""Type names with upper case, digits, '_', '.' and '-' anywhere."""


@st.composite
def random_specs(draw: st.DrawFn) -> dict[str, Any]:
    """Up to 12 device types with odd names (distinct as Kubernetes names), some of them
    GPUs, on up to 8 nodes of one or several types each, some nodes with a ``count``."""
    names = draw(st.lists(ODD, min_size=1, max_size=12, unique_by=lambda s: load_key(s)))
    types = {n: ({"accelerator": "cuda"} if draw(st.booleans()) else {}) for n in names}
    nodes = []
    for i in range(draw(st.integers(1, 8))):
        held = draw(st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True))
        node: dict[str, Any] = {"name": f"node.{i}_X", "devices": {}}
        node["devices"] = {t: draw(st.sampled_from([1, 2, 3, 4, 6, 8])) for t in held}
        if draw(st.integers(0, 3)) == 0:
            node["count"] = draw(st.integers(1, 3))
        nodes.append(node)
    return spec_doc(types, nodes)


def load_key(name: str) -> str:
    """Names that Kubernetes would not tell apart."""
    return name.lower().replace("_", "-").replace(".", "-").strip("-")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_specs())
def test_random_specs_keep_every_invariant(doc: dict[str, Any]) -> None:
    check_rendered(*both(doc))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=70), min_size=1, max_size=4, unique=True))
def test_any_type_names_render_or_are_refused_naming_the_type(names: list[str]) -> None:
    doc = with_types(*names)
    try:
        rendered = render(DeployRenderRequest(spec=doc))
    except DeployError as e:
        assert str(e).startswith("device_types.")
        assert any(repr(n) in str(e) for n in names)
        return
    check_rendered(DeployRenderRequest(spec=doc), rendered)


@pytest.mark.slow
def test_a_large_spec_renders_quickly() -> None:
    types = {f"gpu_{k}": {"accelerator": "cuda"} for k in range(64)}
    nodes = [{"name": f"n{i}", "devices": {f"gpu_{i % 64}": 8}} for i in range(512)]
    doc = spec_doc(types, nodes)
    cpu = time.thread_time()
    request, rendered = both(doc)
    # this thread's CPU time (~3 s here), which other processes' load does not add to as it
    # does to the wall clock (9.2 s of it once under a load of 12)
    assert time.thread_time() - cpu < 10.0
    check_rendered(request, rendered)


# --- the command line -------------------------------------------------------------------------


def test_cli_writes_both_targets(monkeypatch, capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, out, err = run_cli(
        monkeypatch, capsys, "deploy", "render", "--spec", str(EXAMPLE_SPEC), "--out", str(tmp_path)
    )
    assert code == 0, err
    assert "cluster 'cloud-gpu': wrote 5 files" in err
    written = sorted(str(p) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(out.split()) and len(written) == 5
    assert (tmp_path / "k8s/raycluster.yaml").read_text() == (
        EXAMPLE_RENDERED / "raycluster.yaml"
    ).read_text()


def test_cli_one_target_and_options(monkeypatch, capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    args = ["--target", "k8s", "--image-cpu", "reg.example/cpu:1", "--image-cuda", "reg/cu:1"]
    code, _, err = run_cli(
        monkeypatch,
        capsys,
        "deploy",
        "render",
        "--spec",
        "cloud-mix",
        "--out",
        str(tmp_path),
        *args,
        "--cpus-per-device",
        "3",
        "--no-node-selectors",
    )
    assert code == 0, err
    (rc,) = yaml_docs((tmp_path / "raycluster.yaml").read_text())
    group = rc["spec"]["workerGroupSpecs"][1]
    assert group["template"]["spec"]["containers"][0]["image"] == "reg.example/cpu:1"
    assert group["rayStartParams"]["num-cpus"] == "6"
    assert "nodeSelector" not in group["template"]["spec"]


@pytest.mark.parametrize(
    ("spec", "out", "message"),
    [
        ("missing.yaml", None, "error: --spec: no such file 'missing.yaml' (nor a preset"),
        ("nope", None, "error: spec: unknown preset 'nope'"),
        (str(EXAMPLE_SPEC), "file", "is a file, not a directory"),
    ],
)
def test_cli_errors_are_one_line(monkeypatch, capsys, tmp_path, spec, out, message) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "out"
    if out == "file":
        target.write_text("")
    code, _, err = run_cli(
        monkeypatch, capsys, "deploy", "render", "--spec", spec, "--out", str(target)
    )
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_refuses_a_bad_accelerator_in_a_file(monkeypatch, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(with_accelerator("tpu")))
    code, _, err = run_cli(
        monkeypatch, capsys, "deploy", "render", "--spec", str(path), "--out", str(tmp_path / "o")
    )
    assert code == 2
    assert "error: device_types.t4.accelerator: 'tpu' is not one of cuda" in err
    assert not (tmp_path / "o").exists()
