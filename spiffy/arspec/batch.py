"""AR speculative generation, batch first: the one loop every AR method runs (a single prompt is a batch of one).

Each batch row is its own generation: its own method, drafter state, draft tree, acceptance rule and stop condition;
the target verifies every row's ``[root, nodes...]`` in ONE forward ``[B, R]`` (rows padded to the longest tree)
with a per-row ancestor mask (:mod:`spiffy.arspec.stages`). Row ``b`` of the output equals that prompt decoded in a
batch of one (and so plain AR decoding, under the coupled rule), at any temperature, with the row's own seed: the
position-keyed noise depends on the row's seed and absolute positions only.

The target's K/V cache is one rectangular ``DynamicCache`` of ``B`` rows with a per-row validity mask ``[B, C]``:

* prompts are left padded; a row's position ids count from its first real token, its padding columns are invalid;
* after a round, row ``b`` keeps its root and accepted nodes (``k_b`` rows) at the front of the appended window,
  the window is cropped to ``max_b k_b`` and the ``max - k_b`` trailing columns of row ``b`` are marked invalid
  (holes: never seen again; position ids are explicit, so holes do not shift anything);
* a round in which no row drafts anything (plain AR, whose :class:`~spiffy.arspec.methods.Method` never drafts; a
  budget of 0; the last token of a row) skips the tree machinery: one ``[B, 1]`` forward of the roots with the mask
  empty trees would get (:func:`~spiffy.arspec.stages.decode_inputs`: the same values, so the same tokens), the
  acceptance rule's root draw, and a commit that only marks the new column valid;
* a row that finishes (stop token or ``max_new_tokens``) leaves the batch: its cache row is dropped and its drafter
  detached, so later forwards only pay for the rows still decoding.

Drafters are per row, each attached on its own (a DFlash drafter reads its own batch row of the target features,
named by each :class:`~spiffy.arspec.ContextUpdate`); rows whose drafters share one model draft in one forward
(:func:`spiffy.arspec.stages.draft`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence, TypedDict

import torch
from torch import nn
from tqdm.auto import tqdm

from spiffy.arspec.captured_rounds import CapturedRounds
from spiffy.arspec.config import DEFAULT_MAX_NEW_TOKENS, ARSpecConfig
from spiffy.arspec.dllm_drafter import as_drafter
from spiffy.arspec.drafter import ContextUpdate, DFlashDrafter, Drafter
from spiffy.arspec.methods import DEFAULT_METHOD, get_method, make_rule
from spiffy.arspec.result import ARGenerationResult
from spiffy.arspec.rules import AcceptanceRule, TargetLogits
from spiffy.arspec.sampling import sample_keyed
from spiffy.arspec.stages import (
    RoundBuffers,
    StageClock,
    TargetRunner,
    build_trees,
    check_context,
    commit,
    commit_roots,
    compile_round,
    decode_inputs,
    draft,
    drop_rows,
    prefill,
    prefill_inputs,
    sync,
    tree_columns,
    verify,
)
from spiffy.arspec.tree import empty_tree
from spiffy.capture import CompileSetting, compile_fuses, resolve_compile
from spiffy.batch_invariance import batch_invariant as invariant_mode
from spiffy.errors import ConfigError
from spiffy.torch_utils import execution_device
from spiffy.sampling import SamplingConfig

__all__ = ["GenerateKeywords", "speculative_generate_batch", "ddtree_generate_batch", "prompt_lists"]

#: the draft of a row in a round that drafts nothing (read only)
EMPTY_TREE = empty_tree()


def prompt_lists(prompts: Sequence[Any] | torch.Tensor) -> list[list[int]]:
    """``B`` prompts (token-id lists or tensors, or a ``[B, P]`` tensor) as lists of ints; ConfigError when there
    are none or one is empty."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ConfigError(f"a tensor of prompts must be [B, P], got shape {tuple(prompts.shape)}; fix: pass a list "
                              "of token-id lists for prompts of different lengths")
        prompts = prompts.tolist()
    out = [[int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)] for p in prompts]
    if not out:
        raise ConfigError("no prompts given; fix: pass at least one token-id list")
    for b, p in enumerate(out):
        if not p:
            raise ConfigError(f"prompt {b} is empty; fix: every row needs at least one token")
    return out


def _per_row(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(
                f"{name} has {len(value)} entries for {n} prompts; fix: pass one per prompt (or one for all)"
            )
        return list(value)
    return [value] * n


def _row_drafters(target: nn.Module, configs: list[ARSpecConfig], drafters: list[Drafter | None]
                  ) -> tuple[list[int], list[Drafter | None]]:
    """Each row's block size and its active drafter (``None`` when the row drafts nothing). A drafter that will not
    be attached (its row drafts nothing) is checked against the target here; attached ones check on attach."""
    if len({id(d) for d in drafters if d is not None}) < sum(d is not None for d in drafters):
        raise ConfigError("the same drafter object is used by several rows; fix: pass one drafter instance per row")
    blocks: list[int] = []
    active: list[Drafter | None] = []
    for b, (cfg, d) in enumerate(zip(configs, drafters)):
        if not cfg.spec.needs_drafter:
            blocks.append(1)
            active.append(None)
            continue
        if d is None:
            raise ConfigError(f"method {cfg.method!r} needs a drafter (row {b}); fix: pass drafter=load_drafter(DIR) "
                              "(one per row) or use method='ar'")
        blocks.append(cfg.block_for(d))  # a block beyond the drafter's is a ConfigError naming it
        drafts = cfg.uses_drafter and cfg.max_new_tokens > 1
        active.append(d if drafts else None)
        if not drafts:
            d.check(target)  # a mismatched drafter is an error even when this run drafts nothing
    return blocks, active


@torch.inference_mode()
def speculative_generate_batch(
    target: nn.Module,
    drafters: Sequence[Drafter | None] | None,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    configs: ARSpecConfig | Sequence[ARSpecConfig],
    *,
    rules: Sequence[AcceptanceRule] | None = None,
    progress: bool = False,
    compile: CompileSetting = None,
) -> list[ARGenerationResult]:
    """Generate for every prompt at once; row ``b`` equals the same call with prompt ``b`` alone.

    Args:
        target: an AR target (:func:`spiffy.models.load_target`: transformers' class of Qwen3, Qwen3-MoE, Qwen2, Llama,
            Mistral; ``attn_implementation`` sdpa, eager or flex_attention).
        drafters: one :class:`~spiffy.arspec.Drafter` per row (a fresh instance each: drafters keep per-generation
            state), or ``None`` for plain AR on every row.
        prompts: ``B`` token-id lists (any lengths), or a ``[B, P]`` tensor.
        configs: one :class:`ARSpecConfig` for all rows or one per row (e.g. per-row seeds or stop tokens).
        rules: one acceptance rule per row (default: the rule each row's ``config.accept`` names).
        progress: show a tqdm bar over generated tokens on stderr.
        compile: the captured path (:mod:`spiffy.arspec.captured`: a static cache, static shapes per bucket, CUDA
            graphs on a GPU, trees built and walked on the device): ``True``, ``False`` (eager, the reference) or
            ``"auto"`` / ``None`` (:func:`spiffy.capture.resolve_compile`). Same tokens either way.
            ``"inductor"``: the target's steps compiled by TorchInductor too (fused kernels; tokens equal eager's up
            to near ties: :func:`spiffy.capture.compile_fuses`).
    Returns:
        One :class:`ARGenerationResult` per row, in order. Per-row: tokens, rounds, τ, acceptance lengths,
        histogram, nodes per round. Shared by the batch: ``seconds``, ``prefill_seconds`` and ``stage_times`` (wall
        time of the whole batch) and ``time_per_output_token`` (batch decode time / tokens of all rows).
    Raises:
        ConfigError: mismatched per-row lists, a missing drafter, empty prompts; PromptTooLongError;
        DrafterMismatchError.
    """
    rows = prompt_lists(prompts)
    n = len(rows)
    cfgs: list[ARSpecConfig] = _per_row(configs, n, "configs")
    row_rules: list[AcceptanceRule] = list(rules) if rules is not None else [make_rule(c) for c in cfgs]
    if len(row_rules) != n:
        raise ConfigError(f"rules has {len(row_rules)} entries for {n} prompts")
    blocks, active = _row_drafters(target, cfgs, _per_row(drafters, n, "drafters") if drafters is not None else [None] * n)
    for b, cfg in enumerate(cfgs):
        check_context(target, len(rows[b]), cfg.max_new_tokens)
    results = [ARGenerationResult.start(c.method, c.draft_nodes(blk), blk, len(p)) for c, blk, p in zip(cfgs, blocks, rows)]
    live = [b for b in range(n) if cfgs[b].max_new_tokens > 0]  # original row ids, in cache batch order
    if not live:
        return results
    runner = TargetRunner.for_target(target)
    clock = StageClock(runner.device)
    engine: CapturedRounds | None = None
    if resolve_compile(compile, execution_device(target.get_input_embeddings())):
        engine = CapturedRounds.start(target, [rows[b] for b in live], [cfgs[b] for b in live],
                                      [row_rules[b] for b in live],
                                      [cfgs[b].draft_nodes(blocks[b]) for b in live],
                                      max(cfgs[b].draft_depth(blocks[b]) for b in live),
                                      capture=True, feature_layers=_feature_layers([active[b] for b in live]),
                                      drafters=[active[b] for b in live], fuse=compile_fuses(compile))
    owned = engine is not None and engine.drafter is not None  # the static drafter drafts and commits every row
    buffers = RoundBuffers.allocate(len(live), 1 + max(cfgs[b].draft_nodes(blocks[b]) for b in live))
    attached: list[Drafter] = []
    bar = tqdm(total=sum(cfgs[b].max_new_tokens for b in live), unit="tok", leave=False,
               desc="spiffy " + "/".join(sorted({c.method for c in cfgs}))) if progress else None
    t_start = t_prefill = t_end = time.perf_counter()
    try:
        for b in live:
            if active[b] is not None:
                active[b].attach(target)  # type: ignore[union-attr]
                attached.append(active[b])  # type: ignore[arg-type]
        sync(runner.device)
        t_start = time.perf_counter()
        if engine is not None:
            first, pads = engine.prefill([rows[b] for b in live])
            valid = engine.static.valid[: len(live)]  # unused on the captured path (its validity stays on the device)
        else:
            ids, positions, mask, valid, pads = prefill_inputs([rows[b] for b in live], runner.device, runner.dtype)
            first = prefill(runner, ids, positions, mask, valid)
        for i, b in enumerate(live):
            token = int(sample_keyed(first[i : i + 1], [len(rows[b])], cfgs[b].sampling)[0])
            results[b].append_until_stop([token], cfgs[b].stop_token_ids, cfgs[b].max_new_tokens)
            if active[b] is not None and not owned:
                active[b].commit(ContextUpdate(rows[b], 0, range(pads[i], pads[i] + len(rows[b])), i))  # type: ignore[union-attr]
        sync(runner.device)
        t_prefill = time.perf_counter()
        if bar is not None:
            bar.update(len(live))
        live, valid = _leave_finished(runner, valid, live, results, cfgs, active, attached, engine)

        while live:
            clock.start()
            roots = [(results[b].tokens[-1], len(rows[b]) + len(results[b].tokens) - 1) for b in live]
            # drafts reach the last position to generate, as the reference loops draft (z-lab's dflash_generate):
            # a DFlash block is bidirectional, so a shorter block would change the drafts themselves
            depths = [min(cfgs[b].draft_depth(blocks[b]), cfgs[b].max_new_tokens - len(results[b].tokens))
                      for b in live]
            if engine is not None:  # the captured path: one host read per round
                if owned:  # it also commits the last round's context, so it runs in a round that drafts nothing
                    drafts = engine.draft(roots, depths)
                else:
                    drafts = [None] * len(live) if _plain_round(depths) else draft([active[b] for b in live], roots, depths)
                clock.lap("draft")
                done = engine.round(roots, drafts, clock, [] if owned else _drafter_hooks([active[b] for b in live]))
                trees = [EMPTY_TREE] * len(live)
                outcomes = None
                keep = [k for _new, k, _n in done]
            elif _plain_round(depths):  # nothing to draft (plain AR, a last token): one token, no tree machinery
                trees = [EMPTY_TREE] * len(live)
                hidden = verify(runner, decode_inputs(runner, roots, valid), [[-1]] * len(live))
                outcomes = [row_rules[b].accept(EMPTY_TREE, TargetLogits(hidden[i, :1], runner.lm_head), None, pos)
                            for i, (b, (_tok, pos)) in enumerate(zip(live, roots))]
                clock.lap("verify")
                keep = [[0]] * len(live)
                valid = commit_roots(runner, valid)
            else:
                draft_logits = draft([active[b] for b in live], roots, depths)
                clock.lap("draft")
                trees = build_trees([cfgs[b].spec for b in live], [cfgs[b] for b in live], draft_logits, roots)
                clock.lap("tree_build")
                context_len = runner.context_len
                buffers = buffers.ensure(len(live), 1 + max(t.num_nodes for t in trees))
                compiled, widths = compile_round(trees, roots, valid, runner.dtype, buffers)
                clock.lap("compile")
                hidden = verify(runner, compiled, tree_columns(trees))
                outcomes = [row_rules[b].accept(tree, TargetLogits(hidden[i, : widths[i]], runner.lm_head), lg, pos)
                            for i, (b, tree, lg, (_tok, pos)) in enumerate(zip(live, trees, draft_logits, roots))]
                clock.lap("verify")
                keep = [[0] + [int(a) + 1 for a in o.accepted] for o in outcomes]
                valid = commit(runner, valid, context_len, keep)
            for i, (b, tree, (root_tok, root_pos)) in enumerate(zip(live, trees, roots)):
                if outcomes is None:
                    new, _keep, nodes = done[i]
                else:
                    o = outcomes[i]
                    node_tokens = tree.tokens.tolist() if o.accepted else []
                    new, nodes = [node_tokens[a] for a in o.accepted] + [o.bonus], tree.num_nodes
                if active[b] is not None and not owned:
                    active[b].commit(ContextUpdate([root_tok] + new[:-1], root_pos, keep[i], i))  # type: ignore[union-attr]
                committed = results[b].append_until_stop(new, cfgs[b].stop_token_ids, cfgs[b].max_new_tokens)
                results[b].record_round(committed, nodes)
                if bar is not None:
                    bar.update(committed)
            live, valid = _leave_finished(runner, valid, live, results, cfgs, active, attached, engine)
            clock.lap("commit")
        sync(runner.device)
        t_end = time.perf_counter()
    finally:
        for d in attached:
            d.detach()
        if bar is not None:
            bar.close()
    batch_tokens = sum(len(r.tokens) for r in results)
    for b, res in enumerate(results):
        if cfgs[b].max_new_tokens > 0:
            res.finish(t_end - t_start, t_prefill - t_start, t_end - t_prefill, batch_tokens, clock.times)
    return results


def _plain_round(depths: Sequence[int]) -> bool:
    """Whether a round drafts nothing on any row (then it decodes one token per row without the tree stages)."""
    return not any(depths)


def _feature_layers(drafters: Sequence[Drafter | None]) -> list[int]:
    """The target layers the rows' drafters read (DFlash features), which a captured step must record."""
    return sorted({int(i) for d in drafters if isinstance(d, DFlashDrafter) for i in d.model.target_layer_ids})


def _drafter_hooks(drafters: Sequence[Drafter | None]) -> list[Any]:
    """The feature hooks of the rows' attached DFlash drafters (a captured step hands them its layer outputs)."""
    return [d.feature_hooks for d in drafters if isinstance(d, DFlashDrafter) and d.feature_hooks is not None]


def _leave_finished(runner: TargetRunner, valid: torch.Tensor, live: list[int], results: list[ARGenerationResult],
                    configs: list[ARSpecConfig], active: list[Drafter | None], attached: list[Drafter],
                    engine: CapturedRounds | None = None) -> tuple[list[int], torch.Tensor]:
    """Remove the rows that stopped or reached ``max_new_tokens`` from the cache batch and detach their drafters."""
    done = [results[b].stopped or len(results[b].tokens) >= configs[b].max_new_tokens for b in live]
    if not any(done):
        return live, valid
    for b, finished in zip(live, done):
        d = active[b]
        if finished and d is not None:
            d.detach()
            attached.remove(d)
    kept = [i for i, finished in enumerate(done) if not finished]
    if engine is not None:
        engine.keep_rows(kept)
        return [live[i] for i in kept], valid
    return [live[i] for i in kept], drop_rows(runner, valid, kept)


class GenerateKeywords(TypedDict, total=False):
    """The keyword arguments :func:`ddtree_generate_batch` and :func:`~spiffy.arspec.ddtree_generate` share."""

    method: str
    budget: int | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | Sequence[int]
    stop_token_ids: int | Sequence[int] | None
    block_size: int | None
    progress: bool
    compile: CompileSetting
    batch_invariant: bool


def ddtree_generate_batch(
    target: nn.Module,
    drafter: Any,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    *,
    method: str = DEFAULT_METHOD.name,
    budget: int | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | Sequence[int] = 0,
    stop_token_ids: int | Sequence[int] | None = None,
    block_size: int | None = None,
    progress: bool = False,
    compile: CompileSetting = None,
    batch_invariant: bool = False,
) -> list[ARGenerationResult]:
    """Keyword-argument entry point: ``prompts`` a list of token-id lists, ``seed`` one integer for every row or one
    per row; row ``b`` equals ``ddtree_generate(..., prompts[b], seed=seeds[b])``.

    Args:
        drafter: a drafter model (:class:`~spiffy.models.dflash.DFlashDraftModel` or a dLLM: wrapped once per row by
            :func:`~spiffy.arspec.as_drafter`), one :class:`~spiffy.arspec.Drafter` per row, or ``None`` (methods
            without a drafter).
        method: a name of :data:`spiffy.arspec.methods.METHODS`; budget: tree nodes per round (default
            :data:`spiffy.arspec.config.DEFAULT_BUDGET`); the rest as :class:`ARSpecConfig` and
            :class:`~spiffy.sampling.SamplingConfig` name them; batch_invariant: decode in
            :func:`spiffy.batch_invariant` mode (tree nodes and batched rows bitwise equal to AR's one-row forwards in
            every dtype; AR itself decoded in the same mode).
    """
    rows = prompt_lists(prompts)
    seeds = _per_row(list(seed) if isinstance(seed, (list, tuple)) else int(seed), len(rows), "seed")
    knobs: dict[str, Any] = {} if budget is None else {"budget": int(budget)}
    configs = [
        ARSpecConfig(method=method, max_new_tokens=int(max_new_tokens), stop_token_ids=stop_token_ids,  # type: ignore[arg-type]
                     block_size=block_size, **knobs,
                     sampling=SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                                             seed=int(s)))
        for s in seeds
    ]
    drafters: list[Drafter | None] | None = None
    if drafter is not None and get_method(method).needs_drafter:
        drafters = list(drafter) if isinstance(drafter, (list, tuple)) else [as_drafter(drafter, block_size) for _ in rows]
    with invariant_mode(batch_invariant, model=target):
        return speculative_generate_batch(target, drafters, rows, configs, progress=progress, compile=compile)
