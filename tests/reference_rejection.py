"""The rejection rule as it was written before it became a tensor program: a sequential walk on the host that
renormalises ``r`` after every rejected child and draws the bonus from the last ``r`` (the module docstring of
:mod:`spiffy.arspec.rejection` states the rule). ``tests/test_device_rejection.py`` checks the tensor program
against it on random trees: equal decisions except where rounding decides (a coin within 1e-9 of a threshold).
"""

from __future__ import annotations

import torch

from spiffy.arspec.device_rejection import REJECTION_STREAM
from spiffy.arspec.sampling import keyed_seed, keyed_uniforms, position_key
from spiffy.arspec.selfselect import target_probs
from spiffy.arspec.tree import DraftTree
from spiffy.sampling import SamplingConfig

EPS = 1e-12


def _sample_from(probs: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(probs, dim=0)
    total = float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=cdf.dtype), right=True)[0])
    idx = min(idx, probs.numel() - 1)
    while float(probs[idx]) <= 0 and idx > 0:
        idx -= 1
    return idx


def _residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    left = (r - q).clamp_min(0.0)
    total = float(left.sum())
    return left / total if total > EPS else r


def reference_accept(tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig, root_position: int,
                     margins: list[float]) -> tuple[list[int], int]:
    """``(accepted nodes, bonus)`` of the sequential rule on ``tree`` with the target's ``logits [1 + N, V]`` (row 0
    the root); ``margins`` collects each decision's distance between coin and threshold (CDF edge for the bonus)."""
    lookup = tree.children_lookup()
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents.tolist()):
        children.setdefault(parent, []).append(i)
    node_tokens, depths = tree.tokens.tolist(), tree.depths.tolist()
    node, accepted = -1, []
    for _ in range(tree.num_nodes + 1):
        depth = 0 if node < 0 else depths[node]
        r = target_probs(logits[node + 1], sampling)
        if tree.samples is not None:
            draws = tree.samples.get(node, [])
            q = tree.proposal_below(node, depth) if draws else None
        else:
            draws, q = [node_tokens[c] for c in children.get(node, [])], None
        key = position_key(keyed_seed(sampling) ^ REJECTION_STREAM, root_position + depth + 1)
        coins = keyed_uniforms(key, len(draws) + 1).tolist()
        chosen = None
        for x, u in zip(draws, coins):
            if q is None:
                margins.append(abs(u - float(r[x])))
                if u < float(r[x]):
                    chosen = x
                    break
                rest = r.clone()
                rest[x] = 0.0
                total = float(rest.sum())
                if total <= EPS:
                    chosen = x
                    break
                r = rest / total
            else:
                qx = float(q[x])
                if qx > 0:
                    margins.append(abs(u - min(1.0, float(r[x]) / qx)))
                if qx > 0 and u < min(1.0, float(r[x]) / qx):
                    chosen = x
                    break
                r = _residual(r, q.double().cpu())
        if chosen is None:
            cdf = torch.cumsum(r, 0) / float(r.sum())
            margins.append(float((cdf - coins[-1]).abs().min()))
            return accepted, _sample_from(r, coins[-1])
        node = lookup[(node, chosen)]
        accepted.append(node)
    raise AssertionError("the walk did not end")
