"""Baseline trajectories -> chains of draft formulas (what calibration counts).

At every recorded step ``n`` whose state ``x_n`` could carry drafts at run time, the chain of step ``n`` is
``f_1 ⊂ f_2 ⊂ ...``: ``f_l`` is the set of ``(i, j)`` pairs of the positions/tokens unmasked between ``x_n`` and
``x_{n+l}`` inside the current block, ranked under ``P_{n-1}`` (the logits that produced ``x_n``) exactly as the
runtime ranks them (:func:`spiffy.selfspec.formulas.rank_state`: positions still masked in the block of ``x_n`` in
the order the baseline's own selection would pick them, else by top-1 probability with ties to the lower row; tokens
by probability, ties -> lower id). The ranking's probabilities are kept too, so that the runtime's pruning can be
replayed on the recorded steps (:mod:`spiffy.selfspec.tune`).

A step can carry drafts only when

* a previous distribution exists (not the first step of a generation),
* its logits window covers the current block (same block, or a window containing it: never for block-causal SDAR
  or ``dual`` cache at a new block), and
* the step's own forward is a regular :meth:`~spiffy.decoding.session.DecodeSession.forward_states` call: with a
  ``prefix``/``dual`` cache the block's first step is driven by the refreshing block-start forward, which cannot
  carry drafts (the runtime takes a plain step there).

A chain stops before the block's final state (accepting it would save nothing: no step follows it in the
block, and the walk never crosses a block end), at ``max_level``, at the first step whose new pairs have a rank beyond
``i_max``/``j_max``, and (defensively) at a step that unmasks nothing or rewrites an already decoded token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from spiffy.decoding.batch import run_baseline
from spiffy.decoding.session import DecodeSession, StepRecord
from spiffy.errors import ConfigError
from spiffy.selfspec.formulas import rank_state, window_covers

Pair = tuple[int, int]
Formula = tuple[Pair, ...]


@dataclass(frozen=True)
class Chain:
    """The formula chain of one step.

    Attributes:
        prompt: index of the calibration prompt.
        index: global step index ``n`` inside the generation (0-based, across blocks).
        block: block of ``x_n``; step: step index of ``x_n`` inside its block.
        formulas: ``(f_1, f_2, ...)``, each a sorted tuple of ``(i, j)`` pairs; ``f_l`` has level ``l``.
    """

    prompt: int
    index: int
    block: int
    step: int
    formulas: tuple[Formula, ...]

    def keys(self) -> list[tuple[int, Formula]]:
        """``[(level, formula), ...]`` of the chain."""
        return [(lvl + 1, f) for lvl, f in enumerate(self.formulas)]


@dataclass
class Trajectory:
    """What calibration keeps of one baseline generation.

    Attributes:
        prompt: index of the calibration prompt.
        nfe: model forwards of the whole baseline generation (block-start / commit forwards included).
        num_steps: denoising steps taken.
        blocks: block index of every step, in order.
        chains: ``{global step index: chain}`` for the steps that can carry drafts (chains may be empty).
        probs: ``{global step index: [I, J] tensor}`` for the same steps: ``p_ij`` of the step's ranking (CPU),
            what the pruning scores read.
    """

    prompt: int
    nfe: int
    num_steps: int
    blocks: list[int] = field(default_factory=list)
    chains: dict[int, Chain] = field(default_factory=dict)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)

    def chain_list(self) -> list[Chain]:
        return [self.chains[k] for k in sorted(self.chains)]


@dataclass
class _Start:
    index: int
    block: int
    step: int
    rank_of_row: dict[int, int]
    top_tokens: dict[int, list[int]]
    probs: torch.Tensor


class ChainRecorder:
    """Observer for :func:`~spiffy.decoding.session.run_baseline` that extracts formula chains on the fly.

    It keeps only the previous step's logits and, per step, the ranked rows / top-``j_max`` tokens it needs, so
    memory does not grow with the vocabulary or the generation length.

    Args:
        mask_id: the family's mask token id.
        i_max, j_max: rank caps (``>= 1``).
        max_level: longest chain (``None`` = up to the block end).
        prompt: prompt index stored in the chains.

    Use :meth:`attach` on a session before running the baseline (it notes which blocks start with a refreshing
    block-start forward), pass the recorder as ``observer``, then call :meth:`finish`.
    """

    def __init__(self, mask_id: int, i_max: int, j_max: int, max_level: int | None = None, prompt: int = 0) -> None:
        if isinstance(i_max, bool) or not isinstance(i_max, int) or i_max < 1:
            raise ConfigError(f"i_max={i_max!r} must be an integer >= 1; fix: pass e.g. i_max=8")
        if isinstance(j_max, bool) or not isinstance(j_max, int) or j_max < 1:
            raise ConfigError(f"j_max={j_max!r} must be an integer >= 1; fix: pass e.g. j_max=4")
        if max_level is not None and (isinstance(max_level, bool) or not isinstance(max_level, int) or max_level < 1):
            raise ConfigError(f"max_level={max_level!r} must be None or an integer >= 1")
        self.mask_id = int(mask_id)
        self.i_max, self.j_max, self.max_level = i_max, j_max, max_level
        self.prompt = prompt
        self.refreshed: set[int] = set()
        self._prev: tuple[torch.Tensor, int, torch.Tensor | None] | None = None
        self._n = 0
        self._blocks: list[int] = []
        self._unmasked: list[list[tuple[int, int]]] = []  # per step: (row, token) unmasked
        self._bad: list[bool] = []  # per step: rewrote a decoded token or changed rows outside the block
        self._starts: list[_Start] = []

    def attach(self, session: DecodeSession) -> DecodeSession:
        """Wrap ``session.begin_block`` (on the instance) to note blocks whose first step is driven by a
        block-start forward (``prefix``/``dual`` cache refresh): such steps carry no drafts at run time."""
        original = session.begin_block

        def begin_block(block: int) -> torch.Tensor | None:
            out = original(block)
            if out is not None:
                self.refreshed.add(int(block))
            return out

        session.begin_block = begin_block  # type: ignore[method-assign]
        return session

    def mark_refreshed(self, block: int) -> None:
        """Declare that ``block``'s first step was driven by a block-start forward."""
        self.refreshed.add(int(block))

    def __call__(self, record: StepRecord) -> None:
        info = record.info
        x0, x1 = record.x_before, record.x_after
        if x0.dim() != 2 or x0.shape[0] != 1:
            raise ConfigError(f"calibration records batch-1 generations, got a state of shape {tuple(x0.shape)}")
        n = self._n
        bs, be = int(info.block_start), int(info.block_end)
        if self._prev is not None and not (info.step == 0 and info.block in self.refreshed):
            p_logits, p_start, p_probs = self._prev
            if window_covers(p_start, int(p_logits.shape[1]), bs, be):
                r = rank_state(
                    p_logits[0], x0[0], bs, be, p_start, self.i_max, self.j_max, mask_id=self.mask_id, probs=p_probs
                )
                rows = r.rows.tolist()
                toks = r.token_ids.tolist()
                self._starts.append(
                    _Start(
                        index=n,
                        block=int(info.block),
                        step=int(info.step),
                        rank_of_row={row: k + 1 for k, row in enumerate(rows)},
                        top_tokens={row: toks[k] for k, row in enumerate(rows)},
                        probs=r.token_probs.detach().cpu(),
                    )
                )
        # what this step unmasked
        a, b = x0[0], x1[0]
        changed = (a != b).nonzero().squeeze(1).tolist()
        bad = False
        new: list[tuple[int, int]] = []
        if changed:
            before = a[changed].tolist()
            after = b[changed].tolist()
            for row, tb, ta in zip(changed, before, after):
                if tb != self.mask_id or ta == self.mask_id or not (bs <= row < be):
                    bad = True
                else:
                    new.append((row, ta))
        self._blocks.append(int(info.block))
        self._unmasked.append(new)
        self._bad.append(bad)
        self._prev = (record.logits.detach(), int(info.window_start), record.probs)
        self._n += 1

    def finish(self, nfe: int = 0) -> Trajectory:
        """Build the chains of every recorded step; ``nfe`` = the baseline's forward count of the generation."""
        traj = Trajectory(prompt=self.prompt, nfe=int(nfe), num_steps=self._n, blocks=list(self._blocks))
        for s in self._starts:
            traj.chains[s.index] = Chain(self.prompt, s.index, s.block, s.step, self._chain(s))
            traj.probs[s.index] = s.probs
        self._prev = None
        return traj

    def _chain(self, s: _Start) -> tuple[Formula, ...]:
        out: list[Formula] = []
        current: list[Pair] = []
        m = s.index
        # level l = steps n..n+l-1 replayed from drafts; a draft is only useful when the block has a further step
        # after it (the walk never accepts the block's final state: no transition would follow it)
        while m + 1 < self._n and self._blocks[m] == s.block and self._blocks[m + 1] == s.block:
            if self.max_level is not None and len(out) >= self.max_level:
                break
            if self._bad[m] or not self._unmasked[m]:
                break
            added: list[Pair] = []
            for row, tok in self._unmasked[m]:
                i = s.rank_of_row.get(row)
                if i is None:
                    break
                tops = s.top_tokens[row]
                try:
                    j = tops.index(tok) + 1
                except ValueError:
                    break
                added.append((i, j))
            else:
                current = current + added
                out.append(tuple(sorted(current)))
                m += 1
                continue
            break
        return tuple(out)


def record_chains(session: DecodeSession, i_max: int, j_max: int, max_level: int | None = None, prompt: int = 0,
                  progress: Callable[[int], None] | None = None) -> Trajectory:
    """Decode a prepared batch-1 ``session`` with the baseline and return its :class:`Trajectory`: every step's ranking
    and the formula chain its future followed (a :class:`ChainRecorder` attached before the first forward, so
    block-start forwards are noted). ``progress`` is called with ``1`` after every step."""
    recorder = ChainRecorder(int(session.mask_id), i_max, j_max, max_level, prompt=prompt)
    recorder.attach(session)
    stats = run_baseline(session, observer=recorder, progress=progress)
    return recorder.finish(stats.nfe)


def extract_chains(
    records: Iterable[StepRecord],
    *,
    mask_id: int,
    i_max: int,
    j_max: int,
    max_level: int | None = None,
    refreshed_blocks: Iterable[int] = (),
    prompt: int = 0,
    nfe: int = 0,
) -> Trajectory:
    """Chains of a recorded baseline trajectory (a list of :class:`~spiffy.decoding.session.StepRecord`).

    Args:
        records: the steps in order (``record.logits``: ``[1, W, V]`` aligned window logits that drove the step).
        mask_id: the family's mask token id.
        i_max, j_max: rank caps.
        max_level: longest chain (``None`` = to the block end).
        refreshed_blocks: blocks whose first step was driven by a block-start (cache refresh) forward.
        prompt: prompt index stored in the chains; nfe: the generation's forward count.
    Returns:
        :class:`Trajectory` with one chain per step that can carry drafts.
    """
    rec = ChainRecorder(mask_id, i_max, j_max, max_level, prompt)
    for b in refreshed_blocks:
        rec.mark_refreshed(b)
    for r in records:
        rec(r)
    return rec.finish(nfe)


def count_formulas(chains: Iterable[Chain]) -> Counter[tuple[int, Formula]]:
    """``{(level, formula): number of chains containing it at that level}``."""
    c: Counter[tuple[int, Formula]] = Counter()
    for ch in chains:
        c.update(ch.keys())
    return c


def all_chains(trajectories: Sequence[Trajectory]) -> list[Chain]:
    """Every chain of every trajectory, in prompt and step order."""
    return [c for t in trajectories for c in t.chain_list()]


def describe(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """Small statistics of a calibration run (steps, chains, mean chain length)."""
    chains = all_chains(trajectories)
    lengths = [len(c.formulas) for c in chains]
    return {
        "steps": sum(t.num_steps for t in trajectories),
        "chains": len(chains),
        "nonempty_chains": sum(1 for v in lengths if v),
        "mean_chain_length": (sum(lengths) / len(lengths)) if lengths else 0.0,
    }


__all__ = ["Chain", "Trajectory", "ChainRecorder", "record_chains", "extract_chains", "count_formulas", "all_chains", "describe"]
