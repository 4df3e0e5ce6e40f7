"""AR speculative decoding of a Qwen3 target: DDTree, vanilla DFlash and plain AR on one code path (SPEC §7).

:func:`speculative_generate` runs the rounds of :mod:`spiffy.arspec.stages` with any :class:`~spiffy.arspec.Drafter`
and :class:`~spiffy.arspec.AcceptanceRule` under one :class:`~spiffy.arspec.ARSpecConfig`; :func:`ddtree_generate`
is the keyword-argument entry point for a DFlash drafter model. With no drafter and no nodes a round is exactly one
AR decoding step, so the three methods share kernels, caches, sampling and timing, and (with the coupled rule) all
of them produce the AR output token for token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from spiffy.arspec.config import DEFAULT_TREE_BUDGET, METHODS, ARSpecConfig
from spiffy.arspec.drafter import ContextUpdate, DFlashDrafter, Drafter
from spiffy.arspec.rejection import RejectionRule
from spiffy.arspec.rules import AcceptanceRule, CoupledRule
from spiffy.arspec.sampling import sample_keyed
from spiffy.arspec.stages import STAGES, StageClock, TargetRunner, build_tree, commit, compile_round, draft, prefill, sync, verify
from spiffy.errors import ConfigError, PromptTooLongError
from spiffy.models.dflash import DFlashDraftModel
from spiffy.sampling import SamplingConfig

__all__ = [
    "ARGenerationResult", "speculative_generate", "ddtree_generate", "make_rule", "METHODS", "DEFAULT_BUDGET", "STAGES",
]

#: DDTree nodes per round when ``budget`` is not given (same as :data:`spiffy.arspec.config.DEFAULT_TREE_BUDGET`)
DEFAULT_BUDGET = DEFAULT_TREE_BUDGET


@dataclass
class ARGenerationResult:
    """Output and statistics of :func:`speculative_generate` / :func:`ddtree_generate`.

    Attributes:
        tokens: generated token ids (prompt excluded; ends with the stop token if one was generated).
        rounds: number of verification rounds (target forwards after the prefill).
        tau: mean acceptance length per round, bonus token included (tokens committed per round).
        acceptance_lengths: tokens committed in each round.
        histogram: ``histogram[k]`` = number of rounds that committed ``k`` tokens (``k = 0..block_size``).
        stage_times: seconds spent per stage: draft, tree_build, compile, verify, commit.
        seconds: total wall time (prefill included).
        prefill_seconds: prompt forward + first token.
        time_per_output_token: decode seconds (prefill excluded) / number of generated tokens.
        method, budget, block_size: the configuration that ran (``budget``: tree nodes for ddtree, chain length
            for dflash, 0 for ar).
        num_prompt_tokens: prompt length.
        nodes_per_round: draft nodes verified per round (root excluded).
        stopped: generation ended on a stop token.
    """

    tokens: list[int]
    rounds: int
    tau: float
    acceptance_lengths: list[int]
    histogram: list[int]
    stage_times: dict[str, float]
    seconds: float
    prefill_seconds: float
    time_per_output_token: float
    method: str = "ddtree"
    budget: int = 0
    block_size: int = 1
    num_prompt_tokens: int = 0
    nodes_per_round: list[int] = field(default_factory=list)
    stopped: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return asdict(self)

    def record_round(self, committed: int, nodes: int) -> None:
        """Add one verification round that committed ``committed`` tokens after verifying ``nodes`` draft nodes."""
        self.rounds += 1
        self.acceptance_lengths.append(committed)
        self.nodes_per_round.append(nodes)
        if committed >= len(self.histogram):
            self.histogram.extend([0] * (committed + 1 - len(self.histogram)))
        self.histogram[committed] += 1


def _as_prompt(input_ids: Any, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ConfigError(
                f"ddtree_generate decodes one sequence at a time, got a batch of {ids.shape[0]}; "
                "fix: call it once per prompt"
            )
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ConfigError(f"input_ids must be a non-empty [P] or [1, P] sequence, got shape {tuple(ids.shape)}")
    return ids.to(device).view(1, -1)


def _check_context(target: nn.Module, n_prompt: int, max_new_tokens: int) -> None:
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and n_prompt + max_new_tokens > int(limit):
        raise PromptTooLongError(
            f"prompt ({n_prompt}) + max_new_tokens ({max_new_tokens}) exceeds the target's context of {limit}; "
            "fix: shorten the prompt or lower max_new_tokens"
        )


def _append_until_stop(tokens: list[int], new: list[int], config: ARSpecConfig) -> tuple[int, bool]:
    """Append ``new`` to ``tokens`` up to and including a stop token, never beyond ``max_new_tokens``.

    Returns ``(number appended, stopped)``.
    """
    committed = 0
    for t in new:
        tokens.append(t)
        committed += 1
        if t in config.stop_token_ids:
            return committed, True
        if len(tokens) >= config.max_new_tokens:
            break
    return committed, False


def make_rule(config: ARSpecConfig) -> AcceptanceRule:
    """The acceptance rule ``config.accept`` names, for ``config.sampling``."""
    if config.accept == "rejection":
        return RejectionRule(config.sampling)
    return CoupledRule(config.sampling)


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    drafter: Drafter | None,
    input_ids: Any,
    config: ARSpecConfig,
    *,
    rule: AcceptanceRule | None = None,
    progress: bool = False,
) -> ARGenerationResult:
    """Generate with a Qwen3 target under ``config``: the drafter proposes, the target verifies in one forward per
    round, the acceptance rule decides.

    Args:
        target: a transformers ``Qwen3ForCausalLM`` (``attn_implementation`` sdpa or eager).
        drafter: a :class:`~spiffy.arspec.Drafter` (ignored, may be ``None``, for ``method="ar"``).
        input_ids: the prompt, ``[P]`` or ``[1, P]`` token ids (list or tensor).
        config: method, tree budget / chain length, limits, stop tokens, sampling.
        rule: the acceptance rule (default: the one ``config.accept`` names, :func:`make_rule`).
        progress: show a tqdm bar over generated tokens on stderr.
    Returns:
        :class:`ARGenerationResult`.
    Raises:
        ConfigError: missing drafter, batch > 1, bad target; DrafterMismatchError (from the drafter's ``attach``);
        PromptTooLongError.
    """
    if config.method != "ar" and drafter is None:
        raise ConfigError(
            f"method {config.method!r} needs a drafter; fix: pass drafter=load_drafter(DIR) or use method='ar'"
        )
    block = config.block_for(drafter)
    active = drafter if config.uses_drafter else None  # no drafts: run without the drafter (no hooks, no context)
    rule = rule if rule is not None else make_rule(config)
    runner = TargetRunner.for_target(target)
    prompt = _as_prompt(input_ids, runner.device)
    n_prompt = int(prompt.shape[1])
    _check_context(target, n_prompt, config.max_new_tokens)
    clock = StageClock(runner.device)
    result = ARGenerationResult(
        tokens=[], rounds=0, tau=0.0, acceptance_lengths=[], histogram=[0] * (block + 1),
        stage_times=dict(clock.times), seconds=0.0, prefill_seconds=0.0, time_per_output_token=0.0,
        method=config.method, budget=config.reported_budget(block), block_size=block, num_prompt_tokens=n_prompt,
    )
    if config.max_new_tokens == 0:
        return result
    depth_cap = config.draft_depth(block)
    root_rows = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))  # reused by every round
    bar = tqdm(total=config.max_new_tokens, desc=f"spiffy {config.method}", unit="tok", leave=False) if progress else None
    attached = False
    try:
        if active is not None:
            active.attach(target)
            attached = True
        sync(runner.device)
        t_start = time.perf_counter()
        first = prefill(runner, prompt)
        tokens: list[int] = [int(sample_keyed(first, [n_prompt], config.sampling)[0])]
        if active is not None:
            active.commit(ContextUpdate(prompt[0].tolist(), 0, range(n_prompt)))
        sync(runner.device)
        t_prefill = time.perf_counter()
        result.prefill_seconds = t_prefill - t_start
        if bar is not None:
            bar.update(1)
        stopped = tokens[0] in config.stop_token_ids

        while not stopped and len(tokens) < config.max_new_tokens:
            clock.start()
            root_tok = tokens[-1]
            root_pos = n_prompt + len(tokens) - 1
            ctx_len = runner.context_len
            depth = min(depth_cap, config.max_new_tokens - len(tokens) - 1)
            draft_logits = draft(active, root_tok, root_pos, depth)
            clock.lap("draft")
            tree = build_tree(config, draft_logits, root_pos)
            clock.lap("tree_build")
            compiled = compile_round(runner, tree, root_tok, root_pos, root_rows)
            clock.lap("compile")
            target_logits = verify(runner, compiled)
            outcome = rule.accept(tree, target_logits, draft_logits, root_pos)
            clock.lap("verify")
            node_tokens = tree.tokens.tolist()
            new = [node_tokens[n] for n in outcome.accepted] + [outcome.bonus]
            rows = commit(runner, ctx_len, outcome.accepted)
            if active is not None:
                active.commit(ContextUpdate([root_tok] + new[:-1], root_pos, rows))
            committed, stopped = _append_until_stop(tokens, new, config)
            result.record_round(committed, tree.num_nodes)
            if bar is not None:
                bar.update(committed)
            clock.lap("commit")

        sync(runner.device)
        t_end = time.perf_counter()
    finally:
        if attached:
            active.detach()  # type: ignore[union-attr]
        if bar is not None:
            bar.close()

    result.tokens = tokens
    result.stopped = stopped
    result.seconds = t_end - t_start
    result.stage_times = dict(clock.times)
    result.tau = float(sum(result.acceptance_lengths) / result.rounds) if result.rounds else 0.0
    result.time_per_output_token = (t_end - t_prefill) / max(1, len(tokens))
    return result


def ddtree_generate(
    target: nn.Module,
    drafter: DFlashDraftModel | Drafter | None,
    input_ids: Any,
    *,
    method: str = "ddtree",
    budget: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_token_ids: int | Iterable[int] | None = None,
    block_size: int | None = None,
    progress: bool = False,
) -> ARGenerationResult:
    """Generate with a Qwen3 target: DDTree tree speculation, the vanilla DFlash chain, or plain AR.

    A thin wrapper that builds an :class:`~spiffy.arspec.ARSpecConfig` and calls :func:`speculative_generate`
    with the coupled rule.

    Args:
        target: a transformers ``Qwen3ForCausalLM`` (``attn_implementation`` sdpa or eager).
        drafter: its :class:`~spiffy.models.dflash.DFlashDraftModel` (or any :class:`~spiffy.arspec.Drafter`;
            ignored, may be ``None``, for ``method="ar"``).
        input_ids: the prompt, ``[P]`` or ``[1, P]`` token ids (list or tensor).
        method: ``"ddtree"`` (optimal tree of ``budget`` nodes), ``"dflash"`` (chain of the drafter's argmaxes,
            ``block_size - 1`` nodes) or ``"ar"`` (no drafter: one token per target forward).
        budget: DDTree node budget (root excluded), default :data:`DEFAULT_BUDGET`; ``0`` = no drafts.
        max_new_tokens: hard cap on generated tokens.
        temperature, top_p, top_k: the target's decoding rule (``temperature == 0``: greedy).
        seed: sampling seed; the token at absolute position ``p`` uses noise keyed by ``(seed, p)``, so every
            method draws the same tokens.
        stop_token_ids: generation ends right after the first generated stop token (kept in the output).
        block_size: drafted block length (default: the drafter's ``block_size``).
        progress: show a tqdm bar over generated tokens on stderr.
    Returns:
        :class:`ARGenerationResult`.
    Raises:
        ConfigError: unknown method, ``budget < 0``, ``temperature < 0``, bad top-p/top-k, missing drafter,
            batch > 1; DrafterMismatchError: drafter and target do not fit; PromptTooLongError.
    """
    sampling = SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=int(seed))
    config = ARSpecConfig(
        method=method,
        tree_budget=DEFAULT_BUDGET if budget is None else int(budget),
        max_new_tokens=int(max_new_tokens),
        stop_token_ids=stop_token_ids,  # type: ignore[arg-type]  # normalised by the config
        block_size=block_size,
        sampling=sampling,
    )
    if method != "ar" and isinstance(drafter, DFlashDraftModel):
        wrapped = DFlashDrafter(drafter, block_size)
        wrapped.check(target)  # a mismatched drafter is an error even when this run drafts nothing
        drafter = wrapped
    return speculative_generate(target, drafter if method != "ar" else None, input_ids, config, progress=progress)
