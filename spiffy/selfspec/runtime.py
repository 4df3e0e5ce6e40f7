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

Batch first: :func:`speculative_generate_batch` is the implementation. It runs the one dLLM decoding loop,
:func:`spiffy.decoding.batch.decode_blocks` (synchronised block starts, one forward session making every model
call, one row session per prompt applying the baseline rule with its own generator): each iteration ranks, prunes
and instantiates every active row's drafts, packs every row's real state and drafts into **one** verification
forward, and walks each row. Every row keeps its own latest distribution and counters; a row that accepts more
drafts simply takes part in fewer forwards. :func:`speculative_generate` is the batch of one (the session is its own
forward session: the same calls, shapes and draws as the session alone).

Acceptance is exact state equality after the baseline rule, which consumes the session's generator in the
baseline's order on the same logits: the output equals the baseline's token for token, at any temperature.
The walk never crosses a block end (with a cache the baseline refreshes at block start; without one, stopping is
simply the exact and simple rule). Drafts for a block's first step are ranked from the previous distribution only
when its logits window covers the new block (never for block-causal SDAR, whose windows are single blocks).

Host synchronisations (SPEC section 14: at most two per step): a drafting step reads its ranking back once
(:func:`~spiffy.selfspec.formulas.rank_state` with ``sync_free``: the masked count and the ``[I, J]`` probability and
token tables), and pruning, instantiation and deduplication (:func:`_distinct_states`) work from that host copy; each
walk step reads its match flags once (:meth:`_DraftWalk.child_matching`). Both reads also bring the state's masked
counts (:meth:`~spiffy.decoding.session.DecodeSession.count_tensor`: per row, in the block and from where the rule
may unmask, for this block and the next; SDAR's stop flags, Fast-dLLM v2's stop hits) for a session that
``tracks_counts`` (LLaDA, Dream, SDAR, LLaDA2.0, Fast-dLLM v2): its transition (LLaDA's threshold and static
schedule, Dream's counts, SDAR's strategies, Fast-dLLM v2's per-row draws at T > 0) and its block-end check then read
nothing themselves. A state no read covered yet (the first block's start, the state after a cache
mode's block-start step) is ranked early (:meth:`_SpiffyRow.done`), so that its ranking's read brings them, or read
once. Measured on the tiny LLaDA, Dream, SDAR and Fast-dLLM v2 models, static path: 0.9 to 1.9 reads per step at
D* = 1, 5, 12 (tests/test_spiffy_syncs.py; Dream's ``origin`` algorithm included, 1.4 to 1.9; Fast-dLLM v2 1.5 to
1.6, with a stop id too). Still reading in the rule: Dream's
``origin`` algorithm at T > 0 (it draws one token per revealed row, and how many are revealed is random). An eager CPU step whose transition published no softmax keeps the host ranking (a few more reads,
less work on a CPU).

Not implemented (on purpose): the paper's approximate "simplified shared-context mask"; every path here is exact.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from spiffy.decoding.batch import DecodeRow, decode_blocks, forward_rows, make_rows
from spiffy.decoding.session import DecodeSession, StepObserver
from spiffy.errors import ConfigError
from spiffy.selfspec.config import SpiffyConfig
from spiffy.selfspec.graph import DraftGraph
from spiffy.selfspec.formulas import instantiate_many, rank_state, window_covers
from spiffy.selfspec.pruning import DEFAULT_BUDGET, prune
from spiffy.torch_utils import device_tensor
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
    """Spiffy's settings in lookup form: the graph's nodes by id and rank caps (children come from the graph's own
    index), the budget and score, and whether any draft is kept per step."""

    def __init__(self, settings: SpiffyConfig) -> None:
        graph: DraftGraph | None = settings.graph
        self.nodes = {} if graph is None else {int(n.id): n for n in graph.nodes}
        pairs = [p for n in self.nodes.values() for p in n.pairs]
        self.i_max = max((i for i, _ in pairs), default=1)
        self.j_max = max((j for _, j in pairs), default=1)
        self.graph = graph
        self.budget, self.score = int(settings.budget), str(settings.score)  # type: ignore[arg-type]
        self.use_drafts = self.budget > 0 and bool(self.nodes)

    def children(self, node: int | None) -> tuple[int, ...]:
        """Child ids of ``node`` (``None`` = the root)."""
        return () if self.graph is None else self.graph.child_ids(node)


class _SpiffyRow(DecodeRow):
    """A row of the decoding loop with Spiffy's state: its latest distribution ``P`` (the logits that produced its
    current state) and the window row where ``P`` starts."""

    def __init__(self, *args: Any, plan: _Plan, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan = plan
        self.P: torch.Tensor | None = None  # [1, W, V]
        self.P_start = 0
        self._ranked: tuple[torch.Tensor, torch.Tensor, Any] | None = None  # (x, P, its Ranking)

    def done(self, forward_block: int) -> bool:
        """As the base; when that needs the state's masked counts and no read left them on the host, the next
        step's ranking is made now: its one read brings them (the block-start step of a cache mode is followed by
        no walk read)."""
        sess = self.session
        blk = self.block(forward_block)
        if blk >= 0 and sess.tracks_counts and sess.block_end_by_rule(blk, self.step) is None \
                and not sess.counts_known(blk, sess.x):
            self._ranking(forward_block)
        return super().done(forward_block)

    def _ranking(self, forward_block: int) -> Any:
        """The ranking of the current state under ``P`` (made once per ``(x, P)``: :meth:`done` may have made it),
        or ``None`` when this step drafts nothing. Its one read also brings the session's
        :meth:`~spiffy.decoding.session.DecodeSession.count_tensor` of the state to the host."""
        sess, plan, P, x = self.session, self.plan, self.P, self.session.x
        if self._ranked is not None and self._ranked[0] is x and self._ranked[1] is P:
            return self._ranked[2]
        blk = self.block(forward_block)
        info = sess.step_info(blk, self.step)
        if not plan.use_drafts or P is None or not window_covers(self.P_start, int(P.shape[1]), info.block_start,
                                                                  info.block_end):
            return None
        t0 = time.perf_counter()
        probs = sess.transition_probs(P)  # the transition's own softmax
        # one host read for the whole ranking (and the tables pruning and deduplication read) on a device or the
        # static path; an eager CPU run without published probabilities keeps the host ranking, whose softmax covers
        # only the masked rows (the static one takes every row of the block: up to twice the work there)
        sync_free = sess.static is not None or P.device.type != "cpu" or (probs is not None and probs.probs is not None)
        extra = sess.count_tensor(blk, x) if sess.tracks_counts else None
        ranking = rank_state(P[0], x[0], info.block_start, info.block_end, self.P_start, plan.i_max, plan.j_max,
                             mask_id=sess.mask_id, probs=probs, sync_free=sync_free, extra=extra)
        if extra is not None:
            sess.remember_counts(blk, x, ranking.extra)
        self._ranked = (x, P, ranking)
        self.stats.stage_times["rank"] += time.perf_counter() - t0
        return ranking

    def after_step(self, logits: torch.Tensor, window_start: int) -> None:
        self.P, self.P_start = logits, window_start

    def first_step(self, forward_block: int, logits: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.apply(forward_block, logits)
        self.stats.stage_times["walk"] += time.perf_counter() - t0

    def candidates(self, forward_block: int, plan: _Plan) -> tuple[torch.Tensor, dict[int, int]]:
        """Rank, prune and instantiate this step's drafts: ``([x; distinct drafts] [N, T], {node id: row})``."""
        x = self.session.x
        ranking = self._ranking(forward_block)
        self._ranked = None  # the forward and the walk follow: P and x change
        if ranking is None:
            return x, {}
        times = self.stats.stage_times
        t1 = time.perf_counter()
        kept = prune(plan.graph, ranking, plan.budget, plan.score)
        t2 = time.perf_counter()
        drafts, row_of = (_distinct_states(x, [plan.nodes[k].pairs for k in kept], kept, ranking, self.session.mask_id)
                          if kept else (None, {}))
        times["prune"] += t2 - t1
        times["instantiate"] += time.perf_counter() - t2
        return (x if drafts is None else torch.cat([x, drafts], dim=0)), row_of


def speculative_generate_batch(
    forward_session: DecodeSession,
    row_sessions: Sequence[DecodeSession],
    graph: Any,
    budget: int | None = None,
    *,
    score: str | None = None,
    observer: StepObserver | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[SpeculativeStats], int]:
    """Decode every row with Spiffy self-speculation; ``row_sessions[r].x`` holds row ``r``'s final state.

    Args:
        forward_session: a prepared batch-``B`` session over the left-padded prompts (it makes every model call;
            its own rule and generator are never used unless it is its own only row session).
        row_sessions: ``B`` prepared batch-1 sessions, row ``r`` = prompt ``r`` unpadded with its own generator; or
            ``[forward_session]`` for a batch-1 session decoded alone.
        graph: the calibrated draft graph (``None`` = no drafts), or a :class:`~spiffy.selfspec.config.SpiffyConfig`.
        budget: drafts kept per row and step (``None`` = the graph's tuned ``D*``, else 3; ``0`` = none).
        score: pruning score; ``None`` = the graph's recorded one, else ``"gm"``.
        observer: called with a :class:`~spiffy.decoding.session.StepRecord` after every transition, exactly as
            :func:`~spiffy.decoding.batch.run_baseline` does (accepted steps included); one row session only.
        progress: called with ``1`` after every step of a row.
    Returns:
        ``(per-row SpeculativeStats, model calls made for the whole batch)``. A row's ``nfe`` counts the forwards
        that served it, which is what the same prompt decoded alone makes.
    Raises:
        ConfigError: mismatched layouts, ``budget < 0``, unknown score, an observer with several rows.
    """
    plan = _Plan(SpiffyConfig.of(graph, budget, score))
    fwd = forward_session
    rows = make_rows(fwd, row_sessions, lambda: SpeculativeStats(budget=plan.budget, score=plan.score),
                     observer, progress, row_class=_SpiffyRow, plan=plan)

    def verify(block: int, active: list[DecodeRow]) -> None:
        """One verification forward for every active row's real state and drafts, then each row's walk."""
        requests = [(row, *row.candidates(block, plan)) for row in active]  # type: ignore[attr-defined]
        for row in active:  # ranked already: not held during the forward
            row.session.forget_transition_probs()
        t0 = time.perf_counter()
        outs = forward_rows(fwd, [(row, states) for row, states, _ in requests])
        if fwd.x.device.type == "cuda":
            torch.cuda.synchronize(fwd.x.device)
        verify_time = (time.perf_counter() - t0) / len(active)
        for (row, states, row_of), out in zip(requests, outs):
            stats = row.stats
            stats.stage_times["verify"] += verify_time
            stats.forwards += 1
            stats.drafts_evaluated += int(states.shape[0]) - 1
            stats.nfe += 1
            t1 = time.perf_counter()
            walk = _DraftWalk(row, block, states, out, row_of, plan)
            path, _ = follow((None, 0), walk.next_state, walk.child_matching)
            record_walk(stats, path, plan)
            stats.stage_times["walk"] += time.perf_counter() - t1

    nfe = decode_blocks(fwd, rows, verify)
    for row in rows:
        row.stats.baseline_equivalent_nfe = row.stats.nfe + row.stats.accepted_total + row.stats.reused_steps
    return [row.stats for row in rows], nfe


def speculative_generate(
    session: DecodeSession,
    graph: Any,
    budget: int | None = None,
    *,
    score: str | None = None,
    observer: StepObserver | None = None,
    progress: Callable[[int], None] | None = None,
) -> SpeculativeStats:
    """Decode every block of a batch-1 ``session`` with Spiffy self-speculation: the batch of one of
    :func:`speculative_generate_batch` (same arguments); ``session.x`` holds the final state.

    Raises:
        ConfigError: a batch-``B > 1`` session (drafts use the batch dimension), ``budget < 0``, unknown score.
    """
    if session.x.dim() != 2 or session.x.shape[0] != 1:
        raise ConfigError(
            f"speculative decoding needs a batch-1 session, got x of shape {tuple(session.x.shape)}; fix: decode a "
            "batch with spiffy.generate (one row session per prompt) or the prompts one at a time"
        )
    stats, _ = speculative_generate_batch(session, [session], graph, budget, score=score, observer=observer,
                                          progress=progress)
    return stats[0]


def record_walk(stats: SpeculativeStats, path: list, plan: _Plan) -> None:
    """Add one walk's accepted drafts (stall 0) and reused no-op steps to ``stats``."""
    accepted = [nid for nid, stall in path if stall == 0]
    stats.reused_steps += len(path) - len(accepted)
    stats.accepted_total += len(accepted)
    stats.accepted_per_forward[len(accepted)] = stats.accepted_per_forward.get(len(accepted), 0) + 1
    for nid in accepted:
        lvl = int(plan.nodes[nid].level)  # type: ignore[index]
        stats.accepted_per_level[lvl] = stats.accepted_per_level.get(lvl, 0) + 1


def _distinct_states(
    x: torch.Tensor, formulas: list, kept: list[int], ranking: Any, mask_id: int
) -> tuple[torch.Tensor | None, dict[int, int]]:
    """Instantiate the kept nodes; identical states share one forward row, states equal to ``x`` use row 0.

    Which states are identical is decided on the host, from the ranking's token table (read with its probabilities
    in the ranking's one synchronisation): a formula writes token ``c_ij`` at the masked row of rank ``i``, so its
    state differs from ``x [1, T]`` exactly at its ``(i, c_ij)`` writes with ``c_ij != mask_id``; distinct ranks
    ``i`` are distinct rows and one row's token ranks are distinct tokens, so that set of writes *is* the state.

    Returns ``(distinct draft states [K', T] or None, {node id: row in [x; drafts]})``.
    """
    res = instantiate_many(x, formulas, ranking)
    if res is None:
        return None, {}
    states, index = res
    if states.shape[0] == 0:
        return None, {}
    tokens = ranking.ids_list()  # [I][J] host ints
    writes: list[frozenset] = [frozenset()] * int(states.shape[0])
    for pairs, k in zip(formulas, index):
        if k >= 0:
            final = {i: tokens[i - 1][j - 1] for i, j in pairs}  # a repeated rank: the last write stays, as scattered
            writes[k] = frozenset((i, t) for i, t in final.items() if t != mask_id)
    row_of_write: dict[frozenset, int] = {frozenset(): 0}  # no write: x itself
    row_of_state: list[int] = []
    keep_rows: list[int] = []
    for k, key in enumerate(writes):
        if key not in row_of_write:
            keep_rows.append(k)
            row_of_write[key] = len(keep_rows)
        row_of_state.append(row_of_write[key])
    row_of = {nid: row_of_state[idx] for nid, idx in zip(kept, index) if idx >= 0}
    if not keep_rows:
        return None, row_of
    if len(keep_rows) == states.shape[0]:
        return states, row_of
    return states[device_tensor(keep_rows, torch.long, states.device)], row_of


WalkNode = tuple  # (graph node id or None for the real state, number of no-op steps taken on it)


class _DraftWalk:
    """One row's walk through its verified drafts (callbacks for :func:`~spiffy.verify.backend.follow`).

    Walk nodes are ``(graph node id | None, k)``: ``None`` is the real state, ``k > 0`` marks the ``k``-th no-op
    step taken on the same state (its logits are reused).
    """

    def __init__(self, row: DecodeRow, block: int, states: torch.Tensor, out: torch.Tensor, row_of: dict[int, int],
                 plan: _Plan) -> None:
        self.row = row
        self.block = block  # the forward session's block
        self.states = states  # [N, T]: row 0 = the real state, rows 1.. = distinct draft states
        self.out = out  # [N, W, V]
        self.row_of = row_of
        self.plan = plan
        self.x_before = row.session.x

    def next_state(self, wnode: WalkNode) -> torch.Tensor:
        """Apply the baseline transition at ``wnode`` (the real state or an accepted draft)."""
        node = wnode[0]
        r = 0 if node is None else self.row_of[node]
        self.x_before = self.row.session.x
        return self.row.apply(self.block, self.out[r : r + 1])

    def child_matching(self, wnode: WalkNode, state: torch.Tensor) -> WalkNode | None:
        """The kept child of ``wnode`` whose instantiated state equals ``state``; ``wnode`` itself (one more no-op)
        when ``state`` did not change; ``None`` at the end of the block or when nothing matches."""
        row = self.row
        sess, blk = row.session, row.block(self.block)
        ends = sess.block_end_by_rule(blk, row.step) if sess.tracks_counts else None
        if ends and not sess.reads_block_end(blk):
            return None
        if not sess.tracks_counts and sess.block_finished(blk, row.step, state):
            return None
        node = wnode[0]
        kids = [c for c in self.plan.children(node) if c in self.row_of]
        # one comparison, one host read: [state unchanged, state == kid 1, ...], then (a session tracking its
        # counts) the state's masked counts: whether the block ended, and what the next transition reads
        candidates = self.x_before.reshape(1, -1)
        if kids:
            index = device_tensor([self.row_of[c] for c in kids], torch.long, self.states.device)
            candidates = torch.cat([candidates, self.states.index_select(0, index)], dim=0)
        hit = (candidates == state.reshape(1, -1)).all(dim=-1).to(torch.long)
        if not sess.tracks_counts:
            return self._match(wnode, kids, hit.tolist())
        read = torch.cat([hit, sess.count_tensor(blk, state)]).tolist()
        sess.remember_counts(blk, state, read[len(kids) + 1 :])
        if ends or sess.block_finished(blk, row.step, state):  # no read: the counts are on the host now
            return None
        return self._match(wnode, kids, read[: len(kids) + 1])

    @staticmethod
    def _match(wnode: WalkNode, kids: list[int], hit: list) -> WalkNode | None:
        """The walk node ``hit`` (``[state unchanged, state == kid 1, ...]`` on the host) selects."""
        node = wnode[0]
        if hit[0]:
            return (node, wnode[1] + 1)
        for c, h in zip(kids, hit[1:]):
            if h:
                return (c, 0)
        return None


__all__ = ["DEFAULT_BUDGET", "STAGES", "SpeculativeStats", "record_walk", "speculative_generate",
           "speculative_generate_batch"]
