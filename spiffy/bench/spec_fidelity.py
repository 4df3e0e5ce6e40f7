"""Near-tie proofs of a speculative path that differs from its baseline on one prompt (the rule:
:mod:`spiffy.bench.fidelity`, the baseline being the reference run).

* **dLLM** (:func:`prove_dllm_divergence`): Spiffy, FreeDave and SSD compute ``F`` of the real state and of ``D``
  drafts in one verification forward over ``1 + D`` states; the baseline computes ``F`` of one state per forward.
  Each state is computed exactly as the baseline's forward would compute it, so on a CPU the two agree bit for bit;
  on a GPU the matrix-product kernel (and its reduction order) depends on the number of rows in the call, so in
  bfloat16 a state's logits round differently (issue 38). Both runs' transitions are recorded through the dLLM
  pieces of :mod:`spiffy.bench.batch_fidelity`: the first differing transition must start from the same state and
  generator state, the baseline's rule replayed on the speculative run's logits must reproduce its result, the
  logits must agree within the rounding bound and the flipped choice must lie within rounding.
* **AR** (:func:`prove_ar_divergence`): DFlash, DDTree, DEER and SpecDiff-2 verify a chain or tree of drafted rows
  in one target forward; plain AR decodes one row per forward. Rounds do not line up (a speculative round commits
  several tokens), so the step judged is the decision of the first differing generated token: in plain AR the
  bonus of a one-row round, in the speculative run the target's draw at the accepted node before it. Both must sit
  at the same absolute position after the same committed tokens; plain AR's rule on the speculative row's logits
  (same position-keyed noise) must give the speculative token; the two rows must agree within the rounding bound;
  and the two tokens' raw (greedy) or noise-perturbed (sampled) scores under plain AR's logits must lie within
  rounding. The rejection rule at ``T > 0`` equals AR in distribution only, so no token proof applies to it.

Each proof decodes both paths twice (to find the step, then to record it): about four decodes per differing output;
an AR proof given the two outputs it explains decodes each path once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch

from spiffy.arspec.config import ARSpecConfig
from spiffy.arspec.generate import speculative_generate
from spiffy.arspec.methods import AR, DEFAULT_ACCEPT, get_accept, make_rule
from spiffy.arspec.tree import empty_tree
from spiffy.bench.batch_fidelity import TransitionRecorder, dllm_run, prove_dllm_runs
from spiffy.bench.batch_fidelity_ar import RecordedLogits, RecordedRound, RecordingRule, judge_ar_prefill, token_gap
from spiffy.bench.fidelity import DEVIATION_ULPS, NearTieProof, deviation_ulps
from spiffy.errors import ConfigError
from spiffy.torch_utils import dtype_name


def prove_dllm_divergence(model: Any, prompt: Sequence[int], config: Any = None, *, graph: Any,
                          budget: int | None = None, score: str | None = None, tokenizer: Any = None,
                          overrides: dict[str, Any] | None = None,
                          compared: str = "spiffy vs baseline") -> NearTieProof | None:
    """Prove (or refute) that speculative decoding of ``prompt`` with ``graph`` (a calibrated graph, or a rival's:
    :func:`spiffy.selfspec.rivals.rival_graph`) leaves the baseline only at a near tie.

    Args:
        model: the dLLM both paths decode with; prompt: its token ids (one prompt, ``[P]``).
        config: the :class:`~spiffy.decoding.DecodeConfig` of both paths (its seed included); overrides: family
            options, as :func:`spiffy.api.generate` takes them.
        graph, budget, score: the speculative path, as :func:`spiffy.api.generate` takes them.
        compared: how the proof names the pair (``"ssd 3 vs baseline"``).
    Returns:
        ``None`` when the two runs agree at every transition, else the :class:`NearTieProof` of the first differing
        one (``row`` is ``None``: a single prompt).
    """
    extra = dict(overrides or {})
    ids = [int(t) for t in prompt]

    def run(reference: bool, keep: int | None, replay_logits: torch.Tensor | None) -> TransitionRecorder:
        return dllm_run(model, [ids], 0, config, True, None if reference else graph, budget,
                         None if reference else score, tokenizer, extra, keep=keep, replay_logits=replay_logits)

    return prove_dllm_runs(run, next(model.parameters()).dtype, row=None, compared=compared, model=model)


def plain_ar(config: ARSpecConfig) -> ARSpecConfig:
    """The plain AR configuration ``config`` must equal (same sampling, limits and stops; no drafts)."""
    return replace(config, method=AR.name, budget=0, chain_length=None, drafts=1, accept=DEFAULT_ACCEPT)


def _decision(rnd: RecordedRound, offset: int) -> tuple[torch.Tensor, int, int]:
    """The ``[V]`` logits row that drew token ``offset`` of a recorded round, the absolute position of the last
    committed token before it (the keyed noise draws at that position + 1), and the token."""
    node = -1 if offset == 0 else int(rnd.outcome.accepted[offset - 1])
    position = rnd.position + (0 if node < 0 else int(rnd.tree.depths[node]))
    tokens = [int(rnd.tree.tokens[n]) for n in rnd.outcome.accepted] + [int(rnd.outcome.bonus)]
    return rnd.target_logits[node + 1], position, tokens[offset]


def judge_ar_token(reference: RecordedRound, ref_offset: int, other: RecordedRound, other_offset: int,
                   config: ARSpecConfig, *, step: int, index: int, dtype: torch.dtype, compared: str) -> NearTieProof:
    """The rule on the decision of generated token ``index``: token ``ref_offset`` of plain AR's recorded round
    ``reference`` against token ``other_offset`` of the speculative run's round ``other`` (its ``step``-th)."""
    base = plain_ar(config)
    row_a, pos_a, tok_a = _decision(reference, ref_offset)
    row_b, pos_b, tok_b = _decision(other, other_offset)
    same = pos_a == pos_b
    replayed = make_rule(base).accept(empty_tree(), RecordedLogits(row_b[None]), None, pos_a).bonus
    dev = deviation_ulps(row_a[None], row_b[None], dtype)
    gap, bound = token_gap(row_a, tok_a, tok_b, base, pos_a + 1, dtype)
    kind = "greedy" if float(config.sampling.temperature) == 0 else "sampled"
    near = same and replayed == tok_b and dev <= DEVIATION_ULPS and gap <= bound
    return NearTieProof(row=None, step=step, position=index, kind=kind, gap=gap, bound=bound, deviation_ulps=dev,
                        same_state=same, replay=replayed == tok_b, near_tie=bool(near), dtype=dtype_name(dtype),
                        compared=compared)


def _ar_runs(target: Any, drafter: Any, prompt: list[int], config: ARSpecConfig,
             keep_token: int | None = None) -> tuple[RecordingRule, RecordingRule, list[list[int]]]:
    """Plain AR and the speculative path on ``prompt``, each with a recording rule (keeping the round that commits
    generated token ``keep_token`` in full); also both runs' tokens."""
    base = plain_ar(config)
    reference = RecordingRule(make_rule(base), keep_token=keep_token)
    ar = speculative_generate(target, None, prompt, base, rule=reference)
    other = RecordingRule(make_rule(config), keep_token=keep_token)
    spec = speculative_generate(target, drafter, prompt, config, rule=other)
    return reference, other, [list(ar.tokens), list(spec.tokens)]


def prove_ar_divergence(target: Any, drafter: Any, prompt: Sequence[int], config: ARSpecConfig, *,
                        outputs: tuple[Sequence[int], Sequence[int]] | None = None,
                        compared: str | None = None) -> NearTieProof | None:
    """Prove (or refute) that the speculative path ``config`` (DFlash, DDTree, DEER, SpecDiff-2, ...) leaves plain
    AR on ``prompt`` only at a near tie.

    Args:
        target: the Qwen3 target; drafter: the method's :class:`~spiffy.arspec.Drafter` (``None`` without one).
        prompt: the prompt's token ids; config: the speculative configuration (plain AR: :func:`plain_ar` of it).
        outputs: the two runs' generated tokens ``(plain AR, speculative)`` when the caller has them (the proof
            then decodes each path once, recording the decision of the first differing token; else twice).
        compared: how the proof names the pair (default ``"METHOD vs ar"``).
    Returns:
        ``None`` when both outputs agree (or the recording re-run does not reproduce ``outputs``: nothing is
        proven, :func:`~spiffy.bench.fidelity.divergence_entry`), else the :class:`NearTieProof` of the first
        differing token.
    Raises:
        ConfigError: the rejection rule at ``T > 0`` (equal to AR in distribution only: no token proof applies).
    """
    if not get_accept(config.accept).exact_tokens and float(config.sampling.temperature) > 0:
        raise ConfigError(f"the {config.accept} rule at temperature > 0 equals plain AR in distribution only, so no "
                          "token-level near-tie proof applies; fix: prove a coupled-rule or greedy run")
    name = compared or f"{config.method} vs ar"
    ids = [int(t) for t in prompt]
    if outputs is None:
        _, _, (ar, spec) = _ar_runs(target, drafter, ids, config)
    else:
        ar, spec = [int(t) for t in outputs[0]], [int(t) for t in outputs[1]]
    index = next((i for i, (a, b) in enumerate(zip(ar, spec)) if a != b), None)
    dtype = next(target.parameters()).dtype
    if index is None:
        if len(ar) == len(spec):
            return None
        # one output ended (or stopped) before the other without a differing token
        return NearTieProof(None, -1, min(len(ar), len(spec)), "schedule", None, None, None, False, False, False,
                            dtype_name(dtype), name)
    if index == 0:  # both drew it from the same prefill forward
        return judge_ar_prefill(target, ids, (ar[0], spec[0]), config, row=None, compared=name)
    reference, other, rerun = _ar_runs(target, drafter, ids, config, keep_token=index)
    if rerun != [ar, spec] or reference.round is None or other.round is None:
        return None  # the re-run did not reproduce the outputs: nothing to prove (the caller reports it unproven)
    ref_round, other_round = reference.round, other.round
    return judge_ar_token(ref_round, index - ref_round.first_token, other_round, index - other_round.first_token,
                          config, step=other_round.index, index=index, dtype=dtype, compared=name)


__all__ = ["judge_ar_token", "plain_ar", "prove_ar_divergence", "prove_dllm_divergence"]
