"""AR half of :mod:`spiffy.bench.batch_fidelity`: the near-tie proof of a batched AR row (DFlash, DDTree, DEER,
SpecDiff-2, plain AR; coupled and rejection rules) that differs from its prompt decoded alone.

The rule is the one of :mod:`spiffy.bench.fidelity`, applied to verification rounds: both runs'
acceptance rules are wrapped in a :class:`RecordingRule` (every round's outcome, and the first differing round in
full: the tree, the target's logits at every node, the drafter's logits), the round is replayed on the batched
inputs, and the flipped choice is measured by its kind (greedy gap, keyed Gumbel scores, rejection coins, drafts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.config import ARSpecConfig
from spiffy.arspec.generate import speculative_generate
from spiffy.arspec.methods import make_rule
from spiffy.arspec.rejection import RejectionRule, sample_from
from spiffy.arspec.rules import Acceptance, TargetLogits
from spiffy.arspec.sampling import gumbel_noise, keyed_seed, tempered
from spiffy.arspec.tree import DraftTree
from spiffy.bench.fidelity import DEVIATION_ULPS, NearTieProof, deviation_ulps, rounding_bound
from spiffy.sampling import filter_logits
from spiffy.torch_utils import dtype_name


@dataclass
class RecordedRound:
    """One recorded verification round: the root position, the draft tree, the target's logits at the root and
    every node, the drafter's logits, the rule's outcome, the round's index in its run and the generated-token
    index of the first token it commits."""

    position: int
    tree: DraftTree
    target_logits: torch.Tensor  # [1 + N, V]: root, then node i
    draft_logits: torch.Tensor | None
    outcome: Acceptance
    index: int = -1
    first_token: int = -1


class RecordedLogits(TargetLogits):
    """Target logits of a recorded round (``[1 + N, V]``), served like :class:`TargetLogits`."""

    def __init__(self, rows: torch.Tensor) -> None:  # noqa: D107 - no head: the rows are known
        self.rows = rows
        self._cache = {}

    def logits(self, node: int) -> torch.Tensor:
        r = 0 if node < 0 else node + 1
        return self.rows[r : r + 1]

    def all_rows(self, count: int) -> torch.Tensor:
        return self.rows[:count]


class RecordingRule:
    """An acceptance rule that records each round's outcome, and in full (tree, every node's target logits, the
    drafter's logits) round ``keep`` or, with ``keep_token``, the round that commits generated token ``keep_token``
    (token 0 is the prefill's, so rounds commit tokens 1, 2, ...)."""

    def __init__(self, inner: Any, keep: int | None = None, *, keep_token: int | None = None) -> None:
        self.inner, self.keep, self.keep_token = inner, keep, keep_token
        self.outcomes: list[tuple[int, list[int]]] = []
        self.round: RecordedRound | None = None
        self.generated = 1  # tokens committed so far: the prefill's, then each round's

    def _wanted(self, committed: int) -> bool:
        if self.keep_token is not None:
            return self.generated <= self.keep_token < self.generated + committed
        return len(self.outcomes) - 1 == self.keep

    def accept(self, tree: DraftTree, target: TargetLogits, draft_logits: torch.Tensor | None,
               root_position: int) -> Acceptance:
        out = self.inner.accept(tree, target, draft_logits, root_position)
        tokens = tree.tokens.tolist()
        self.outcomes.append((int(root_position), [tokens[n] for n in out.accepted] + [int(out.bonus)]))
        if self._wanted(len(out.accepted) + 1):
            rows = torch.cat([target.logits(n) for n in range(-1, tree.num_nodes)]).detach().cpu()
            drafts = None if draft_logits is None else draft_logits.detach().cpu()
            self.round = RecordedRound(int(root_position), tree, rows, drafts, out, len(self.outcomes) - 1,
                                       self.generated)
        self.generated += len(out.accepted) + 1
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
                     row: int | None, compared: str = "batched row vs alone") -> NearTieProof:
    """The first generated token (drawn from the prefill's last row) differs: the lone prefill's logits of the two
    tokens, raw (greedy) or noise-perturbed (position-keyed draw of either rule), must lie within rounding. The
    state is the prompt itself and the draw has no other input, so points 1 and 2 of the rule hold by construction."""
    param = next(target.parameters())
    with torch.no_grad():
        logits = target(torch.tensor([list(prompt)], device=param.device)).logits[0, -1].cpu()
    gap, bound = token_gap(logits, tokens[0], tokens[1], config, len(prompt), param.dtype)
    kind = "greedy" if float(config.sampling.temperature) == 0 else "sampled"
    return NearTieProof(row=row, step=-1, position=0, kind=kind, gap=gap, bound=bound, deviation_ulps=None,
                        same_state=True, replay=True, near_tie=bool(gap <= bound), dtype=dtype_name(param.dtype),
                        compared=compared)


def judge_ar_round(alone: RecordedRound, batched: RecordedRound, config: ARSpecConfig, *, row: int, step: int,
                   generated_before: int, dtype: torch.dtype) -> NearTieProof:
    """The rule (module docstring) on the first differing verification round of the two runs."""
    same = alone.position == batched.position
    replay_out = make_rule(config).accept(batched.tree, RecordedLogits(batched.target_logits), batched.draft_logits,
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
        replay = replay and _same_tree(config.spec.build_tree(config, batched.draft_logits, batched.position), batched.tree)
    else:
        kind = "greedy" if temperature == 0 else "sampled"
        node = -1 if i == 0 else alone.outcome.accepted[i - 1]
        if temperature > 0 and config.accept == "rejection":
            gap, bound = _rejection_margin(alone, batched, config, dtype)
        elif i < len(ta_all) and i < len(tb_all):
            pos = alone.position + (0 if node < 0 else int(alone.tree.depths[node])) + 1
            gap, bound = token_gap(alone.target_logits[node + 1], int(ta_all[i]), int(tb_all[i]), config, pos,
                                    dtype)
    near = same and replay and dev <= DEVIATION_ULPS and (gap is None or gap <= bound)  # type: ignore[operator]
    return NearTieProof(row=row, step=step, position=generated_before + i, kind=kind, gap=gap, bound=bound,
                        deviation_ulps=dev, same_state=same, replay=bool(replay), near_tie=bool(near),
                        dtype=dtype_name(dtype))


def token_gap(logits: torch.Tensor, ta: int, tb: int, config: ARSpecConfig, position: int,
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


def _rejection_margin(alone: RecordedRound, batched: RecordedRound, config: ARSpecConfig,
                      dtype: torch.dtype) -> tuple[float | None, float | None]:
    """The rejection rule's first decision that differs between the two rounds (same tree): the coin's distance to
    the threshold (an acceptance test ``coin < r/q``) or to the CDF boundary between the two drawn tokens, and how
    far rounding of the logits (``d`` at their largest magnitude, tempered) can move that value: ``(exp(4 d) - 1)``
    times the threshold, or ``2 (exp(4 d) - 1) min(C, 1 - C)`` for a CDF value ``C`` (residuals included)."""
    traces = []
    for rnd in (alone, batched):
        rule = RejectionRule(config.sampling)
        rule.trace = []
        rule.accept(rnd.tree, RecordedLogits(rnd.target_logits), rnd.draft_logits, rnd.position)
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
                         row: int, config: ARSpecConfig) -> NearTieProof | None:
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
        return NearTieProof(row, min(len(alone.outcomes), len(batched.outcomes)), None, "schedule", None, None,
                            None, False, False, False, dtype_name(dtype))
    alone_k, batched_k, _ = _ar_runs(target, make_drafter, batch, row, config, k)
    before = 1 + sum(len(t) for _, t in alone.outcomes[:k])  # the prefill's token, then each round's tokens
    assert alone_k.round is not None and batched_k.round is not None
    return judge_ar_round(alone_k.round, batched_k.round, config, row=row, step=k, generated_before=before,
                          dtype=dtype)



__all__ = ["RecordedLogits", "RecordedRound", "RecordingRule", "explain_ar_batch_row", "judge_ar_prefill",
           "judge_ar_round", "token_gap"]
