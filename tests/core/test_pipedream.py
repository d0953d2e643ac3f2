"""The PipeDream graph.txt importer: the two public fixtures, synthetic graphs and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeplan.core.errors import FormatError
from pipeplan.core.formats.pipedream import load_pipedream, parse_pipedream
from pipeplan.core.formats.pipedream_ops import op_kind
from pipeplan.core.profile import ModelProfile

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "pipedream"
BATCH = 256  # both fixtures were profiled at minibatch 256


def fixture(model: str) -> ModelProfile:
    return load_pipedream(FIXTURES / f"{model}.graph.txt", BATCH, "gpu")


def file_graph(model: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Non-Input node ids and the edges between them, read naively from the fixture."""
    lines = (FIXTURES / f"{model}.graph.txt").read_text().splitlines()
    nodes = [ln.split(" -- ")[0] for ln in lines if ln and not ln[0].isspace()]
    inputs = {ln.split(" -- ")[0] for ln in lines if " -- Input -- " in ln}
    edges = [tuple(ln.strip().split(" -- ")) for ln in lines if ln.startswith("\t")]
    keep = [n for n in nodes if n not in inputs]
    return keep, [(a, b) for a, b in edges if a not in inputs and b not in inputs]


def line(
    node: str,
    desc: str,
    fwd: float = 1.0,
    bwd: float = 2.0,
    act: float = 4096.0,
    params: float = 0.0,
) -> str:
    return (
        f"{node} -- {desc} -- forward_compute_time={fwd:.3f}, backward_compute_time="
        f"{bwd:.3f}, activation_size={act:.1f}, parameter_size={params:.3f}"
    )


# --- the public fixtures ----------------------------------------------------------------------


@pytest.mark.parametrize(("model", "layers"), [("alexnet", 22), ("resnet18", 70)])
def test_fixture_has_one_layer_per_node_but_input(model: str, layers: int) -> None:
    profile = fixture(model)
    nodes, _ = file_graph(model)
    assert len(profile) == layers == len(nodes)
    assert sorted(layer.name for layer in profile.layers) == sorted(nodes)
    assert profile.name == model
    assert profile.input_shape == (3, 224, 224)  # 154140672 bytes / 256 / 4 = 3 x 224 x 224
    assert profile.device_types == ("gpu",)


@pytest.mark.parametrize("model", ["alexnet", "resnet18"])
def test_fixture_layers_are_in_a_topological_order(model: str) -> None:
    profile = fixture(model)
    index = {layer.name: i for i, layer in enumerate(profile.layers)}
    _, edges = file_graph(model)
    for a, b in edges:
        assert index[a] < index[b], f"edge {a} -> {b}"
        assert index[b] in profile.layers[index[a]].successors
    assert sum(len(layer.successors) for layer in profile.layers) == len(set(edges))
    assert profile.layers[0].name == "node2"  # the Input's successor opens the graph


def test_alexnet_first_conv_is_converted_per_sample() -> None:
    # node2 -- Conv2d(3, 64, kernel_size=(11, 11), stride=(4, 4), padding=(2, 2)) --
    # forward 22.316 ms, backward 6.405 ms, activation 198246400 B, parameters 93184 B
    conv = fixture("alexnet").layers[0]
    assert (conv.name, conv.op) == ("node2", "conv")
    timing = conv.timings["gpu"]
    assert timing.fwd_s == pytest.approx(22.316 / 1000 / 256)
    assert timing.bwd_s == pytest.approx(6.405 / 1000 / 256)
    assert (timing.fwd_fixed_s, timing.bwd_fixed_s) == (0.0, 0.0)
    assert conv.activation_bytes == 774400  # 64 x 55 x 55 floats
    assert conv.params_bytes == 93184  # (64 x 3 x 11 x 11 + 64) x 4
    assert conv.flops == 2 * 3 * 11 * 11 * 64 * 55 * 55


def test_alexnet_flops_of_linear_pool_and_view() -> None:
    layers = {layer.name: layer for layer in fixture("alexnet").layers}
    assert layers["node18"].op == "fc"
    assert layers["node18"].flops == 2 * 9216 * 4096
    assert layers["node14"].op == "pool"
    assert layers["node14"].flops == 3 * 3 * 256 * 6 * 6  # kernel x output elements
    assert layers["node16"].op == "flatten"
    assert layers["node16"].flops == 0
    assert layers["node3"].flops == 64 * 55 * 55  # ReLU: one op per element


def test_resnet18_skip_connections_fork_and_join() -> None:
    profile = fixture("resnet18")
    names = [layer.name for layer in profile.layers]
    pool = profile.layers[names.index("node5")]  # MaxPool feeds the block and its shortcut
    assert sorted(names[s] for s in pool.successors) == ["node11", "node6"]
    forks = [layer.name for layer in profile.layers if len(layer.successors) == 2]
    assert len(forks) >= 8
    predecessors = [0] * len(profile)
    for layer in profile.layers:
        for s in layer.successors:
            predecessors[s] += 1
    adds = [i for i, layer in enumerate(profile.layers) if layer.op == "add"]
    assert len(adds) == 8
    assert all(predecessors[i] == 2 for i in adds)


@pytest.mark.parametrize("model", ["alexnet", "resnet18"])
def test_fixture_round_trips_through_the_profile_document(model: str) -> None:
    profile = fixture(model)
    again = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile
    assert again.to_dict() == profile.to_dict()


# --- synthetic graphs ---------------------------------------------------------------------------


SHUFFLED = "\n".join(
    [
        line("node7", "Concat(1)", act=2 * 8192.0),
        line("node3", "Linear(in_features=16, out_features=32)", act=256.0, params=2176.0),
        line("node1", "Input", fwd=50.0, bwd=0.0, act=2 * 64.0),
        line("node5", "Add(inplace)", act=2 * 128.0),
        line("node2", "ReLU(inplace)", act=2 * 64.0),
        line("node6", "Dropout(p=0.1)", act=2 * 128.0),
        line("node4", "Linear(16, 32, bias=False)", act=256.0, params=2048.0),
        "\tnode5 -- node6",
        "\tnode1 -- node2",
        "\tnode2 -- node3",
        "\tnode2 -- node4",
        "\tnode3 -- node5",
        "\tnode4 -- node5",
        "\tnode5 -- node7",
        "\tnode6 -- node7",
    ]
)


def test_shuffled_graph_with_add_and_concat_imports_in_order() -> None:
    profile = parse_pipedream(SHUFFLED, 2, "cpu", name="toy")
    assert [layer.name for layer in profile.layers] == [
        "node2",
        "node3",
        "node4",
        "node5",
        "node6",
        "node7",
    ]
    assert [layer.op for layer in profile.layers] == [
        "relu",
        "fc",
        "fc",
        "add",
        "dropout",
        "concat",
    ]
    assert [layer.successors for layer in profile.layers] == [
        (1, 2),
        (3,),
        (3,),
        (4, 5),
        (5,),
        (),
    ]
    assert profile.input_shape == (16,)  # 128 bytes / 2 samples / 4 bytes, not an image
    assert profile.layers[1].flops == 2 * 16 * 32
    assert profile.layers[3].flops == 32  # element-wise: 128 bytes per sample / 4
    assert profile.layers[3].activation_bytes == 128
    assert profile.layers[0].timings["cpu"].fwd_s == pytest.approx(1.0 / 1000 / 2)


def test_ties_go_to_the_lower_node_number() -> None:
    text = "\n".join(
        [
            line("node12", "ReLU()"),
            line("node9", "ReLU()"),
            line("node10", "ReLU()"),
            "\tnode9 -- node12",
            "\tnode10 -- node12",
        ]
    )
    profile = parse_pipedream(text, 1, "cpu")
    assert [layer.name for layer in profile.layers] == ["node9", "node10", "node12"]
    assert profile.input_shape == (1,)  # no Input node and no input_shape given
    assert profile.name == "pipedream"


GNMT_LIKE = "\n".join(
    [
        line("node1", "Input0", act=0.0),
        line("node2", "Input1", act=0.0),
        line("node4", "Embedding(32320, 1024, padding_idx=0)", act=6291456.0, params=132382720.0),
        line("node7", "LSTM(2048, 1024)", params=50364416.0).replace(
            "activation_size=4096.0", "activation_size=[6291456.0; 131072.0; 131072.0]"
        ),
        line("node8", "__getitem__(0)", act=6291456.0),
        line("node20", "hidden", act=0.0),
        line("node29", "Concat(2)", act=6291456.0),
        line(
            "node48",
            "Classifier(  (classifier): Linear(in_features=1024, out_features=32320, bias=True))",
            act=194437120.0,
            params=132512000.0,
        )
        + " -- stage_id=1",  # a partitioned profile ends node lines with the stage
        "\tnode1 -- node4",
        "\tnode4 -- node7",
        "\tnode2 -- node7",
        "\tnode7 -- node8",
        "\tnode8 -- node29",
        "\tnode20 -- node29",
        "\tnode29 -- node48",
    ]
)


def test_translation_profile_with_lists_and_several_inputs() -> None:
    profile = parse_pipedream(GNMT_LIKE, 64, "v100", name="gnmt")
    by_name = {layer.name: layer for layer in profile.layers}
    assert sorted(by_name) == ["node20", "node29", "node4", "node48", "node7", "node8"]
    assert [by_name[n].op for n in ("node4", "node7", "node8", "node20", "node29", "node48")] == [
        "embedding",
        "other",
        "other",
        "other",
        "concat",
        "other",
    ]
    lstm = by_name["node7"]
    assert lstm.activation_bytes == round((6291456 + 2 * 131072) / 64)  # outputs are summed
    tokens = 6291456 / 64 / 4 / 1024  # first output / batch / 4 bytes / hidden width = 24
    assert lstm.flops == pytest.approx(2 * 50364416 / 4 * tokens)
    rows = 194437120 / 64 / 4 / 32320
    assert by_name["node48"].flops == pytest.approx(2 * 132512000 / 4 * rows)
    assert by_name["node20"].flops == 0
    assert profile.input_shape == (1,)  # the Input nodes carry no bytes


@pytest.mark.parametrize(
    ("desc", "op"),
    [
        ("Conv2d(3, 64, kernel_size=(3, 3))", "conv"),
        ("ReLU(inplace)", "relu"),
        ("ReLU6()", "relu"),
        ("Sigmoid()", "relu"),
        ("MaxPool2d(kernel_size=3, stride=2)", "pool"),
        ("AdaptiveAvgPool2d(output_size=(1, 1))", "pool"),
        ("Linear(in_features=1, out_features=2, bias=True)", "fc"),
        ("BatchNorm2d(64, eps=1e-05)", "norm"),
        ("LayerNorm((768,), eps=1e-05)", "norm"),
        ("Dropout(p=0.5)", "dropout"),
        ("View(-1)", "flatten"),
        ("Size(0)", "flatten"),
        ("Flatten(start_dim=1)", "flatten"),
        ("Add", "add"),
        ("__add__", "add"),
        ("Concat(2)", "concat"),
        ("cat", "concat"),
        ("ZeroPad2d(padding=(1, 1, 1, 1), value=0.0)", "pad"),
        ("Embedding(32320, 1024, padding_idx=0)", "embedding"),
        ("MultiheadAttention(...)", "attention"),
        ("LSTM(1024, 1024)", "other"),
        ("__getitem__(1)", "other"),
        ("hidden", "other"),
    ],
)
def test_op_kind_of_module_reprs(desc: str, op: str) -> None:
    assert op_kind(desc) == op


def test_load_names_the_model_after_the_file(tmp_path: Path) -> None:
    (tmp_path / "mynet.graph.txt").write_text(SHUFFLED)
    (tmp_path / "vgg16").mkdir()
    (tmp_path / "vgg16" / "graph.txt").write_text(SHUFFLED)
    assert load_pipedream(tmp_path / "mynet.graph.txt", 2, "cpu").name == "mynet"
    assert load_pipedream(tmp_path / "vgg16" / "graph.txt", 2, "cpu").name == "vgg16"
    given = load_pipedream(tmp_path / "mynet.graph.txt", 2, "cpu", "x", input_shape=(4, 4))
    assert (given.name, given.input_shape) == ("x", (4, 4))


# --- bad input -------------------------------------------------------------------------------

GOOD = [line("node1", "Input"), line("node2", "ReLU()"), line("node3", "ReLU()")]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (GOOD + ["node4 -- ReLU() -- forward_compute_time=1.0"], r"line 4: missing "),
        (GOOD + ["node4 -- ReLU()"], r"line 4: malformed node line.*'node4 -- ReLU\(\)'"),
        (GOOD + ["\tnode2 node3"], r"line 4: malformed edge line.*'node2 node3'"),
        (GOOD + ["\tnode2 -- node9"], r"line 4: edge to unknown node 'node9'"),
        ([line("node1", "ReLU()", fwd=1.0).replace("1.000", "fast", 1)], r"line 1: .*'fast'"),
        ([line("node1", "ReLU()", act=-8.0)], r"line 1: activation_size must be .*>= 0"),
        (GOOD + [GOOD[1]], r"line 4: node 'node2' defined twice \(first on line 2\)"),
        (
            GOOD + ["\tnode2 -- node3", "\tnode3 -- node2"],
            r"cycle in the graph: node2 \(line 2\) -> node3 \(line 3\) -> node2",
        ),
        (GOOD + ["\tnode3 -- node3"], r"cycle in the graph: node3 \(line 3\) -> node3"),
        ([], r"empty profile"),
        (["", "   "], r"empty profile"),
        ([line("node1", "Input")], r"no layers: the graph has only Input nodes \(node1\)"),
    ],
)
def test_bad_input_names_the_line_and_the_problem(lines: list[str], message: str) -> None:
    with pytest.raises(FormatError, match=message):
        parse_pipedream("\n".join(lines), 8, "cpu")


@pytest.mark.parametrize("batch", [0, -4])
def test_batch_size_must_be_positive(batch: int) -> None:
    message = re.escape(f"batch_size: must be an integer > 0, got {batch}")
    with pytest.raises(FormatError, match=message):
        parse_pipedream("\n".join(GOOD), batch, "cpu")


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.graph.txt"
    path.write_text("\n".join(GOOD + ["\tnode2 -- node9"]))
    with pytest.raises(FormatError, match=r"broken\.graph\.txt: line 4: edge to unknown"):
        load_pipedream(path, 8, "cpu")
    with pytest.raises(FormatError, match=r"cannot read .*missing\.txt"):
        load_pipedream(tmp_path / "missing.txt", 8, "cpu")
