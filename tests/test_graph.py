"""Draft-graph objects and files: structure, JSON round trips, networkx, typed errors, views, `spiffy graph`."""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spiffy.cli.main import main
from spiffy.errors import ConfigError, GraphError, GraphMismatchError
from spiffy.selfspec.graph import (
    FORMAT,
    VERSION,
    DraftGraph,
    DraftNode,
    GraphCompatibilityWarning,
    is_parent,
    load_graph,
    model_config_fingerprint,
)

CAL_FOR = {
    "family": "llada",
    "model": "/models/tiny",
    "config_fingerprint": "0123456789abcdef",
    "mask_id": 508,
    "block_length": 16,
    "steps_per_block": 16,
    "threshold": None,
    "remasking": "low_confidence",
    "alg": "maskgit_plus",
    "temperature": 0.0,
    "cache": "none",
    "tokens_per_step": 1,
}
META = {"calibrated_for": CAL_FOR, "calibration": {"dataset": "default", "num_prompts": 2, "seed": 0}}


def small_graph(meta: dict | None = META) -> DraftGraph:
    formulas = [
        (1, [(1, 1)]),
        (1, [(2, 1)]),
        (2, [(2, 1), (1, 1)]),  # unsorted on purpose: from_formulas sorts
        (2, [(1, 1), (3, 1)]),
        (3, [(1, 1), (2, 1), (3, 1)]),
    ]
    return DraftGraph.from_formulas(formulas, meta=meta, counts=[50, 20, 15, 8, 3], projected={"baseline_nfe": 100, "projected_nfe": 60, "reduction": 100 / 60})


# ---------------------------------------------------------------------------------------------------- structure
def test_from_formulas_links_and_lookups() -> None:
    g = small_graph()
    assert [n.id for n in g.nodes] == [0, 1, 2, 3, 4]
    assert g.node(2).pairs == ((1, 1), (2, 1))
    assert g.node(2).parents == (0, 1)  # a DAG: two parents
    assert g.node(3).parents == (0,)
    assert g.node(4).parents == (2, 3)
    assert [n.id for n in g.children(None)] == [0, 1]
    assert [n.id for n in g.level1()] == [0, 1]
    assert [n.id for n in g.children(0)] == [2, 3]
    assert [n.id for n in g.children(1)] == [2]
    assert [n.id for n in g.children(4)] == []
    assert g.max_level() == 3
    assert g.i_max == 3 and g.j_max == 1
    assert g.find(2, [(2, 1), (1, 1)]) is g.node(2)
    assert g.tokens_per_step == 1
    with pytest.raises(KeyError):
        g.node(9)


def test_from_formulas_static_size_rule_and_orphans() -> None:
    # with 1 token per step, a level-2 node of 3 pairs is invalid; without a schedule it is fine
    formulas = [(1, [(1, 1)]), (2, [(1, 1), (2, 1), (3, 1)])]
    with pytest.raises(GraphError, match="static schedule"):
        DraftGraph.from_formulas(formulas, meta=META)
    g = DraftGraph.from_formulas(formulas, meta={"calibrated_for": {"tokens_per_step": "dynamic"}})
    assert g.node(1).parents == (0,)
    # a level-2 node with no subset one level up is an orphan
    with pytest.raises(GraphError, match="orphaned"):
        DraftGraph.from_formulas([(1, [(1, 1)]), (2, [(2, 1), (3, 1)])])
    with pytest.raises(GraphError, match="duplicates"):
        DraftGraph.from_formulas([(1, [(1, 1)]), (1, [(1, 1)])])
    # empty graph is valid (baseline)
    e = DraftGraph.from_formulas([])
    assert len(e) == 0 and e.max_level() == 0 and e.children(None) == []


@pytest.mark.parametrize(
    "nodes, match",
    [
        ([DraftNode(0, 0, ((1, 1),))], "bad level"),
        ([DraftNode(0, 1, ((2, 1), (1, 1)))], "not sorted"),
        ([DraftNode(0, 1, ((1, 1), (1, 2)))], "position rank repeated"),
        ([DraftNode(0, 1, ((0, 1),))], "rank < 1"),
        ([DraftNode(0, 1, ())], "no \\(i, j\\) pairs"),
        ([DraftNode(0, 1, ((1, 1),)), DraftNode(0, 1, ((2, 1),))], "appears twice"),
        ([DraftNode(0, 1, ((1, 1),)), DraftNode(1, 2, ((1, 1), (2, 1)), (5,))], "does not exist"),
        ([DraftNode(0, 1, ((1, 1),)), DraftNode(1, 2, ((2, 1), (3, 1)), (0,))], "not a strict subset"),
        ([DraftNode(0, 1, ((1, 1),)), DraftNode(1, 3, ((1, 1), (2, 1)), (0,))], "one level up"),
        ([DraftNode(0, 1, ((1, 1),)), DraftNode(1, 2, ((1, 1), (2, 1)))], "orphaned"),
        ([DraftNode(0, 1, ((1, 1),), (0,))], "its own parent"),
        ([DraftNode(1, 1, ((1, 1),)), DraftNode(0, 2, ((1, 1), (2, 1)), (1,))], "ids must be 0..1"),
        ([DraftNode(0, 2, ((1, 1), (2, 1)), (1,)), DraftNode(1, 3, ((1, 1), (2, 1), (3, 1)), (0,))], "cycle|one level up"),
    ],
)
def test_validate_rejects(nodes: list[DraftNode], match: str) -> None:
    with pytest.raises(GraphError, match=match):
        DraftGraph(nodes)


def test_cycle_is_reported_as_cycle() -> None:
    nodes = [
        DraftNode(0, 1, ((1, 1),)),
        DraftNode(1, 2, ((1, 1), (2, 1)), (0, 2)),
        DraftNode(2, 3, ((1, 1), (2, 1), (3, 1)), (1,)),
    ]
    with pytest.raises(GraphError, match=r"cycle in the parent links: (1 -> 2 -> 1|2 -> 1 -> 2)"):
        DraftGraph(nodes)


# ---------------------------------------------------------------------------------------------------- files
def test_json_file_layout_and_round_trip(tmp_path: Path) -> None:
    g = small_graph()
    path = tmp_path / "sub" / "g.json"
    g.save(path)
    text = path.read_text()
    d = json.loads(text)
    assert d["format"] == FORMAT and d["version"] == VERSION == 1
    assert list(d) == ["format", "version", "calibrated_for", "calibration", "graph", "projected"]
    assert d["graph"]["num_nodes"] == 5 and d["graph"]["max_level"] == 3
    assert d["graph"]["nodes"][2] == {"id": 2, "level": 2, "pairs": [[1, 1], [2, 1]], "parents": [0, 1], "count": 15}
    # human readable: indented, one line per node
    assert '\n      {"id": 2, "level": 2, "pairs": [[1, 1], [2, 1]], "parents": [0, 1], "count": 15},\n' in text
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]  # atomic write left no temp file
    h = load_graph(path)
    assert h == g
    assert h.path == str(path)
    assert DraftGraph.from_json_dict(g.to_json_dict()) == g


def _write(tmp_path: Path, data: dict | str, name: str = "g.json") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def _broken(mutate) -> dict:  # noqa: ANN001
    d = small_graph().to_json_dict()
    mutate(d)
    return d


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(version=2), "version 2 is newer"),
        (lambda d: d.update(version=0), "version 0 is not supported"),
        (lambda d: d.pop("version"), "missing field 'version'"),
        (lambda d: d.update(format="something-else"), "not a spiffy draft-graph file"),
        (lambda d: d.pop("graph"), "missing field 'graph'"),
        (lambda d: d.pop("calibrated_for"), "missing field 'calibrated_for'"),
        (lambda d: d["graph"]["nodes"][1].pop("pairs"), r"graph.nodes\[1\] \(id 1\): missing field 'pairs'"),
        (lambda d: d["graph"]["nodes"][3].update(level=0), "node 3: bad level 0"),
        (lambda d: d["graph"]["nodes"][3].update(level="2"), "field 'level' must be int"),
        (lambda d: d["graph"]["nodes"][3].update(pairs=[[1, 1], [4]]), "list of two integers"),
        (lambda d: d["graph"]["nodes"][3].update(parents=[]), "node 3 \\(level 2\\) is orphaned"),
        (lambda d: d["graph"]["nodes"][3].update(parents=[1]), "node 3: parent 1's pairs .* not a strict subset"),
        (lambda d: (d["graph"]["nodes"][2].update(parents=[0, 4]), d["graph"]["nodes"][4].update(parents=[2])), "cycle"),
        (lambda d: d["graph"]["nodes"].pop(), "num_nodes is 5 but 4 node"),
        (lambda d: d.update(projected=[1]), "'projected' must be an object"),
        (lambda d: d["calibration"].update(score=3), "'calibration.score' must be a pruning score name"),
    ],
)
def test_malformed_files_raise_graph_error(tmp_path: Path, mutate, match: str) -> None:  # noqa: ANN001
    p = _write(tmp_path, _broken(mutate))
    with pytest.raises(GraphError, match=match) as info:
        load_graph(p)
    msg = str(info.value)
    assert str(p) in msg  # says which file
    assert not isinstance(info.value, GraphMismatchError)


def test_truncated_empty_and_invalid_json(tmp_path: Path) -> None:
    text = small_graph().to_json()
    for cut in (len(text) // 3, len(text) // 2, len(text) - 3):
        p = _write(tmp_path, text[:cut], f"cut{cut}.json")
        with pytest.raises(GraphError, match="truncated"):
            load_graph(p)
    with pytest.raises(GraphError, match="is empty"):
        load_graph(_write(tmp_path, "  \n", "empty.json"))
    with pytest.raises(GraphError, match="not valid JSON"):
        load_graph(_write(tmp_path, '{"format": spiffy}\n' + "\n" * 5 + "{}", "bad.json"))
    with pytest.raises(GraphError, match="does not exist"):
        load_graph(tmp_path / "missing.json")
    with pytest.raises(GraphError, match="top level must be a JSON object"):
        load_graph(_write(tmp_path, "[1, 2]", "list.json"))


# ---------------------------------------------------------------------------------------------------- compatibility
def test_check_compatible() -> None:
    g = small_graph()
    runtime = {k: v for k, v in CAL_FOR.items() if k != "model"}
    g.check_compatible(runtime)  # identical: fine
    g.check_compatible({**runtime, "temperature": 0.0, "threshold": None})
    g.check_compatible({"family": "LLaDA"})  # fields missing on one side are not compared; family case-insensitive
    for field, value in [
        ("block_length", 32),
        ("steps_per_block", 8),
        ("config_fingerprint", "ffffffffffffffff"),
        ("mask_id", 126336),
        ("threshold", 0.9),
        ("remasking", "random"),
        ("cache", "prefix"),
        ("tokens_per_step", 2),
        ("family", "dream"),
    ]:
        with pytest.raises(GraphMismatchError) as info:
            g.check_compatible({**runtime, field: value})
        err = info.value
        assert err.field == field
        assert err.graph_value == CAL_FOR[field] or field == "family"
        assert err.runtime_value == (value.lower() if isinstance(value, str) and field == "family" else value)
        msg = str(err)
        assert field in msg and repr(value if field != "family" else "dream") in msg
        assert "spiffy calibrate" in msg  # the fix
        assert isinstance(err, GraphError)
    # several at once: all are named
    with pytest.raises(GraphMismatchError) as info:
        g.check_compatible({**runtime, "block_length": 32, "cache": "dual"})
    assert [m[0] for m in info.value.mismatches] == ["block_length", "cache"]
    # soft fields: a warning, not an error
    with pytest.warns(GraphCompatibilityWarning, match="temperature"):
        g.check_compatible({**runtime, "temperature": 0.7})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.check_compatible({**runtime, "temperature": 0.7}, warn=False)
    # the model is compared by name: the same checkpoint elsewhere on disk is silent, another model warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.check_compatible({**runtime, "model": "/elsewhere/checkout/tiny/"})
    with pytest.warns(GraphCompatibilityWarning, match="model"):
        g.check_compatible({**runtime, "model": "/models/other-model"})
    # under threshold decoding the step count does not matter
    gt = DraftGraph.from_formulas([(1, [(1, 1)])], meta={"calibrated_for": {**CAL_FOR, "threshold": 0.9, "steps_per_block": None, "tokens_per_step": "dynamic"}})
    gt.check_compatible({**runtime, "threshold": 0.9, "steps_per_block": 16, "tokens_per_step": "dynamic"})


def test_model_config_fingerprint_is_architecture_only() -> None:
    base = {"model_type": "llada", "d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 512, "rope_theta": 500000}
    fp = model_config_fingerprint(base)
    assert len(fp) == 16
    assert model_config_fingerprint({**base, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "_name_or_path": "/x"}) == fp
    assert model_config_fingerprint({**base, "n_layers": 3}) != fp
    assert model_config_fingerprint({**base, "model_type": "LLaDA"}) == fp


# ---------------------------------------------------------------------------------------------------- properties
@st.composite
def chain_formulas(draw):  # noqa: ANN001, ANN201
    """Formulas from random chains (every prefix of a chain is included, so no formula is orphaned)."""
    tps = draw(st.sampled_from([1, 2, None]))
    step = tps or 1
    chains = draw(st.lists(st.lists(st.integers(1, 3), min_size=step, max_size=4 * step), min_size=1, max_size=5))
    formulas: dict[tuple[int, tuple], None] = {}
    for js in chains:
        pairs: list[tuple[int, int]] = []
        i = 0
        lvl = 0
        while i + step <= len(js):
            for j in js[i : i + step]:
                pairs.append((len(pairs) + 1, j))
            i += step
            lvl += 1
            formulas[(lvl, tuple(sorted(pairs)))] = None
        if tps is None and i < len(js):  # dynamic schedule: a last step with a different size
            for j in js[i:]:
                pairs.append((len(pairs) + 1, j))
            formulas[(lvl + 1, tuple(sorted(pairs)))] = None
    counts = draw(st.lists(st.integers(0, 1000), min_size=len(formulas), max_size=len(formulas)))
    meta = {"calibrated_for": {"tokens_per_step": tps if tps else "dynamic"}, "calibration": {"seed": draw(st.integers(0, 9))}}
    return list(formulas), counts, meta


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain_formulas())
def test_random_graphs_round_trip(data) -> None:  # noqa: ANN001
    formulas, counts, meta = data
    g = DraftGraph.from_formulas(formulas, meta=meta, counts=counts)
    g.validate()
    tps = g.tokens_per_step
    # parent links are exactly the parent relation, and parents precede children
    for b in g.nodes:
        expected = tuple(a.id for a in g.nodes if is_parent(a, b, tps))
        assert b.parents == expected
        assert all(p < b.id for p in b.parents)
        assert (b.level == 1) == (not b.parents)
        assert [c.id for c in g.children(b.id)] == [c.id for c in g.nodes if b.id in c.parents]
    # JSON
    assert DraftGraph.from_json_dict(json.loads(g.to_json())) == g
    # networkx, with and without the root node
    ng = g.to_networkx()
    assert nx.is_directed_acyclic_graph(ng) and ng.number_of_nodes() == len(g)
    assert DraftGraph.from_networkx(ng) == g
    assert DraftGraph.from_networkx(g.to_networkx(include_root=True)) == g
    # relabelled keys: renumbered in topological order, same structure
    relabelled = nx.relabel_nodes(ng, {n.id: f"n{n.id}" for n in g.nodes})
    h = DraftGraph.from_networkx(relabelled)
    key = lambda gr: {(n.level, n.pairs, n.count, tuple(sorted(gr.node(p).pairs for p in n.parents))) for n in gr.nodes}  # noqa: E731
    assert key(h) == key(g)


def test_from_networkx_rejects_bad_graphs() -> None:
    g = nx.DiGraph()
    g.add_node(0, level=1, pairs=[(1, 1)])
    g.add_node(1, level=2, pairs=[(1, 1), (2, 1)])
    g.add_edge(0, 1)
    g.add_edge(1, 0)
    with pytest.raises(GraphError, match="cycle"):
        DraftGraph.from_networkx(g)
    g2 = nx.DiGraph()
    g2.add_node("a", level=1)
    with pytest.raises(GraphError, match="no 'pairs' attribute"):
        DraftGraph.from_networkx(g2)


# ---------------------------------------------------------------------------------------------------- views + CLI
def test_summary_mentions_everything() -> None:
    s = small_graph().summary()
    for needle in ("5 node(s), 3 level(s)", "family=llada", "block_length=16", "level 1: 2 node(s), total count 70",
                   "level 3: 1 node(s)", "(1,1)(2,1)", "<- 0,1", "NFE 100 -> 60", "1.667x"):
        assert needle in s, needle


def test_render_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "g.png"
    small_graph().render(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_graph_show_validate_render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "g.json"
    small_graph().save(path)
    assert main(["graph", "show", str(path)]) == 0
    assert "NFE 100 -> 60" in capsys.readouterr().out
    assert main(["graph", "show", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["graph"]["num_nodes"] == 5
    assert main(["graph", "validate", str(path)]) == 0
    assert "valid spiffy draft graph" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert main(["graph", "render", str(path)]) == 0
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["graph", "render", str(path), "--out", str(tmp_path / "x" / "y.png")]) == 0
    assert (tmp_path / "x" / "y.png").exists()
    capsys.readouterr()
    bad = _write(tmp_path, _broken(lambda d: d["graph"]["nodes"][3].update(parents=[])), "bad.json")
    assert main(["graph", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "orphaned" in err and "bad.json" in err


def test_render_without_matplotlib_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing optional dependency (matplotlib) is a typed ConfigError naming the fix, not an ImportError."""
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    with pytest.raises(ConfigError, match="pip install"):
        small_graph().render(tmp_path / "g.png")
    assert not (tmp_path / "g.png").exists()


def test_node_normalisation_and_errors() -> None:
    n = DraftNode(0, 1, [[1, 2]], [])  # type: ignore[arg-type]
    assert n.pairs == ((1, 2),) and n.parents == ()
    with pytest.raises(GraphError):
        DraftNode(0, 1, 5)  # type: ignore[arg-type]
    with pytest.raises(GraphError, match="not a DraftNode"):
        DraftGraph([("x",)])  # type: ignore[list-item]
    # every pair of distinct formulas at consecutive levels obeys is_parent's definition
    a, b = DraftNode(0, 1, ((1, 1),)), DraftNode(1, 2, ((1, 1), (2, 3)))
    assert is_parent(a, b) and is_parent(a, b, 1) and not is_parent(a, b, 2) and not is_parent(b, a)
    assert list(itertools.islice(small_graph(), 1))[0].id == 0
