"""FreeDave (Free Draft-and-Verification, arXiv 2510.00294) expressed as a Spiffy draft graph.

FreeDave drafts the next states of a dLLM's own decoding without any calibration: from the state ``x`` and the
logits of the last forward it builds ``K`` drafts, draft ``k`` (``k = 1..K``) unmasking the ``k * S`` most confident
masked positions at once, each with its argmax token (``S`` = tokens per step), and verifies all ``K`` in one batched
forward. Draft 1 is exactly the baseline's next step, so one FreeDave forward covers the committed state plus a chain
of ``K - 1`` speculative states.

In Spiffy's (i, j) format (:mod:`spiffy.selfspec.formulas`, ranks taken in the committed state under the same
logits ``P``) the speculative part of that chain is the graph with one node per level::

    level l = {(1, 1), (2, 1), ..., (l * S, 1)}        l = 1 .. K - 1

so FreeDave with ``K`` draft steps = this chain of depth ``K - 1`` at budget ``D* = K - 1`` (``K`` states per verification
forward, like Spiffy at ``D* = K - 1``). Differences from the official code, each a property of the graph format:

* ties between equal confidences fall as the baseline's own ``torch.topk`` breaks them one step at a time
  (:func:`~spiffy.selfspec.formulas.selection_order`, as for every Spiffy graph); the official code takes the
  ``k`` positions of draft ``k`` from one ``torch.topk(k)`` call, whose ties may fall otherwise (frequent in
  bfloat16, where confident positions round to exactly 1.0);
* drafts stay inside the current block (the official code also drafts into the next blocks of its window);
* under threshold decoding (``tokens_per_step == "dynamic"``) FreeDave++ takes the threshold step and then adds one
  more position per draft; the chain here has one position per level, and a draft is accepted only when it equals
  the state the baseline reaches (Spiffy's lossless rule), where the official code accepts a draft whose unmasked
  tokens are a subset of the verified target.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from spiffy.decoding import make_session
from spiffy.errors import ConfigError
from spiffy.selfspec.graph import DraftGraph, runtime_signature
from spiffy.selfspec.graph.nodes import Pair

#: how a FreeDave comparison is named on the command line: ``freedave:K`` (K draft steps = states per forward)
FREEDAVE_PREFIX = "freedave:"


def chain_formulas(depth: int, tokens_per_step: int = 1) -> list[tuple[int, tuple[Pair, ...]]]:
    """``(level, pairs)`` of the top-k chain: level ``l`` = the ``l * tokens_per_step`` most confident positions, each
    with its argmax token (``depth`` levels, one node each)."""
    if int(depth) < 1:
        raise ConfigError(f"chain depth must be >= 1, got {depth}; fix: pass --depth 1 or more")
    if int(tokens_per_step) < 1:
        raise ConfigError(f"tokens per step must be >= 1, got {tokens_per_step}")
    s = int(tokens_per_step)
    return [(lvl, tuple((i, 1) for i in range(1, lvl * s + 1))) for lvl in range(1, int(depth) + 1)]


def chain_graph(depth: int, calibrated_for: Mapping[str, Any], *, method: str = "chain", budget: int | None = None,
                note: str | None = None) -> DraftGraph:
    """The top-k chain graph for a decoding configuration described by ``calibrated_for``.

    Args:
        depth: number of levels (speculative states per forward).
        calibrated_for: the runtime signature (:func:`spiffy.selfspec.calibrate.runtime_signature`) the graph is
            compatible with; its ``tokens_per_step`` sets the positions added per level (``"dynamic"``: one).
        method: recorded in the ``calibration`` section (``chain``, ``freedave`` or ``ssd``).
        budget: recorded as the ``D*`` the graph is tuned for (``calibration.budget``, what the runtime keeps per
            step when not told otherwise); ``None``: not tuned.
        note: the ``calibration.note`` (default: how the chain is built).
    """
    cf = dict(calibrated_for)
    tps = cf.get("tokens_per_step")
    static = isinstance(tps, int) and not isinstance(tps, bool)
    formulas = chain_formulas(depth, int(tps) if static else 1)
    calibration: dict[str, Any] = {
        "method": method, "depth": int(depth), "num_prompts": 0, "dataset": None,
        "note": note or "built without calibration: level l unmasks the l most confident positions per step"}
    if budget is not None:
        calibration["budget"] = int(budget)
    return DraftGraph.from_formulas(formulas, meta={"calibrated_for": cf, "calibration": calibration})


def chain_graph_for(model: Any, config: Any, depth: int, *, method: str = "chain", budget: int | None = None,
                    note: str | None = None, **overrides: Any) -> DraftGraph:
    """:func:`chain_graph` compatible with ``model`` decoding under ``config`` (``overrides``: family options such as
    SDAR ``strategy``, as passed to ``generate``)."""
    session = make_session(model, torch.zeros((1, 1), dtype=torch.long), config, **overrides)
    return chain_graph(depth, runtime_signature(model, session), method=method, budget=budget, note=note)


def freedave_graph(model: Any, config: Any, draft_steps: int, **overrides: Any) -> DraftGraph:
    """FreeDave with ``draft_steps`` (K) draft steps as a graph: the chain of depth ``K - 1``, tuned for budget ``K - 1``
    (the runtime verifies the whole chain every forward; see the module docstring)."""
    k = parse_freedave_steps(draft_steps)
    return chain_graph_for(model, config, k - 1, method="freedave", budget=k - 1, **overrides)


def parse_freedave_steps(value: Any) -> int:
    """FreeDave draft steps ``K`` (``>= 2``) from an int, ``"K"`` or ``"freedave:K"``."""
    return parse_width(value, FREEDAVE_PREFIX, "FreeDave")


def parse_width(value: Any, prefix: str, name: str) -> int:
    """States per verification forward ``K`` (``>= 2``) of a training-free rival named ``name`` on the command
    line as ``prefix + K``, from an int, ``"K"`` or ``prefix + "K"``."""
    text = str(value)
    if text.startswith(prefix):
        text = text[len(prefix):]
    try:
        k = int(text)
    except ValueError:
        raise ConfigError(f"{name} states per forward must be an integer, got {value!r}; fix: e.g. {prefix}4") from None
    if k < 2:
        raise ConfigError(f"{name} needs >= 2 states per forward (the real state and a draft), got {k}; "
                          f"fix: e.g. {prefix}2")
    return k


def is_freedave_spec(value: Any) -> bool:
    """Whether a ``--graph`` value names FreeDave (``freedave:K``) rather than a file."""
    return isinstance(value, str) and value.startswith(FREEDAVE_PREFIX)


__all__ = ["chain_formulas", "chain_graph", "chain_graph_for", "freedave_graph", "parse_freedave_steps",
           "parse_width", "is_freedave_spec", "FREEDAVE_PREFIX"]
