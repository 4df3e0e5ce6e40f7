"""Near-tie proof of a divergence between a speculative AR path and plain AR decoding in low precision.

DFlash/DDTree verify every draft row of a round in one target forward over a tree of rows; plain AR runs one row
per forward. In float32/float64 the two agree token for token; in bfloat16/float16 the matrix products of the two
shapes reduce in different orders, so the logits differ by a few units in the last place (ulps) and a greedy
decision between two almost equal logits may flip. Such a flip is numerics, not logic, exactly when the two
candidates' logits are closer than that rounding error; anything else is a bug.

The rule (greedy decoding): at the first position where the speculative output differs from the baseline, the
baseline's logits there (one full forward of the target over ``prompt + baseline[:i]`` in the model's dtype) must
give the baseline token and the speculative token logits ``l_b`` and ``l_s`` with

    ``|l_b - l_s| <= NEAR_TIE_ULPS * spacing(max(|l_b|, |l_s|))``

where ``spacing(x) = finfo(dtype).eps * 2 ** floor(log2 x)`` is the distance between adjacent representable
numbers at ``x`` (bfloat16: ``2**-7`` relative, float16: ``2**-10``). Why 4 ulps: each path rounds each logit to
the dtype (a difference of two rounded values is off by up to 1 ulp), and the hidden states carry the rounding of
different reduction orders; measured on the shipped tiny Qwen3 target (6 HumanEval prompts x 48 positions), the
top-2 gap of a cached one-row decode and of a full-sequence forward differ by at most 2.5 ulps of the top logit in
bfloat16 and 2.0 in float16. 4 ulps covers that with margin and stays far below any gap a logic error produces.

With sampling (temperature > 0) the decision compares perturbed scores; no gap is computed there (``near_tie``
is ``None``), the identical rate is still reported.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from spiffy.bench.common import first_mismatch

NEAR_TIE_ULPS = 4.0

NEAR_TIE_RULE = (
    f"greedy divergence is a near tie when the baseline's logits of the baseline and speculative tokens differ by at "
    f"most {NEAR_TIE_ULPS:g} ulps of the larger one in the model dtype (spiffy.bench.fidelity)"
)


def spacing(value: float, dtype: torch.dtype) -> float:
    """Distance between adjacent numbers of ``dtype`` at ``|value|`` (its ulp); the smallest normal's at 0."""
    info = torch.finfo(dtype)
    mag = max(abs(float(value)), float(info.tiny))
    return float(info.eps) * 2.0 ** math.floor(math.log2(mag))


def rounding_bound(logit_a: float, logit_b: float, dtype: torch.dtype, ulps: float = NEAR_TIE_ULPS) -> float:
    """The largest logit gap rounding can flip: ``ulps`` spacings of ``max(|logit_a|, |logit_b|)`` in ``dtype``."""
    return ulps * spacing(max(abs(logit_a), abs(logit_b)), dtype)


@dataclass
class Divergence:
    """The first differing position of a speculative output and what the baseline's logits say about it.

    Attributes:
        position: index in the generated tokens (prompt excluded).
        baseline_token, speculative_token: the two tokens there (``None`` where one output ended).
        gap: ``|l_baseline - l_speculative|`` of the baseline's logits at that position (``None``: not computed).
        bound: :func:`rounding_bound` of the two logits in the model dtype.
        speculative_rank: rank of the speculative token in the baseline's logits (0 = top).
        dtype: the model dtype.
        near_tie: ``gap <= bound`` (``None`` when not computed: sampling, or one output is a prefix of the other).
    """

    position: int
    baseline_token: int | None
    speculative_token: int | None
    gap: float | None = None
    bound: float | None = None
    speculative_rank: int | None = None
    dtype: str | None = None
    near_tie: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def explain_ar_divergence(
    target: Any,
    prompt_ids: Sequence[int],
    baseline: Sequence[int],
    speculative: Sequence[int],
    *,
    greedy: bool = True,
) -> Divergence | None:
    """:class:`Divergence` of ``speculative`` from ``baseline`` (``None`` when identical).

    Args:
        target: the causal LM both outputs came from (``target(ids [1, L]).logits [1, L, V]``).
        prompt_ids: the prompt token ids; baseline, speculative: generated token ids (prompt excluded).
        greedy: the outputs were decoded greedily (otherwise no gap is computed).
    """
    pos = first_mismatch(list(baseline), list(speculative))
    if pos is None:
        return None
    b_tok = int(baseline[pos]) if pos < len(baseline) else None
    s_tok = int(speculative[pos]) if pos < len(speculative) else None
    param = next(target.parameters())
    div = Divergence(position=pos, baseline_token=b_tok, speculative_token=s_tok,
                     dtype=str(param.dtype).replace("torch.", ""))
    if not greedy or b_tok is None or s_tok is None:
        return div
    ids = torch.tensor([list(prompt_ids) + list(baseline[:pos])], dtype=torch.long, device=param.device)
    logits = target(ids).logits[0, -1].float()  # [V], computed in the model dtype, exact in float32
    lb, ls = float(logits[b_tok]), float(logits[s_tok])
    div.gap = abs(lb - ls)
    div.bound = rounding_bound(lb, ls, param.dtype)
    div.speculative_rank = int((logits > ls).sum())
    div.near_tie = div.gap <= div.bound
    return div


__all__ = ["NEAR_TIE_ULPS", "NEAR_TIE_RULE", "Divergence", "spacing", "rounding_bound", "explain_ar_divergence"]
