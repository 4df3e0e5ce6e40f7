"""Near-tie proofs for a batched row that differs from its prompt decoded alone (half precision).

In float32/float64 row ``r`` of a batch equals prompt ``r`` decoded alone, token for token. In bfloat16/float16 the
batched forward computes a row with another reduction shape (left padding, more rows, a tree of other rows), so its
logits differ from the lone forward's by a few units in the last place (ulps), and a choice between two almost
equal alternatives may flip. Such a flip is numerics, not logic, exactly when the rule below holds.

**The rule** (one for every decision kind). Run the row alone and in the batch, recording every decision step
(dLLM: each baseline transition; AR: each verification round), and take the first step whose result differs:

1. both runs were in the same state there (dLLM: the same ``x`` and the same generator state; AR: the same root
   position after the same committed tokens);
2. the step is a function of its logits alone: the row's own rule, replayed on the *batched* run's logits (same
   state, same generator state / position-keyed noise), reproduces the batched result;
3. those logits agree with the lone run's within :data:`DEVIATION_ULPS` ulps of each row's largest magnitude in the
   model dtype (dLLM: the window logits; AR: the target's logits at every verified node and the drafter's logits);
4. the choice that flipped is within that rounding, by its kind:

   * ``greedy`` (an argmax): the lone logits of the two tokens differ by at most :func:`rounding_bound` (4 ulps);
   * ``low-confidence`` (which positions a step unmasks, dLLM at ``T = 0``): the two positions' confidences (or a
     confidence and the threshold) differ by at most ``2 (exp(2 d) - 1) (exp(2 d) + c)``, ``d`` the logits'
     rounding bound and ``c`` the larger confidence: when every logit moves by at most ``d``, a softmax probability,
     a margin of two probabilities and an entropy each move by at most ``(exp(2 d) - 1) (exp(2 d) + c)``;
   * ``sampled`` (a draw, whose coins both runs share): position-keyed Gumbel noise (AR, coupled rule): the
     perturbed scores of the two tokens differ by at most the tempered logits' rounding bound; an inverse-CDF draw
     or acceptance test (AR, rejection rule): the coin lies within ``(exp(4 d) - 1)`` times the threshold, or
     ``2 (exp(4 d) - 1) min(C, 1 - C)`` of the CDF value ``C``, from the boundary between the two tokens (how far
     ``d`` on every tempered logit can move a probability ratio or a CDF value); a dLLM draw (Gumbel or
     multinomial noise inside the family's rule): the draw flips within a logit change no larger than the rounding
     bound (bisection along the straight path from the lone to the batched logits, with the same coins);
   * ``draft`` (AR: the drafts differ): point 3 on the drafter's logits and the tree rebuilt from the batched
     drafter logits equal to the batched tree.

A step violating any point is reported ``near_tie = False`` (a bug). The proofs re-run the two decodes (twice: once
to find the step, once to record it), so they cost about four decodes per differing row; benchmarks run them only
for rows that differ.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.config import ARSpecConfig
from spiffy.arspec.generate import make_rule, speculative_generate
from spiffy.arspec.rejection import RejectionRule, sample_from
from spiffy.arspec.rules import Acceptance, TargetLogits
from spiffy.arspec.sampling import gumbel_noise, keyed_seed, tempered
from spiffy.arspec.stages import build_tree
from spiffy.arspec.tree import DraftTree
from spiffy.bench.fidelity import NEAR_TIE_ULPS, rounding_bound, spacing
from spiffy.decoding.batch import make_row_sessions, row_generators, run_baseline_batch
from spiffy.decoding.factory import make_session
from spiffy.decoding.session import run_baseline
from spiffy.sampling import filter_logits
from spiffy.selfspec.batch import speculative_generate_batch as spiffy_batch
from spiffy.selfspec.runtime import speculative_generate as spiffy_single

#: point 3 of the rule: the largest logit difference of the two runs, in ulps of the row's largest logit (measured on
#: tiny LLaDA / Dream / SDAR / Qwen3 + DFlash pairs in bfloat16 and float16: at most 6 over every verified row and
#: vocabulary entry; a logic error moves logits by far more)
DEVIATION_ULPS = 16.0

BATCH_NEAR_TIE_RULE = (
    "a batched row's first differing step is a near tie when both runs were in the same state, the row's rule "
    "replayed on the batched logits reproduces the batched result, the logits agree within "
    f"{DEVIATION_ULPS:g} ulps of each row's largest magnitude, and the flipped choice (greedy top-2 gap within "
    f"{NEAR_TIE_ULPS:g} ulps, two "
    "confidences, or a sampled draw's perturbed scores / coin) lies within that rounding (spiffy.bench.batch_fidelity)"
)


@dataclass
class BatchDivergence:
    """The first step where a batched row leaves its prompt decoded alone, and the verdict of the rule.

    Attributes:
        row: the row in its batch. step: dLLM transition / AR round index of the first differing step.
        position: generated-token index of the first differing token of that step.
        kind: ``greedy``, ``low-confidence``, ``sampled`` or ``draft`` (see the module docstring).
        gap, bound: the flipped choice's gap and its rounding bound (``None`` where the kind has none: a draw
            whose coin the rule does not expose is proved by the replay and the logit agreement).
        deviation_ulps: largest logit difference of the two runs at the step, in ulps of the row's largest logit.
        same_state, replay: points 1 and 2 of the rule. near_tie: every point holds. dtype: the model dtype.
    """

    row: int
    step: int
    position: int | None
    kind: str
    gap: float | None
    bound: float | None
    deviation_ulps: float | None
    same_state: bool
    replay: bool
    near_tie: bool
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def deviation_ulps(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    """``max |a - b|`` over ``[..., V]`` rows, each in ulps (``dtype``) of that row's largest ``|a|``."""
    a64, b64 = a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1])
    worst = 0.0
    for ra, rb in zip(a64, b64):
        diff = float((ra - rb).abs().max())
        worst = max(worst, diff / spacing(float(ra.abs().max()), dtype))
    return worst


def confidence_bound(values: Sequence[float], logit_scale: float, dtype: torch.dtype) -> float:
    """The largest gap between two confidences among ``values`` that rounding can flip: each moves by at most
    ``(exp(2 d) - 1) (exp(2 d) + max |values|)`` (a probability, a margin or an entropy; ``d`` the rounding bound of
    logits of magnitude ``logit_scale``), so twice that."""
    grow = math.exp(2.0 * rounding_bound(logit_scale, 0.0, dtype))
    return 2.0 * (grow - 1.0) * (grow + max(abs(float(v)) for v in values))


# --------------------------------------------------------------------------------------------------- dLLM
class _Enough(Exception):
    """Ends a recording run once the step of interest was recorded."""


@dataclass
class _Step:
    """One recorded transition (``[1, T]`` states, ``[1, W, V]`` logits on the CPU)."""

    info: Any
    x_before: torch.Tensor
    logits: torch.Tensor
    x_after: torch.Tensor
    generator_state: torch.Tensor | None
    selection: torch.Tensor | None
    selection_start: int
    replayed: torch.Tensor | None = None
    flip: float | None = None  # see _TransitionRecorder._flip_fraction


class _TransitionRecorder:
    """Wraps ``session.transition``: records every result, and the full step at index ``keep`` (then, with
    ``replay_logits``, also the rule replayed on those logits from the same generator state) and stops the run."""

    def __init__(self, session: Any, keep: int | None = None, replay_logits: torch.Tensor | None = None) -> None:
        self.session, self.keep, self.replay_logits = session, keep, replay_logits
        self.results: list[torch.Tensor] = []
        self.step: _Step | None = None
        self._inner = session.transition
        session.transition = self._transition

    def _transition(self, x: torch.Tensor, logits: torch.Tensor, info: Any) -> torch.Tensor:
        gen = self.session.generator
        pre = gen.get_state() if gen is not None else None
        replayed, flip = None, None
        if len(self.results) == self.keep and self.replay_logits is not None:
            other = self.replay_logits.to(logits.device, logits.dtype)
            replayed = self._inner(x, other, info).cpu()
            flip = self._flip_fraction(x, logits, other, info, pre)
            if gen is not None:
                gen.set_state(pre)
        out = self._inner(x, logits, info)
        self.results.append(out.cpu())
        if len(self.results) - 1 == self.keep:
            pub = self.session.transition_probs(logits)
            sel = None if pub is None or pub.selection is None else pub.selection.detach().double().cpu()
            self.step = _Step(info, x.cpu(), logits.detach().cpu(), out.cpu(), pre,
                              sel, 0 if pub is None else int(pub.selection_start), replayed, flip)
            raise _Enough
        return out

    def _flip_fraction(self, x: torch.Tensor, mine: torch.Tensor, other: torch.Tensor, info: Any,
                       pre: torch.Tensor | None, iterations: int = 12) -> float | None:
        """The smallest ``t`` (bisection) at which the rule on ``mine + t (other - mine)``, from the same generator
        state, leaves the result on ``mine``: how far along the rounding difference a draw flips."""
        gen = self.session.generator

        def run(t: float) -> torch.Tensor:
            if gen is not None:
                gen.set_state(pre)
            mixed = (mine.double() + t * (other.double() - mine.double())).to(mine.dtype)
            return self._inner(x, mixed, info)

        base = run(0.0)
        if torch.equal(run(1.0), base):
            return None
        lo, hi = 0.0, 1.0
        for _ in range(iterations):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if not torch.equal(run(mid), base) else (mid, hi)
        return hi


def _left_pad(batch: Sequence[Sequence[int]], device: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    width = max(len(p) for p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(batch):
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long, device=device)
        mask[r, width - len(p):] = 1
    return ids, None if bool(mask.all()) else mask


def _dllm_run(model: Any, batch: Sequence[Sequence[int]], row: int, config: Any, alone: bool, graph: Any,
              budget: int | None, score: str | None, tokenizer: Any, overrides: dict[str, Any],
              keep: int | None = None, replay_logits: torch.Tensor | None = None) -> _TransitionRecorder:
    """Decode prompt ``row`` alone or the whole batch (as :func:`spiffy.api.generate` does, every row seeded from
    the config) and record row ``row``'s transitions."""
    device = next(model.parameters()).device
    ids, mask = _left_pad(batch, device)
    fwd = make_session(model, ids, config, attention_mask=mask, tokenizer=tokenizer, **overrides)
    cfg = fwd.config  # type: ignore[attr-defined]
    if alone:
        session = make_session(model, ids[row : row + 1, ids.shape[1] - len(batch[row]):], cfg, tokenizer=tokenizer)
        rec = _TransitionRecorder(session, keep, replay_logits)
        try:
            run_baseline(session) if graph is None else spiffy_single(session, graph, budget, score=score)
        except _Enough:
            pass
        return rec
    rows = make_row_sessions(model, ids, mask, cfg, row_generators(len(batch), device), tokenizer=tokenizer)
    rec = _TransitionRecorder(rows[row], keep, replay_logits)
    try:
        run_baseline_batch(fwd, rows) if graph is None else spiffy_batch(fwd, rows, graph, budget, score=score)
    except _Enough:
        pass
    return rec


def judge_dllm_step(alone: _Step, batched: _Step, *, row: int, step: int, prompt_len: int, dtype: torch.dtype,
                    temperature: float, threshold: float | None) -> BatchDivergence:
    """The rule (module docstring) on the first differing transition of the two runs."""
    same = torch.equal(alone.x_before, batched.x_before) and (
        (alone.generator_state is None and batched.generator_state is None)
        or (alone.generator_state is not None and batched.generator_state is not None
            and torch.equal(alone.generator_state, batched.generator_state)))
    replay = alone.replayed is not None and torch.equal(alone.replayed, batched.x_after)
    dev = deviation_ulps(alone.logits, batched.logits, dtype) if alone.logits.shape == batched.logits.shape else math.inf
    x0 = alone.x_before[0]
    changed_a, changed_b = alone.x_after[0] != x0, batched.x_after[0] != x0
    ws = int(alone.info.window_start)
    la = alone.logits[0].double()
    gap = bound = None
    differs = (alone.x_after[0] != batched.x_after[0]).nonzero()
    col = int(differs[0, 0]) if differs.numel() else None
    if torch.equal(changed_a, changed_b):  # the same positions took different tokens
        kind = "greedy" if temperature == 0 else "sampled"
        if kind == "greedy" and col is not None:
            ta, tb = int(alone.x_after[0, col]), int(batched.x_after[0, col])
            a, b = float(la[col - ws, ta]), float(la[col - ws, tb])
            gap, bound = abs(a - b), rounding_bound(a, b, dtype)
        elif col is not None and alone.flip is not None:
            # a draw: the logit change (along the straight path to the batched logits, same coins) that moves it
            row_a, row_b = la[col - ws], batched.logits[0, col - ws].double()
            gap = alone.flip * float((row_b - row_a).abs().max())
            bound = rounding_bound(float(row_a.abs().max()), 0.0, dtype)
    else:
        kind = "low-confidence"
        only_a = (changed_a & ~changed_b).nonzero()
        only_b = (changed_b & ~changed_a).nonzero()
        cols = [int(t[0, 0]) for t in (only_a, only_b) if t.numel()]
        col = min(cols)
        if alone.selection is not None:
            conf = [float(alone.selection[0, c - alone.selection_start]) for c in cols]
            if len(conf) == 1 and threshold is not None:
                conf.append(float(threshold))  # one position crossed the threshold in one run only
            if len(conf) == 2:
                scale = max(float(la[c - ws].abs().max()) for c in cols)
                gap, bound = abs(conf[0] - conf[1]), confidence_bound(conf, scale, dtype)
    if gap is None and alone.flip is not None and alone.logits.shape == batched.logits.shape:
        # no closed form (a choice among sampled proposals): the logit change that flips it, as for a draw
        gap = alone.flip * float((batched.logits.double() - la[None]).abs().max())
        bound = rounding_bound(float(la.abs().max()), 0.0, dtype)
    near = same and replay and dev <= DEVIATION_ULPS and (gap is None or gap <= bound)  # type: ignore[operator]
    return BatchDivergence(row=row, step=step, position=None if col is None else col - prompt_len, kind=kind,
                           gap=gap, bound=bound, deviation_ulps=dev, same_state=same, replay=replay,
                           near_tie=bool(near), dtype=str(dtype).replace("torch.", ""))


def _first_difference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b)):
        if not torch.equal(x, y):
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def explain_dllm_batch_row(model: Any, batch: Sequence[Sequence[int]], row: int, config: Any = None, *,
                           graph: Any = None, budget: int | None = None, score: str | None = None,
                           tokenizer: Any = None, overrides: dict[str, Any] | None = None) -> BatchDivergence | None:
    """Prove (or refute) that row ``row`` of the dLLM ``batch`` (token-id lists, left padded as
    :func:`spiffy.api.generate` pads them; every row seeded from the config) leaves the prompt decoded alone only
    at a near tie. ``graph``: batched Spiffy against Spiffy alone. ``None`` when the two runs agree."""
    extra = dict(overrides or {})
    args = (model, batch, row, config)
    runs = [_dllm_run(*args, alone, graph, budget, score, tokenizer, extra) for alone in (True, False)]
    k = _first_difference(runs[0].results, runs[1].results)
    if k is None:
        return None
    batched = _dllm_run(*args, False, graph, budget, score, tokenizer, extra, keep=k).step
    alone = _dllm_run(*args, True, graph, budget, score, tokenizer, extra, keep=k,
                      replay_logits=None if batched is None else batched.logits).step
    session = runs[0].session
    dtype = next(model.parameters()).dtype
    if alone is None or batched is None:  # one run took a step the other never took
        return BatchDivergence(row, k, None, "schedule", None, None, None, False, False, False,
                               str(dtype).replace("torch.", ""))
    cfg = session.config
    return judge_dllm_step(alone, batched, row=row, step=k, prompt_len=int(session.prompt_len), dtype=dtype,
                           temperature=float(cfg.sampling.temperature), threshold=_threshold(session))


def _threshold(session: Any) -> float | None:
    """The confidence threshold a dynamic rule unmasks above (``None`` for static schedules)."""
    cfg = session.config
    if cfg.tokens_per_step != "dynamic":
        return None
    value = getattr(session, "threshold", None)
    return float(value) if value is not None else (None if cfg.threshold is None else float(cfg.threshold))


# ----------------------------------------------------------------------------------------------------- AR
@dataclass
class _Round:
    position: int
    tree: DraftTree
    target_logits: torch.Tensor  # [1 + N, V]: root, then node i
    draft_logits: torch.Tensor | None
    outcome: Acceptance


class _RecordedLogits(TargetLogits):
    """Target logits of a recorded round (``[1 + N, V]``), served like :class:`TargetLogits`."""

    def __init__(self, rows: torch.Tensor) -> None:  # noqa: D107 - no head: the rows are known
        self.rows = rows
        self._cache = {}

    def logits(self, node: int) -> torch.Tensor:
        r = 0 if node < 0 else node + 1
        return self.rows[r : r + 1]


class RecordingRule:
    """An acceptance rule that records each round's outcome, and round ``keep`` in full (tree, every node's
    target logits, the drafter's logits)."""

    def __init__(self, inner: Any, keep: int | None = None) -> None:
        self.inner, self.keep = inner, keep
        self.outcomes: list[tuple[int, list[int]]] = []
        self.round: _Round | None = None

    def accept(self, tree: DraftTree, target: TargetLogits, draft_logits: torch.Tensor | None,
               root_position: int) -> Acceptance:
        out = self.inner.accept(tree, target, draft_logits, root_position)
        tokens = tree.tokens.tolist()
        self.outcomes.append((int(root_position), [tokens[n] for n in out.accepted] + [int(out.bonus)]))
        if len(self.outcomes) - 1 == self.keep:
            rows = torch.cat([target.logits(n) for n in range(-1, tree.num_nodes)]).detach().cpu()
            drafts = None if draft_logits is None else draft_logits.detach().cpu()
            self.round = _Round(int(root_position), tree, rows, drafts, out)
        return out


def _same_tree(a: DraftTree, b: DraftTree) -> bool:
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and a.samples == b.samples


def _ar_runs(target: Any, make_drafter: Callable[[], Any] | None, batch: Sequence[Sequence[int]], row: int,
             config: ARSpecConfig, keep: int | None) -> tuple[RecordingRule, RecordingRule, list[list[int]]]:
    """Prompt ``row`` alone and the whole batch, each with recording rules; also both runs' tokens of the row."""
    alone = RecordingRule(make_rule(config), keep)
    drafter = make_drafter() if make_drafter is not None else None
    lone = speculative_generate(target, drafter, list(batch[row]), config, rule=alone)
    rules = [RecordingRule(make_rule(config), keep if r == row else None) for r in range(len(batch))]
    drafters = None if make_drafter is None else [make_drafter() for _ in batch]
    out = speculative_generate_batch(target, drafters, [list(p) for p in batch], config, rules=rules)
    return alone, rules[row], [list(lone.tokens), list(out[row].tokens)]


def judge_ar_prefill(target: Any, prompt: Sequence[int], tokens: tuple[int, int], config: ARSpecConfig, *,
                     row: int) -> BatchDivergence:
    """The first generated token (drawn from the prefill's last row) differs: the lone prefill's logits of the two
    tokens, raw (greedy) or noise-perturbed (position-keyed draw of either rule), must lie within rounding. The
    state is the prompt itself and the draw has no other input, so points 1 and 2 of the rule hold by construction."""
    param = next(target.parameters())
    with torch.no_grad():
        logits = target(torch.tensor([list(prompt)], device=param.device)).logits[0, -1].cpu()
    gap, bound = _token_gap(logits, tokens[0], tokens[1], config, len(prompt), param.dtype)
    kind = "greedy" if float(config.sampling.temperature) == 0 else "sampled"
    return BatchDivergence(row=row, step=-1, position=0, kind=kind, gap=gap, bound=bound, deviation_ulps=None,
                           same_state=True, replay=True, near_tie=bool(gap <= bound),
                           dtype=str(param.dtype).replace("torch.", ""))


def judge_ar_round(alone: _Round, batched: _Round, config: ARSpecConfig, *, row: int, step: int,
                   generated_before: int, dtype: torch.dtype) -> BatchDivergence:
    """The rule (module docstring) on the first differing verification round of the two runs."""
    same = alone.position == batched.position
    replay_out = make_rule(config).accept(batched.tree, _RecordedLogits(batched.target_logits), batched.draft_logits,
                                          batched.position)
    replay = replay_out == batched.outcome
    devs = []
    if alone.draft_logits is not None and batched.draft_logits is not None:
        devs.append(deviation_ulps(alone.draft_logits, batched.draft_logits, dtype)
                    if alone.draft_logits.shape == batched.draft_logits.shape else math.inf)
    nodes_equal = _same_tree(alone.tree, batched.tree)
    rows = alone.target_logits.shape[0] if nodes_equal else 1  # other trees: only the root row is common
    devs.append(deviation_ulps(alone.target_logits[:rows], batched.target_logits[:rows], dtype))
    dev = max(devs)
    ta_all = [alone.tree.tokens[n].item() for n in alone.outcome.accepted] + [alone.outcome.bonus]
    tb_all = [batched.tree.tokens[n].item() for n in batched.outcome.accepted] + [batched.outcome.bonus]
    i = next((j for j, (x, y) in enumerate(zip(ta_all, tb_all)) if x != y), min(len(ta_all), len(tb_all)))
    gap = bound = None
    temperature = float(config.sampling.temperature)
    if not nodes_equal:
        kind = "draft"
        replay = replay and _same_tree(build_tree(config, batched.draft_logits, batched.position), batched.tree)
    else:
        kind = "greedy" if temperature == 0 else "sampled"
        node = -1 if i == 0 else alone.outcome.accepted[i - 1]
        if temperature > 0 and config.accept == "rejection":
            gap, bound = _rejection_margin(alone, batched, config, dtype)
        elif i < len(ta_all) and i < len(tb_all):
            pos = alone.position + (0 if node < 0 else int(alone.tree.depths[node])) + 1
            gap, bound = _token_gap(alone.target_logits[node + 1], int(ta_all[i]), int(tb_all[i]), config, pos,
                                    dtype)
    near = same and replay and dev <= DEVIATION_ULPS and (gap is None or gap <= bound)  # type: ignore[operator]
    return BatchDivergence(row=row, step=step, position=generated_before + i, kind=kind, gap=gap, bound=bound,
                           deviation_ulps=dev, same_state=same, replay=bool(replay), near_tie=bool(near),
                           dtype=str(dtype).replace("torch.", ""))


def _token_gap(logits: torch.Tensor, ta: int, tb: int, config: ARSpecConfig, position: int,
               dtype: torch.dtype) -> tuple[float, float]:
    """Gap and bound of a choice between tokens ``ta`` and ``tb`` drawn from ``logits`` ``[V]`` (the model dtype):
    greedy, the raw logits; at ``T > 0``, the position-keyed Gumbel-perturbed scores (as
    :func:`~spiffy.arspec.sampling.sample_tokens` computes them), whose noise both runs share."""
    la, lb = float(logits[ta]), float(logits[tb])
    bound = rounding_bound(la, lb, dtype)
    temperature = float(config.sampling.temperature)
    if temperature == 0:
        return abs(la - lb), bound
    s = config.sampling
    scores = filter_logits(tempered(logits[None], temperature), int(s.top_k), float(s.top_p), nucleus="reaches")[0]
    noisy = scores + gumbel_noise(keyed_seed(s), position, scores.shape[-1], "cpu", scores.dtype)
    return abs(float(noisy[ta] - noisy[tb])), bound / temperature


def _rejection_margin(alone: _Round, batched: _Round, config: ARSpecConfig,
                      dtype: torch.dtype) -> tuple[float | None, float | None]:
    """The rejection rule's first decision that differs between the two rounds (same tree): the coin's distance to
    the threshold (an acceptance test ``coin < r/q``) or to the CDF boundary between the two drawn tokens, and how
    far rounding of the logits (``d`` at their largest magnitude, tempered) can move that value: ``(exp(4 d) - 1)``
    times the threshold, or ``2 (exp(4 d) - 1) min(C, 1 - C)`` for a CDF value ``C`` (residuals included)."""
    traces = []
    for rnd in (alone, batched):
        rule = RejectionRule(config.sampling)
        rule.trace = []
        rule.accept(rnd.tree, _RecordedLogits(rnd.target_logits), rnd.draft_logits, rnd.position)
        traces.append(rule.trace)
    scale = float(alone.target_logits.double().abs().max())
    if alone.draft_logits is not None:
        scale = max(scale, float(alone.draft_logits.double().abs().max()))
    grow = math.exp(4.0 * rounding_bound(scale, 0.0, dtype) / float(config.sampling.temperature)) - 1.0
    for (kind, u, va), (kind_b, ub, vb) in zip(*traces):
        if kind != kind_b:
            return None, None
        if kind == "test":
            if (u < va) != (ub < vb):  # type: ignore[operator]
                return abs(u - float(va)), grow * float(va)  # type: ignore[arg-type]
            continue
        ia, ib = sample_from(va, u), sample_from(vb, ub)  # type: ignore[arg-type]
        if ia != ib:
            cdf = torch.cumsum(va, dim=0) / float(va.sum())  # type: ignore[union-attr]
            edge = float(cdf[ia]) if ib > ia else float(cdf[ia - 1])
            return abs(u - edge), 2.0 * grow * min(edge, 1.0 - edge)
    return None, None


def explain_ar_batch_row(target: Any, make_drafter: Callable[[], Any] | None, batch: Sequence[Sequence[int]],
                         row: int, config: ARSpecConfig) -> BatchDivergence | None:
    """Prove (or refute) that row ``row`` of the AR ``batch`` leaves its prompt decoded alone only at a near tie.
    ``make_drafter``: a fresh drafter per call (``None``: plain AR). ``None`` when the two runs agree."""
    alone, batched, (lone, rowed) = _ar_runs(target, make_drafter, batch, row, config, None)
    if lone == rowed:
        return None
    if lone and rowed and lone[0] != rowed[0]:
        return judge_ar_prefill(target, batch[row], (lone[0], rowed[0]), config, row=row)
    k = next((j for j, (a, b) in enumerate(zip(alone.outcomes, batched.outcomes)) if a != b), None)
    dtype = next(target.parameters()).dtype
    if k is None:
        if len(alone.outcomes) == len(batched.outcomes):
            return None
        return BatchDivergence(row, min(len(alone.outcomes), len(batched.outcomes)), None, "schedule", None, None,
                               None, False, False, False, str(dtype).replace("torch.", ""))
    alone_k, batched_k, _ = _ar_runs(target, make_drafter, batch, row, config, k)
    before = 1 + sum(len(t) for _, t in alone.outcomes[:k])  # the prefill's token, then each round's tokens
    assert alone_k.round is not None and batched_k.round is not None
    return judge_ar_round(alone_k.round, batched_k.round, config, row=row, step=k, generated_before=before,
                          dtype=dtype)


__all__ = [
    "BATCH_NEAR_TIE_RULE", "BatchDivergence", "RecordingRule", "confidence_bound", "deviation_ulps",
    "explain_ar_batch_row", "explain_dllm_batch_row", "judge_ar_round", "judge_dllm_step",
]
