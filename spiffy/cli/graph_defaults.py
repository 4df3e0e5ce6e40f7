"""Which shipped draft graph a dLLM command takes its defaults from, and the one-line note when a run departs from it.

A graph records the configuration it was calibrated for (``calibration``: dtype, prompt format ``chat``, the
decoding configuration ``decode_config``); its drafts, and so the forwards Spiffy saves, hold for that
configuration. ``spiffy generate`` and ``spiffy bench dllm`` therefore fill every setting the user left unset from
one graph: the shipped graph that agrees with most of the settings the user *did* set (``--chat`` picks the graph
calibrated on the chat template, ``--threshold 0.9`` the threshold graph), the first shipped one on a tie. A setting
the user set that still differs from the graph the run uses is named in one line on stderr with its cost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from spiffy.selfspec.graph import load_graph

__all__ = ["DECODE_FIELDS", "DEFAULT_COMPANION_THRESHOLD", "differences", "difference_note", "pick_defaults_graph", "recorded_settings",
           "requested_decoding"]

#: DecodeConfig fields compared between a graph's calibration and a run (the decoding flags that shape the drafts)
DECODE_FIELDS: tuple[str, ...] = (
    "gen_length", "block_length", "steps", "threshold", "remasking", "cache", "cfg_scale", "alg", "alg_temp",
    "temperature",
)

#: ``spiffy bench dllm``'s default second regime: threshold decoding at this confidence, beside one token per step
DEFAULT_COMPANION_THRESHOLD = 0.9


def recorded_settings(path: str | Path | None) -> dict[str, Any]:
    """The ``calibration`` record of the graph file at ``path`` (``{}`` for ``None`` or a graph without one)."""
    if path is None:
        return {}
    cal = load_graph(path).meta.get("calibration", {})
    return cal if isinstance(cal, dict) else {}


def requested_decoding(args: Any) -> dict[str, Any]:
    """The decoding flags of :data:`DECODE_FIELDS` the user set (``None`` = unset and left out)."""
    return {k: getattr(args, k) for k in DECODE_FIELDS if getattr(args, k, None) is not None}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _conflicts(recorded: dict[str, Any], dtype: str | None, chat: bool | None, decoding: dict[str, Any]) -> list[str]:
    """Each setting given (not ``None``) that the record holds with another value, as ``'NAME VALUE (graph: X)'``."""
    out: list[str] = []
    if dtype is not None and recorded.get("dtype") and str(dtype) != str(recorded["dtype"]):
        out.append(f"dtype {dtype} (graph: {recorded['dtype']})")
    if chat is not None and "chat" in recorded and bool(chat) != bool(recorded["chat"]):
        fmt = {True: "chat template", False: "raw prompts"}
        out.append(f"{fmt[bool(chat)]} (graph: {fmt[bool(recorded['chat'])]})")
    base = recorded.get("decode_config") if isinstance(recorded.get("decode_config"), dict) else {}
    for name, value in decoding.items():
        if name in base and not _same(value, base[name]):
            out.append(f"{name.replace('_', ' ')} {value} (graph: {base[name]})")
    return out


def pick_defaults_graph(shipped: Sequence[Path], dtype: str | None, chat: bool | None,
                        decoding: dict[str, Any]) -> Path | None:
    """The shipped graph whose calibration differs from the given settings in the fewest of them (the first on a
    tie; ``None`` when nothing is shipped). ``dtype`` / ``chat`` ``None`` and absent decoding keys: not set."""
    best: tuple[int, Path] | None = None
    for path in shipped:
        n = len(_conflicts(recorded_settings(path), dtype, chat, decoding))
        if best is None or n < best[0]:
            best = (n, Path(path))
    return best[1] if best is not None else None


def differences(recorded: dict[str, Any], dtype: str, chat: bool, config: Any) -> list[str]:
    """How a run (``dtype``, prompt format ``chat``, :class:`~spiffy.decoding.DecodeConfig` ``config``) departs
    from the configuration a graph recorded, one ``'NAME VALUE (graph: X)'`` per setting."""
    decoding = {k: getattr(config, k) for k in DECODE_FIELDS if hasattr(config, k)}
    return _conflicts(recorded, dtype, chat, decoding)


def difference_note(command: str, graph: str | Path, diffs: list[str]) -> str:
    """The one-line note for a run that departs from its graph's calibration: what differs and what it costs."""
    return (f"{command}: note: {', '.join(diffs)} differ from the calibration of the graph {Path(graph).name}: "
            "outputs stay identical, but its drafts fit these runs less well, so expect fewer forwards saved "
            "(the embedded tiny-sdar at D* = 5 on its bfloat16 raw-prompt graph: 1.91x in float32 with the chat "
            "template against 2.78x as calibrated, docs/RESULTS.md); fix: drop the flag, or calibrate a graph for "
            "it (`spiffy calibrate`)")
