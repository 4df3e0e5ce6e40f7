"""Spiffy's training-free rivals as draft graphs: FreeDave (:mod:`spiffy.selfspec.freedave`) and SSD
(:mod:`spiffy.selfspec.ssd`).

Each is named ``NAME:K`` on the command line (``K`` states per verification forward: the real state and ``K - 1``
drafts, like Spiffy at ``D* = K - 1``), is built from the model and its decoding configuration without calibration,
and runs on the same exact runtime as a calibrated graph. This registry is the one place that knows their names:
``spiffy generate --graph NAME:K`` and ``spiffy bench dllm --NAME LIST`` read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from spiffy.errors import ConfigError
from spiffy.selfspec.freedave import FREEDAVE_PREFIX, freedave_graph, parse_freedave_steps
from spiffy.selfspec.graph import DraftGraph
from spiffy.selfspec.ssd import SSD_PREFIX, parse_ssd_states, ssd_graph


@dataclass(frozen=True)
class Rival:
    """One training-free rival: its name (results' ``method``), how a report names it, its graph builder
    ``(model, config, K, **overrides) -> DraftGraph``, the parser of ``K`` and its command-line prefix."""

    name: str
    label: str
    build: Callable[..., DraftGraph]
    parse: Callable[[Any], int]
    prefix: str


#: the rivals by name, in the order reports list them
RIVALS: dict[str, Rival] = {
    "freedave": Rival("freedave", "FreeDave", freedave_graph, parse_freedave_steps, FREEDAVE_PREFIX),
    "ssd": Rival("ssd", "SSD", ssd_graph, parse_ssd_states, SSD_PREFIX),
}


def parse_rival(value: Any) -> tuple[str, int] | None:
    """``(name, K)`` of a ``NAME:K`` value naming a rival (``None`` for anything else, e.g. a graph file).

    Raises:
        ConfigError: a rival's name with a bad ``K`` (not an integer, or ``< 2``).
    """
    if not isinstance(value, str):
        return None
    for rival in RIVALS.values():
        if value.startswith(rival.prefix):
            return rival.name, rival.parse(value)
    return None


def rival_graph(model: Any, config: Any, name: str, states_per_forward: Any, **overrides: Any) -> DraftGraph:
    """The draft graph of rival ``name`` with ``states_per_forward`` states per forward, tuned for budget ``K - 1``.

    Raises:
        ConfigError: an unknown name, or a bad ``K``.
    """
    rival = RIVALS.get(name)
    if rival is None:
        raise ConfigError(f"unknown rival {name!r}; fix: use one of {', '.join(RIVALS)}")
    return rival.build(model, config, states_per_forward, **overrides)


def parse_rival_list(name: str, text: str | None) -> list[int]:
    """``K`` values of a comma-separated list (``--freedave 2,4,6``) for rival ``name`` (empty for ``None``)."""
    parse = RIVALS[name].parse
    return [parse(v.strip()) for v in (text or "").split(",") if v.strip()]


__all__ = ["RIVALS", "Rival", "parse_rival", "parse_rival_list", "rival_graph"]
