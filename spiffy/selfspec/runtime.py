"""The Spiffy speculative decoder: one forward verifies the real state and a pruned set of draft states.

One iteration (SPEC section 5):

1. From the latest distribution ``P`` (the logits that produced the current state ``x_n``), rank the masked
   positions of the block and their tokens (:func:`~spiffy.selfspec.formulas.rank_state`), keep ``budget`` nodes
   of the calibrated draft graph (:func:`~spiffy.selfspec.pruning.prune`) and instantiate them into states.
2. One call ``session.forward_states([x_n; drafts])`` computes ``F`` of every state exactly as the baseline would
   (the session implements the exact verification rule of its family and cache mode).
3. Walk (:func:`spiffy.verify.backend.follow`): ``x_{n+1} = R(x_n, F(x_n))`` with the baseline transition; if it
   equals a kept child draft, that draft's logits are ``F(x_{n+1})`` and the next step costs no model call; stop
   at the first state matching no child, or at the end of the block.
4. The last logits used become ``P``.

No-op steps: when a transition unmasks nothing (Dream's schedule often assigns 0 tokens to a step), the next state
equals the current one, whose ``forward_states`` logits are already known; the walk reuses them for the next step
instead of calling the model (``reused_steps``). This is exact for logits of :meth:`forward_states` (a pure function
of the state inside a block); the logits a cache mode's block-start forward returns come from a different
computation and are never reused.

Acceptance is exact state equality after the baseline rule, which consumes the session's generator in the
baseline's order on the same logits: the output equals the baseline's token for token, at any temperature.
The walk never crosses a block end (with a cache the baseline refreshes at block start; without one, stopping is
simply the exact and simple rule). Drafts for a block's first step are ranked from the previous distribution only
when its logits window covers the new block (never for block-causal SDAR, whose windows are single blocks).

Not implemented (on purpose): the paper's approximate "simplified shared-context mask"; every path here is exact.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from spiffy.decoding.session import DecodeSession, StepRecord, StepObserver, close_block
from spiffy.errors import ConfigError
from spiffy.selfspec.formulas import instantiate_many, rank_state, window_covers
from spiffy.selfspec.graph import DraftGraph
from spiffy.selfspec.pruning import DEFAULT_BUDGET, prune, resolve_budget, resolve_score
from spiffy.verify.backend import follow

STAGES: tuple[str, ...] = ("rank", "prune", "instantiate", "verify", "walk")


@dataclass
class SpeculativeStats:
    """Counters of one speculative generation.

    Attributes:
        nfe: model forward calls actually made (the session's count, block-start/commit forwards included).
        baseline_equivalent_nfe: ``nfe + accepted_total + reused_steps``: what the baseline spent.
        accepted_total: accepted drafts (= forwards saved).
        accepted_per_forward: histogram ``{accepted drafts in one verification forward: number of forwards}``.
        accepted_per_level: ``{graph level: accepted drafts of that level}``.
        reused_steps: no-op steps (nothing unmasked) that reused the known logits of the same state (= forwards
            saved beyond ``accepted_total``).
        forwards: verification forwards made by the runtime (``forward_states`` calls).
        drafts_evaluated: draft states evaluated in those forwards (after deduplication).
        steps: denoising steps taken (same as the baseline's).
        steps_per_block: steps of each block.
        stage_times: seconds per stage ``rank``, ``prune``, ``instantiate``, ``verify``, ``walk``.
        budget: drafts kept per step; score: pruning score.
    """

    nfe: int = 0
    baseline_equivalent_nfe: int = 0
    accepted_total: int = 0
    accepted_per_forward: dict[int, int] = field(default_factory=dict)
    accepted_per_level: dict[int, int] = field(default_factory=dict)
    reused_steps: int = 0
    forwards: int = 0
    drafts_evaluated: int = 0
    steps: int = 0
    steps_per_block: list[int] = field(default_factory=list)
    stage_times: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    budget: int = DEFAULT_BUDGET
    score: str = "gm"

    @property
    def nfe_reduction(self) -> float:
        """``baseline_equivalent_nfe / nfe`` (1.0 when nothing was accepted)."""
        return self.baseline_equivalent_nfe / self.nfe if self.nfe else 1.0

    @property
    def mean_accepted_per_forward(self) -> float:
        """Accepted drafts per verification forward."""
        return self.accepted_total / self.forwards if self.forwards else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (histogram keys as strings) with the derived ratios."""
        d = asdict(self)
        d["accepted_per_forward"] = {str(k): v for k, v in sorted(self.accepted_per_forward.items())}
        d["accepted_per_level"] = {str(k): v for k, v in sorted(self.accepted_per_level.items())}
        d["nfe_reduction"] = self.nfe_reduction
        d["mean_accepted_per_forward"] = self.mean_accepted_per_forward
        return d


class _Plan:
    """A graph's structure in lookup form (nodes by id, rank caps; children come from the graph's own index)."""

    def __init__(self, graph: DraftGraph | None) -> None:
        self.nodes = {} if graph is None else {int(n.id): n for n in graph.nodes}
        pairs = [p for n in self.nodes.values() for p in n.pairs]
        self.i_max = max((i for i, _ in pairs), default=1)
        self.j_max = max((j for _, j in pairs), default=1)
        self.graph = graph

    def children(self, node: int | None) -> tuple[int, ...]:
        """Child ids of ``node`` (``None`` = the root)."""
        return () if self.graph is None else self.graph.child_ids(node)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speculative_generate(
    session: DecodeSession,
    graph: Any,
    budget: int | None = None,
    *,
    score: str | None = None,
    observer: StepObserver | None = None,
    progress: Callable[[int], None] | None = None,
) -> SpeculativeStats:
    """Decode every block of ``session`` with Spiffy self-speculation; ``session.x`` holds the final state.

    Args:
        session: a prepared batch-1 :class:`~spiffy.decoding.session.DecodeSession` (any family / cache mode).
        graph: a :class:`~spiffy.selfspec.graph.DraftGraph` (anything with ``nodes`` of ``DraftNode``-like
            objects works); ``None`` = no drafts.
        budget: drafts kept per step (``None`` = the ``D*`` the graph was tuned for, else 3; ``0`` = no drafts, the
            baseline's NFE).
        score: pruning score (:data:`~spiffy.selfspec.pruning.SCORES`); ``None`` = the one the graph's calibration
            recorded, else ``"gm"`` (:func:`~spiffy.selfspec.pruning.resolve_score`).
        observer: called with a :class:`~spiffy.decoding.session.StepRecord` after every transition, exactly as
            :func:`~spiffy.decoding.session.run_baseline` does (accepted steps included).
        progress: called with the number of steps just taken.
    Returns:
        :class:`SpeculativeStats`.
    Raises:
        ConfigError: batch size > 1, ``budget < 0``, unknown score.
    """
    budget = resolve_budget(budget, graph)
    score = resolve_score(score, graph)
    if session.x.dim() != 2 or session.x.shape[0] != 1:
        raise ConfigError(
            f"speculative decoding needs a batch-1 session, got x of shape {tuple(session.x.shape)}; "
            "fix: decode the prompts one at a time (drafts use the batch dimension)"
        )
    plan = _Plan(graph)
    use_drafts = budget > 0 and bool(plan.nodes)
    stats = SpeculativeStats(budget=budget, score=score)
    times = stats.stage_times
    device = session.x.device
    P: torch.Tensor | None = None  # [1, W, V] latest distribution
    P_start = 0

    for block in range(session.num_blocks):
        logits = session.begin_block(block)
        step = 0
        while not session.block_finished(block, step, session.x):
            info = session.step_info(block, step)
            if logits is not None:  # block-start logits are already known: a plain baseline step
                t0 = time.perf_counter()
                x_next = session.transition(session.x, logits, info)
                if observer is not None:
                    observer(StepRecord(info, session.x, logits, x_next, session.transition_probs(logits)))
                session.x = x_next
                P, P_start = logits, info.window_start
                logits = None
                step += 1
                if progress is not None:
                    progress(1)
                times["walk"] += time.perf_counter() - t0
                continue

            # 1. rank, prune, instantiate
            x = session.x
            kept: list[int] = []
            draft_states: torch.Tensor | None = None
            row_of: dict[int, int] = {}
            if use_drafts and P is not None and window_covers(P_start, int(P.shape[1]), info.block_start, info.block_end):
                t0 = time.perf_counter()
                ranking = rank_state(
                    P[0], x[0], info.block_start, info.block_end, P_start, plan.i_max, plan.j_max,
                    mask_id=session.mask_id, probs=session.transition_probs(P),  # the transition's own softmax
                )
                t1 = time.perf_counter()
                kept = prune(plan.graph, ranking, budget, score)
                t2 = time.perf_counter()
                if kept:
                    draft_states, row_of = _instantiate_dedup(x, [plan.nodes[k].pairs for k in kept], kept, ranking)
                t3 = time.perf_counter()
                times["rank"] += t1 - t0
                times["prune"] += t2 - t1
                times["instantiate"] += t3 - t2

            # 2. one forward for the real state and every distinct draft
            t0 = time.perf_counter()
            batch = x if draft_states is None else torch.cat([x, draft_states], dim=0)
            session.forget_transition_probs()  # ranked already: not held during the forward
            out = session.forward_states(batch)  # [N, W, V]
            _sync(device)
            times["verify"] += time.perf_counter() - t0
            stats.forwards += 1
            stats.drafts_evaluated += int(batch.shape[0]) - 1

            # 3. walk by the baseline rule
            t0 = time.perf_counter()
            walk = _Walk(session, block, step, batch, out, row_of, plan, observer, progress)
            path, _ = follow((None, 0), walk.next_state, walk.child_matching)
            session.x = walk.x
            P, P_start = walk.last_logits, walk.last_window_start
            step = walk.step
            record_walk(stats, path, plan)
            times["walk"] += time.perf_counter() - t0
            logits = None
        close_block(session, block, step, stats)
    session.finish()
    stats.nfe = int(session.nfe)
    stats.baseline_equivalent_nfe = stats.nfe + stats.accepted_total + stats.reused_steps
    return stats


def record_walk(stats: SpeculativeStats, path: list, plan: _Plan) -> None:
    """Add one walk's accepted drafts (stall 0) and reused no-op steps to ``stats``."""
    accepted = [nid for nid, stall in path if stall == 0]
    stats.reused_steps += len(path) - len(accepted)
    stats.accepted_total += len(accepted)
    stats.accepted_per_forward[len(accepted)] = stats.accepted_per_forward.get(len(accepted), 0) + 1
    for nid in accepted:
        lvl = int(plan.nodes[nid].level)  # type: ignore[index]
        stats.accepted_per_level[lvl] = stats.accepted_per_level.get(lvl, 0) + 1


def _instantiate_dedup(
    x: torch.Tensor, formulas: list, kept: list[int], ranking: Any
) -> tuple[torch.Tensor | None, dict[int, int]]:
    """Instantiate the kept nodes; identical states share one forward row, states equal to ``x`` use row 0.

    Returns ``(distinct draft states [K', T] or None, {node id: row in [x; drafts]})``.
    """
    res = instantiate_many(x, formulas, ranking)
    if res is None:
        return None, {}
    states, index = res
    if states.shape[0] == 0:
        return None, {}
    same = (states.unsqueeze(1) == states.unsqueeze(0)).all(dim=-1)  # [K, K]
    is_x = (states == x).all(dim=-1)  # [K]
    same_l, is_x_l = same.tolist(), is_x.tolist()
    row_of_state: list[int] = []
    keep_rows: list[int] = []
    for k in range(states.shape[0]):
        if is_x_l[k]:
            row_of_state.append(0)
            continue
        dup = next((row_of_state[q] for q in range(k) if same_l[k][q] and row_of_state[q] > 0), None)
        if dup is not None:
            row_of_state.append(dup)
            continue
        keep_rows.append(k)
        row_of_state.append(len(keep_rows))
    row_of = {nid: row_of_state[idx] for nid, idx in zip(kept, index) if idx >= 0}
    if not keep_rows:
        return None, row_of
    if len(keep_rows) == states.shape[0]:
        return states, row_of
    return states[torch.tensor(keep_rows, dtype=torch.long, device=states.device)], row_of


WalkNode = tuple  # (graph node id or None for the real state, number of no-op steps taken on it)


class _Walk:
    """State of one walk through the verified drafts (callbacks for :func:`~spiffy.verify.backend.follow`).

    Walk nodes are ``(graph node id | None, k)``: ``None`` is the real state, ``k > 0`` marks the ``k``-th no-op
    step taken on the same state (its logits are reused).
    """

    def __init__(
        self,
        session: DecodeSession,
        block: int,
        step: int,
        batch: torch.Tensor,
        out: torch.Tensor,
        row_of: dict[int, int],
        plan: _Plan,
        observer: StepObserver | None,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.session = session
        self.block = block
        self.step = step
        self.batch = batch  # [N, T]: row 0 = the real state, rows 1.. = distinct draft states
        self.x = batch[0:1]
        self.x_before = self.x
        self.out = out
        self.row_of = row_of
        self.plan = plan
        self.observer = observer
        self.progress = progress
        self.last_logits = out[0:1]
        self.last_window_start = session.window_start(block)

    def _logits(self, node: int | None) -> torch.Tensor:
        row = 0 if node is None else self.row_of[node]
        return self.out[row : row + 1]

    def next_state(self, wnode: WalkNode) -> torch.Tensor:
        """Apply the baseline transition at ``wnode`` (the real state or an accepted draft)."""
        info = self.session.step_info(self.block, self.step)
        logits = self._logits(wnode[0])
        x_next = self.session.transition(self.x, logits, info)
        if self.observer is not None:
            self.observer(StepRecord(info, self.x, logits, x_next, self.session.transition_probs(logits)))
        self.x_before = self.x
        self.x = x_next
        self.last_logits = logits
        self.last_window_start = info.window_start
        self.step += 1
        if self.progress is not None:
            self.progress(1)
        return x_next

    def child_matching(self, wnode: WalkNode, state: torch.Tensor) -> WalkNode | None:
        """The kept child of ``wnode`` whose instantiated state equals ``state``; ``wnode`` itself (one more no-op)
        when ``state`` did not change; ``None`` at the end of the block or when nothing matches."""
        if self.session.block_finished(self.block, self.step, state):
            return None
        node = wnode[0]
        if torch.equal(state, self.x_before):
            return (node, wnode[1] + 1)
        kids = [c for c in self.plan.children(node) if c in self.row_of]
        if not kids:
            return None
        rows = self.batch[torch.tensor([self.row_of[c] for c in kids], dtype=torch.long, device=self.batch.device)]
        hit = (rows == state).all(dim=-1).tolist()
        for c, h in zip(kids, hit):
            if h:
                return (c, 0)
        return None


__all__ = ["speculative_generate", "SpeculativeStats", "DEFAULT_BUDGET", "STAGES"]
