"""Batched AR speculative decoding: several prompts share every target forward (plain AR, DFlash, DDTree).

Each batch row is its own generation: its own drafter state, draft tree, acceptance and stop condition; the target
verifies every row's ``[root, nodes...]`` in ONE forward ``[B, R]`` (rows padded to the longest tree) with a
per-row ancestor mask (:func:`spiffy.verify.compile_tree_rows`). Row ``b`` of the output equals that prompt decoded
alone by :func:`~spiffy.arspec.speculative_generate` (and so plain AR decoding), at any temperature, with the row's
own seed: the position-keyed noise depends on the row's seed and absolute positions only.

The target's K/V cache is one rectangular ``DynamicCache`` of ``B`` rows with a per-row validity mask ``[B, C]``:

* prompts are left padded; a row's position ids count from its first real token, its padding columns are invalid;
* after a round, row ``b`` keeps its root and accepted nodes (``k_b`` rows) at the front of the appended window,
  the window is cropped to ``max_b k_b`` and the ``max - k_b`` trailing columns of row ``b`` are marked invalid
  (holes: never seen again; position ids are explicit, so holes do not shift anything);
* a row that finishes (stop token or ``max_new_tokens``) leaves the batch: its cache row is dropped, so later
  forwards only pay for the rows still decoding.

Drafters are per row. :class:`~spiffy.arspec.DFlashDrafter` rows share one set of target feature hooks and read
their own batch row; any other :class:`~spiffy.arspec.Drafter` is attached on its own (standalone drafters never
look at target rows). Rows whose drafters share one model draft in one drafter forward per round
(:func:`spiffy.arspec.batch_draft.draft_rows`); other drafters propose row by row.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from spiffy.arspec.batch_draft import draft_rows
from spiffy.arspec.config import ARSpecConfig
from spiffy.arspec.drafter import ContextUpdate, DFlashDrafter, Drafter
from spiffy.arspec.generate import DEFAULT_BUDGET, ARGenerationResult, _append_until_stop, _check_context, make_rule
from spiffy.arspec.rules import AcceptanceRule, TargetLogits
from spiffy.arspec.sampling import sample_keyed
from spiffy.arspec.stages import StageClock, TargetRunner, build_tree, cache_tensors_with_index, sync
from spiffy.errors import ConfigError
from spiffy.models.dflash import DFlashDraftModel, TargetFeatureHooks
from spiffy.sampling import SamplingConfig
from spiffy.verify import compile_tree_rows

__all__ = ["speculative_generate_batch", "ddtree_generate_batch"]


def _prompts(prompts: Sequence[Any]) -> list[list[int]]:
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


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device),
                       torch.full((), torch.finfo(dtype).min, dtype=dtype, device=visible.device))


def _prefill(runner: TargetRunner, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Left-padded prompt forward ``[B, P]`` into the empty cache.

    Returns ``(logits [B, V] of each row's first new token, valid [B, P] bool, pads)``.
    """
    dev = runner.device
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, pads[b]:] = torch.tensor(p, dtype=torch.long, device=dev)
    cols = torch.arange(width, device=dev)
    pad_t = torch.tensor(pads, dtype=torch.long, device=dev)
    valid = cols.view(1, -1) >= pad_t.view(-1, 1)
    visible = (cols.view(-1, 1) >= cols.view(1, -1)).unsqueeze(0) & valid.unsqueeze(1)
    visible = visible | torch.eye(width, dtype=torch.bool, device=dev).unsqueeze(0)  # padding rows see themselves
    out = runner.backbone(
        input_ids=ids,
        position_ids=(cols.view(1, -1) - pad_t.view(-1, 1)).clamp(min=0),
        attention_mask=_additive(visible, runner.dtype).unsqueeze(1),
        past_key_values=runner.cache,
        use_cache=True,
    )
    return runner.lm_head(out.last_hidden_state[:, -1]), valid, pads


def _commit_rows(cache: Any, valid: torch.Tensor, context_len: int, keep: list[list[int]]) -> torch.Tensor:
    """Move each row's kept verification rows to the front of the appended window, crop the window to the longest
    kept list, and return the validity mask ``[B, context_len + W]`` (each row's trailing holes ``False``)."""
    width = max(len(k) for k in keep)
    dev = valid.device
    src = torch.tensor([[context_len + r for r in k] + [context_len + k[0]] * (width - len(k)) for k in keep],
                       dtype=torch.long)
    for t, idx in cache_tensors_with_index(cache, src):
        index = idx.view(idx.shape[0], 1, width, 1).expand(t.shape[0], t.shape[1], width, t.shape[3])
        t[:, :, context_len : context_len + width] = t.gather(2, index)
    extra = int(cache.get_seq_length()) - (context_len + width)
    if extra > 0:
        cache.crop(-extra)  # transformers 5.x: a negative count of positions to drop
    lengths = torch.tensor([len(k) for k in keep], device=dev)
    new = torch.arange(width, device=dev).view(1, -1) < lengths.view(-1, 1)
    return torch.cat([valid[:, :context_len], new], dim=1)


@torch.inference_mode()
def speculative_generate_batch(
    target: nn.Module,
    drafters: Sequence[Drafter | None] | None,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    configs: ARSpecConfig | Sequence[ARSpecConfig],
    *,
    rules: Sequence[AcceptanceRule] | None = None,
) -> list[ARGenerationResult]:
    """Generate for every prompt at once; row ``b`` equals ``speculative_generate(target, drafters[b], prompts[b],
    configs[b])``.

    Args:
        target: a transformers ``Qwen3ForCausalLM`` (``attn_implementation`` sdpa or eager).
        drafters: one :class:`~spiffy.arspec.Drafter` per row (a fresh instance each: drafters keep per-generation
            state), or ``None`` for plain AR on every row.
        prompts: ``B`` token-id lists (any lengths), or a ``[B, P]`` tensor.
        configs: one :class:`ARSpecConfig` for all rows or one per row (e.g. per-row seeds or stop tokens).
        rules: one acceptance rule per row (default: the rule each row's ``config.accept`` names).
    Returns:
        One :class:`ARGenerationResult` per row, in order. Per-row: tokens, rounds, τ, acceptance lengths,
        histogram, nodes per round. Shared by the batch: ``seconds``, ``prefill_seconds`` and ``stage_times`` (wall
        time of the whole batch) and ``time_per_output_token`` (batch decode time / tokens of all rows).
    Raises:
        ConfigError: mismatched per-row lists, a missing drafter, empty prompts; PromptTooLongError;
        DrafterMismatchError.
    """
    rows = _prompts(prompts)
    n = len(rows)
    cfgs: list[ARSpecConfig] = _per_row(configs, n, "configs")
    drafts: list[Drafter | None] = _per_row(drafters, n, "drafters") if drafters is not None else [None] * n
    if drafters is not None and len({id(d) for d in drafts if d is not None}) < sum(d is not None for d in drafts):
        raise ConfigError("the same drafter object is used by several rows; fix: pass one drafter instance per row")
    row_rules: list[AcceptanceRule] = list(rules) if rules is not None else [make_rule(c) for c in cfgs]
    if len(row_rules) != n:
        raise ConfigError(f"rules has {len(row_rules)} entries for {n} prompts")
    blocks: list[int] = []
    for b, (cfg, d) in enumerate(zip(cfgs, drafts)):
        if cfg.method != "ar" and d is None:
            raise ConfigError(f"row {b}: method {cfg.method!r} needs a drafter; fix: pass one drafter per row")
        blocks.append(cfg.block_for(d))
        _check_context(target, len(rows[b]), cfg.max_new_tokens)
    active_drafters = [d if c.uses_drafter else None for d, c in zip(drafts, cfgs)]
    runner = TargetRunner.for_target(target)
    clock = StageClock(runner.device)
    results = [
        ARGenerationResult(
            tokens=[], rounds=0, tau=0.0, acceptance_lengths=[], histogram=[0] * (blk + 1), stage_times={},
            seconds=0.0, prefill_seconds=0.0, time_per_output_token=0.0, method=c.method,
            budget=c.reported_budget(blk), block_size=blk, num_prompt_tokens=len(p),
        )
        for c, blk, p in zip(cfgs, blocks, rows)
    ]
    live = [b for b in range(n) if cfgs[b].max_new_tokens > 0]  # original row ids, in cache batch order
    if not live:
        return results
    hooks: TargetFeatureHooks | None = None
    attached: list[Drafter] = []
    t_start = t_prefill = t_end = time.perf_counter()
    try:
        for i, b in enumerate(live):
            d = active_drafters[b]
            if isinstance(d, DFlashDrafter):
                if hooks is None:
                    hooks = TargetFeatureHooks(target, d.model.target_layer_ids)
                elif list(hooks.layer_ids) != list(d.model.target_layer_ids):
                    raise ConfigError(
                        "batched DFlash rows must share the drafter's target layers; fix: one drafter model for all rows"
                    )
                d.attach_row(target, hooks, i)
                attached.append(d)
            elif d is not None:
                d.attach(target)
                attached.append(d)
        sync(runner.device)
        t_start = time.perf_counter()
        first, valid, pads = _prefill(runner, [rows[b] for b in live])
        for i, b in enumerate(live):
            results[b].tokens.append(int(sample_keyed(first[i : i + 1], [len(rows[b])], cfgs[b].sampling)[0]))
            if active_drafters[b] is not None:
                active_drafters[b].commit(ContextUpdate(rows[b], 0, range(pads[i], pads[i] + len(rows[b]))))
        if hooks is not None:
            hooks.clear()
        sync(runner.device)
        t_prefill = time.perf_counter()
        done = [results[b].tokens[0] in cfgs[b].stop_token_ids or cfgs[b].max_new_tokens <= 1 for b in live]
        stopped = {b: results[b].tokens[0] in cfgs[b].stop_token_ids for b in live}
        live, valid = _drop_finished(runner.cache, valid, live, done, active_drafters)

        while live:
            clock.start()
            roots, trees, depths = [], [], []
            for b in live:
                res, cfg = results[b], cfgs[b]
                roots.append((res.tokens[-1], len(rows[b]) + len(res.tokens) - 1))
                depths.append(min(cfg.draft_depth(blocks[b]), cfg.max_new_tokens - len(res.tokens) - 1))
            draft_logits = draft_rows([active_drafters[b] for b in live], roots, depths)
            clock.lap("draft")
            for b, logits, (_tok, pos) in zip(live, draft_logits, roots):
                trees.append(build_tree(cfgs[b], logits, pos))
            clock.lap("tree_build")
            context_len = int(runner.cache.get_seq_length())
            compiled, widths = compile_tree_rows(
                [(t.tokens, t.depths + pos, t.parents) for t, (_tok, pos) in zip(trees, roots)],
                [(torch.tensor([tok]), torch.tensor([pos])) for tok, pos in roots],
                valid, dtype=runner.dtype,
            )
            clock.lap("compile")
            hidden = runner.backbone(
                input_ids=compiled.input_ids, position_ids=compiled.position_ids,
                attention_mask=compiled.attention_mask, past_key_values=runner.cache, use_cache=True,
            ).last_hidden_state
            outcomes = [
                row_rules[b].accept(tree, TargetLogits(hidden[i, : widths[i]], runner.lm_head), logits, pos)
                for i, (b, tree, logits, (_tok, pos)) in enumerate(zip(live, trees, draft_logits, roots))
            ]
            clock.lap("verify")
            keep = [[0] + [int(a) + 1 for a in o.accepted] for o in outcomes]
            valid = _commit_rows(runner.cache, valid, context_len, keep)
            done = []
            for i, (b, tree, o, (root_tok, root_pos)) in enumerate(zip(live, trees, outcomes, roots)):
                node_tokens = tree.tokens.tolist()
                new = [node_tokens[a] for a in o.accepted] + [o.bonus]
                if active_drafters[b] is not None:
                    active_drafters[b].commit(ContextUpdate([root_tok] + new[:-1], root_pos, keep[i]))
                committed, stop = _append_until_stop(results[b].tokens, new, cfgs[b])
                results[b].record_round(committed, tree.num_nodes)
                stopped[b] = stop
                done.append(stop or len(results[b].tokens) >= cfgs[b].max_new_tokens)
            if hooks is not None:
                hooks.clear()
            live, valid = _drop_finished(runner.cache, valid, live, done, active_drafters)
            clock.lap("commit")
        sync(runner.device)
        t_end = time.perf_counter()
    finally:
        for d in attached:
            d.detach()
        if hooks is not None:
            hooks.remove()
    total_tokens = sum(len(r.tokens) for r in results)
    for b, res in enumerate(results):
        if cfgs[b].max_new_tokens <= 0:
            continue
        res.stopped = bool(stopped.get(b, False))
        res.seconds = t_end - t_start
        res.prefill_seconds = t_prefill - t_start
        res.stage_times = dict(clock.times)
        res.tau = float(sum(res.acceptance_lengths) / res.rounds) if res.rounds else 0.0
        res.time_per_output_token = (t_end - t_prefill) / max(1, total_tokens)
    return results


def _drop_finished(cache: Any, valid: torch.Tensor, live: list[int], done: list[bool],
                   drafters: list[Drafter | None]) -> tuple[list[int], torch.Tensor]:
    """Remove finished rows from the cache batch; renumber the remaining DFlash rows."""
    if not any(done):
        return live, valid
    keep = [i for i, d in enumerate(done) if not d]
    live = [live[i] for i in keep]
    if keep:
        idx = torch.tensor(keep, dtype=torch.long, device=valid.device)
        cache.batch_select_indices(idx)
        valid = valid[idx]
    for i, b in enumerate(live):
        d = drafters[b]
        if isinstance(d, DFlashDrafter):
            d.batch_row = i
    return live, valid


def ddtree_generate_batch(
    target: nn.Module,
    drafter: DFlashDraftModel | Sequence[Drafter] | None,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    *,
    method: str = "ddtree",
    budget: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | Sequence[int] = 0,
    stop_token_ids: int | Sequence[int] | None = None,
    block_size: int | None = None,
) -> list[ARGenerationResult]:
    """Batched :func:`~spiffy.arspec.ddtree_generate`: the same arguments, ``prompts`` a list of token-id lists, and
    ``seed`` one integer for every row or one per row. Row ``b`` equals ``ddtree_generate(..., prompts[b],
    seed=seeds[b])``. A :class:`~spiffy.models.dflash.DFlashDraftModel` is wrapped once per row.
    """
    rows = _prompts(prompts)
    seeds = _per_row(list(seed) if isinstance(seed, (list, tuple)) else int(seed), len(rows), "seed")
    configs = [
        ARSpecConfig(
            method=method, tree_budget=DEFAULT_BUDGET if budget is None else int(budget),
            max_new_tokens=int(max_new_tokens), stop_token_ids=stop_token_ids,  # type: ignore[arg-type]
            block_size=block_size,
            sampling=SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=int(s)),
        )
        for s in seeds
    ]
    drafters: list[Drafter | None] | None
    if method == "ar":
        drafters = None
    elif isinstance(drafter, DFlashDraftModel):
        drafters = [DFlashDrafter(drafter, block_size) for _ in rows]
        drafters[0].check(target)  # type: ignore[union-attr]
    elif drafter is None:
        raise ConfigError(f"method {method!r} needs a drafter; fix: pass drafter=load_drafter(DIR) or use method='ar'")
    else:
        drafters = list(drafter)
    return speculative_generate_batch(target, drafters, rows, configs)
