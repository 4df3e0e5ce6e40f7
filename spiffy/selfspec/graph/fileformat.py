"""The draft-graph file format (``"format": "spiffy-draft-graph"``, ``"version": 1``): reading, schema checks
and the human-readable JSON layout. See :mod:`spiffy.selfspec.graph` for the layout."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Mapping

from spiffy.errors import GraphError
from spiffy.selfspec.graph.nodes import DraftNode, is_int

FORMAT = "spiffy-draft-graph"

VERSION = 1



def to_json_dict(graph: Any) -> dict[str, Any]:
    """The versioned file content of ``graph`` (a :class:`DraftGraph`) as a JSON-ready dict."""
    meta = copy.deepcopy(graph.meta)
    d: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    d["calibrated_for"] = meta.pop("calibrated_for", {})
    d["calibration"] = meta.pop("calibration", {})
    for k, v in meta.items():
        d[k] = v
    d["graph"] = {
        "num_nodes": len(graph.nodes),
        "max_level": graph.max_level(),
        "nodes": [
            {
                "id": n.id,
                "level": n.level,
                "pairs": [list(p) for p in n.pairs],
                "parents": list(n.parents),
                "count": n.count,
            }
            for n in graph.nodes
        ],
    }
    d["projected"] = copy.deepcopy(graph.projected)
    return d


def read_graph_file(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON of a graph file; raises :class:`GraphError` saying what is wrong with the file and how to fix it."""
    p = Path(path)
    if not p.exists():
        raise GraphError(
            f"graph file {str(p)!r} does not exist; fix: check the path, or create one with "
            "`spiffy calibrate --model MODEL_DIR --prompts default --out graph.json`"
        )
    if p.is_dir():
        raise GraphError(f"graph path {str(p)!r} is a directory; fix: pass the .json graph file itself")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise GraphError(f"graph file {str(p)!r} is not UTF-8 text ({exc}); fix: pass a JSON graph written by `spiffy calibrate`") from None
    except OSError as exc:
        raise GraphError(f"graph file {str(p)!r} cannot be read ({exc}); fix: check its permissions") from None
    if not text.strip():
        raise GraphError(f"graph file {str(p)!r} is empty; fix: recalibrate with `spiffy calibrate ... --out {p.name}`")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        stripped = len(text.rstrip())
        if exc.pos >= stripped - 1 or "Unterminated string" in exc.msg:
            raise GraphError(
                f"graph file {str(p)!r} is truncated: the JSON ends early (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                "fix: the file was cut off - recalibrate or restore it from a copy"
            ) from None
        raise GraphError(
            f"graph file {str(p)!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "fix: restore the file or recalibrate with `spiffy calibrate`"
        ) from None
    return data



def parse(d: Any) -> tuple[list[DraftNode], dict[str, Any], dict[str, Any]]:
    if not isinstance(d, dict):
        raise GraphError(f"top level must be a JSON object, got {type(d).__name__}; fix: pass a graph written by `spiffy calibrate`")
    fmt = d.get("format")
    if fmt != FORMAT:
        raise GraphError(
            f"field 'format' is {fmt!r}, expected {FORMAT!r}; this is not a spiffy draft-graph file "
            "(fix: pass a file written by `spiffy calibrate`)"
        )
    if "version" not in d:
        raise GraphError("missing field 'version'; fix: the file is incomplete - recalibrate with `spiffy calibrate`")
    ver = d["version"]
    if not is_int(ver):
        raise GraphError(f"field 'version' must be an integer, got {ver!r}")
    if ver > VERSION:
        raise GraphError(
            f"graph file version {ver} is newer than this spiffy supports (version {VERSION}); fix: upgrade spiffy, "
            "or recalibrate with this version"
        )
    if ver != VERSION:
        raise GraphError(f"graph file version {ver} is not supported (expected {VERSION}); fix: recalibrate with `spiffy calibrate`")
    cal_for = _require(d, "calibrated_for", dict, "top level")
    cal = d.get("calibration", {})
    if not isinstance(cal, dict):
        raise GraphError(f"field 'calibration' must be an object, got {type(cal).__name__}")
    if cal.get("score") is not None and not isinstance(cal.get("score"), str):
        raise GraphError(f"field 'calibration.score' must be a pruning score name, got {cal.get('score')!r}")
    projected = d.get("projected", {})
    if not isinstance(projected, dict):
        raise GraphError(f"field 'projected' must be an object, got {type(projected).__name__}")
    graph = _require(d, "graph", dict, "top level")
    raw_nodes = _require(graph, "nodes", list, "section 'graph'")
    if "num_nodes" in graph and graph["num_nodes"] != len(raw_nodes):
        raise GraphError(
            f"section 'graph': num_nodes is {graph['num_nodes']!r} but {len(raw_nodes)} node(s) are listed; "
            "fix: the file was edited or cut - recalibrate"
        )
    nodes: list[DraftNode] = []
    for k, rn in enumerate(raw_nodes):
        where = f"graph.nodes[{k}]"
        if not isinstance(rn, dict):
            raise GraphError(f"{where} must be an object, got {type(rn).__name__}")
        nid = _require(rn, "id", int, where)
        where = f"{where} (id {nid})"
        level = _require(rn, "level", int, where)
        pairs = _require(rn, "pairs", list, where)
        parents = _require(rn, "parents", list, where)
        count = rn.get("count", 0)
        for pair in pairs:
            if not isinstance(pair, list) or len(pair) != 2 or not all(is_int(v) for v in pair):
                raise GraphError(f"{where}: pair {short(pair)} must be a list of two integers [i, j]")
        for p in parents:
            if not is_int(p):
                raise GraphError(f"{where}: parent {short(p)} must be an integer node id")
        if not is_int(count):
            raise GraphError(f"{where}: count {short(count)} must be an integer")
        nodes.append(DraftNode(id=nid, level=level, pairs=tuple(tuple(p) for p in pairs), parents=tuple(parents), count=count))
    if "max_level" in graph and graph["max_level"] != max((n.level for n in nodes), default=0):
        raise GraphError(f"section 'graph': max_level {graph['max_level']!r} does not match the nodes; fix: recalibrate")
    meta: dict[str, Any] = {"calibrated_for": cal_for, "calibration": cal}
    for k, v in d.items():
        if k not in ("format", "version", "calibrated_for", "calibration", "graph", "projected"):
            meta[k] = v
    return nodes, meta, projected



def _require(d: Mapping[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise GraphError(f"{where}: missing field {key!r}; fix: the file is incomplete - recalibrate with `spiffy calibrate`")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise GraphError(f"{where}: field {key!r} must be {names}, got {type(v).__name__} {short(v)}")
    return v



def short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    s = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return s if len(s) <= 80 else s[:77] + "..."



def _is_compact(v: Any) -> bool:
    """Scalars, and lists/dicts of scalars or of lists of scalars, print on one line."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return True
    if isinstance(v, list):
        return all(isinstance(x, (str, int, float, bool)) or x is None or (isinstance(x, list) and all(not isinstance(y, (list, dict)) for y in x)) for x in v)
    return False



def pretty(v: Any, indent: int = 0) -> str:
    """Indented JSON with short lists and node records on single lines."""
    pad = "  " * indent
    if isinstance(v, dict):
        if not v:
            return "{}"
        if indent >= 2 and all(_is_compact(x) for x in v.values()) and len(json.dumps(v, ensure_ascii=False)) <= 160:
            return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))
        items = [f'{pad}  {json.dumps(str(k), ensure_ascii=False)}: {pretty(x, indent + 1)}' for k, x in v.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(v, list):
        if not v:
            return "[]"
        if _is_compact(v) and len(json.dumps(v, ensure_ascii=False)) <= 160:
            return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))
        items = [f"{pad}  {pretty(x, indent + 1)}" for x in v]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(v, ensure_ascii=False)



__all__ = ["FORMAT", "VERSION", "parse", "pretty", "read_graph_file", "short", "to_json_dict"]
