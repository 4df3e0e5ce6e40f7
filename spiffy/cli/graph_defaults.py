"""One default per model for every setting a graph can carry, and the one-line notes when a run departs from them.

A graph records the configuration it was calibrated for (``calibration``: dtype, prompt format ``chat``, the
decoding configuration ``decode_config``); its drafts, and so the forwards Spiffy saves, hold for that
configuration. The settings a dLLM command runs with never depend on ``--graph`` (adding a graph changes speed,
never tokens): :func:`settle_settings` fills every setting the user left unset from the **model card** alone, the
graphs shipped with the checkpoint (the shipped graph that agrees with most of the settings the user *did* set:
``--chat`` picks the graph calibrated on the chat template, ``--threshold 0.9`` the threshold graph; the first on a
tie), else from spiffy's own defaults (``load_model``'s dtype rule, the chat template when the tokenizer has one,
:class:`~spiffy.decoding.DecodeConfig`'s fields). ``spiffy generate``, ``spiffy calibrate`` and ``spiffy bench
dllm`` all call it, so the three agree whether or not a graph is given. A model-card setting that differs from
spiffy's own default is named in one line on stderr (:func:`card_note`); a graph whose recorded dtype or prompt
format differs from the run's is named in one line with its cost (:func:`difference_note`); a graph calibrated for
other decoding rules is refused with the flags it needs (``spiffy.embedded.check_graph_fits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from spiffy.cli.runtime import decode_config
from spiffy.decoding.factory import session_class
from spiffy.embedded import shipped_graphs
from spiffy.models.loading import family_of, read_config_dict
from spiffy.selfspec.graph import load_graph
from spiffy.torch_utils import resolve_dtype

__all__ = ["DECODE_FIELDS", "DEFAULT_COMPANION_THRESHOLD", "RunSettings", "card_note", "differences", "difference_note",
           "pick_defaults_graph", "recorded_settings", "requested_decoding", "settle_settings"]

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


@dataclass(frozen=True)
class RunSettings:
    """The settings a dLLM command decodes with (:func:`settle_settings`).

    Attributes:
        dtype: the ``--dtype`` to load with (``None``: ``load_model``'s rule: float32 on a CPU, the checkpoint's
            dtype on an accelerator).
        chat: prompts go through the tokenizer's chat template.
        config: the :class:`~spiffy.decoding.DecodeConfig`; extra: family options (SDAR's ``strategy``, ...).
        card: the shipped graph whose calibration supplied unset settings (``None``: spiffy's own defaults).
        taken: the settings the model card supplied that differ from spiffy's own defaults, one text each.
    """

    dtype: str | None
    chat: bool
    config: Any
    extra: dict[str, Any]
    card: Path | None
    taken: tuple[str, ...]


def _own_dtype(model_dir: str | Path, device: Any) -> str:
    """The dtype ``load_model(dtype=None)`` gives on ``device``, by name."""
    data = read_config_dict(model_dir) if (Path(model_dir) / "config.json").is_file() else {}
    return str(resolve_dtype(None, data, device)).replace("torch.", "")


def _family_config(model_dir: str | Path, config: Any, extra: dict[str, Any]) -> Any:
    """``config`` as the family's own configuration class fills it (SDAR: its committed cache whatever ``--cache``
    says), so a setting is named only where it changes the decoding rule."""
    data = read_config_dict(model_dir) if (Path(model_dir) / "config.json").is_file() else None
    if data is None:
        return config
    return session_class(family_of(data)).config_class.from_config(config, **extra)


def _option_text(name: str, value: Any) -> str:
    return f"{name.replace('_', ' ')} {'none' if value is None else value}"


def settle_settings(args: Any, model_dir: str | Path, *, chat: bool | None, has_template: bool,
                    device: Any = None) -> RunSettings:
    """The settings a dLLM command runs with: what the user set (``args``: ``dtype`` and the decoding flags, unset =
    ``None``; ``chat``: ``--chat`` / ``--no-chat`` or ``None``), the model card's for the rest, spiffy's own defaults
    where the model ships no graph. ``--graph`` plays no part: the same command with and without it decodes the
    same configuration. ``has_template``: the tokenizer has a chat template (spiffy's default prompt format then)."""
    decoding = requested_decoding(args)
    card = pick_defaults_graph(shipped_graphs(model_dir), getattr(args, "dtype", None), chat, decoding)
    recorded = recorded_settings(card)
    own_cfg, own_extra = decode_config(args)
    cfg, extra = decode_config(args, recorded.get("decode_config"))
    taken: list[str] = []
    dtype = getattr(args, "dtype", None)
    if dtype is None and recorded.get("dtype"):
        dtype, own = str(recorded["dtype"]), _own_dtype(model_dir, device)
        if dtype != own:
            taken.append(f"dtype {dtype} (default {own})")
    if chat is None:
        chat = bool(recorded["chat"]) if "chat" in recorded else has_template
        if chat != has_template:
            fmt = {True: "the chat template", False: "raw prompts"}
            taken.append(f"{fmt[chat]} (default {fmt[has_template]})")
    ran_rule, own_rule = _family_config(model_dir, cfg, extra), _family_config(model_dir, own_cfg, own_extra)
    for name in type(ran_rule).__dataclass_fields__:
        if name in ("seed", "mask_id"):
            continue
        ran, own = getattr(ran_rule, name), getattr(own_rule, name, None)
        if not _same(ran, own):
            taken.append(f"{_option_text(name, ran)} (default {'none' if own is None else own})")
    return RunSettings(dtype, bool(chat), cfg, extra, card, tuple(taken))


def card_note(command: str, model_dir: str | Path, settings: RunSettings) -> str | None:
    """The one stderr line naming the model-card settings that differ from spiffy's own defaults (``None``: none)."""
    if not settings.taken or settings.card is None:
        return None
    return (f"{command}: note: the model card of {Path(model_dir).name} sets {', '.join(settings.taken)}: the "
            f"configuration of its shipped graph {settings.card.stem}, used with or without --graph; pass a flag to "
            "choose another value")
