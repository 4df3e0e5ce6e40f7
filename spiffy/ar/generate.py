"""AR speculative decoding of a Qwen3 target: DDTree, vanilla DFlash and plain AR on one code path (SPEC §7).

One round, starting from the committed context (target K/V cache of length ``C``) and the pending *bonus* token
(the last generated token, not yet fed to the target, at position ``p0``):

1. **draft**: the DFlash drafter reads the target features of the rows committed since its last call and the block
   ``[bonus, MASK x L]`` and returns per-depth logits ``[L, V]`` (``L = min(block_size - 1, tokens left - 1)``);
2. **tree build**: DDTree (:func:`~spiffy.ar.tree.build_ddtree`, the optimal ``budget``-node tree), the DFlash chain
   (argmax per depth) or nothing (plain AR);
3. **compile**: ``[root(bonus), nodes...]`` through :func:`spiffy.verify.compile_tree` (the vectorised tree path of the shared backend) (node position = ``p0`` +
   depth; every row sees the committed cache, its ancestors and itself);
4. **verify**: ONE target forward over all rows on top of the cache; the target's token at a node is drawn lazily
   from that node's logits by the decoding rule (greedy, or position-keyed sampling, :mod:`spiffy.ar.sampling`),
   and :func:`spiffy.verify.follow` walks from the root while the target's token is a child;
5. **commit**: the accepted path plus the first unmatched target token (the new bonus) are emitted; the target's
   K/V of the accepted rows are moved to the front of the appended window and the rest cropped; the features of
   the accepted rows become the drafter's new context.

With no drafter and no nodes, step 4 is exactly one AR decoding step, so the three methods share kernels, caches,
sampling and timing, and all of them produce the AR output token for token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from spiffy.ar.drafter import DFlashDraftModel, TargetFeatureHooks, check_compatible
from spiffy.ar.sampling import sample_tokens, validate_sampling
from spiffy.ar.tree import DraftTree, build_chain, build_ddtree, empty_tree
from spiffy.errors import ConfigError, PromptTooLongError
from spiffy.verify import compile_tree, follow

__all__ = ["ARGenerationResult", "ddtree_generate", "METHODS", "DEFAULT_BUDGET"]

METHODS = ("ddtree", "dflash", "ar")
DEFAULT_BUDGET = 64
STAGES = ("draft", "tree_build", "compile", "verify", "commit")


@dataclass
class ARGenerationResult:
    """Output and statistics of :func:`ddtree_generate`.

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
        method, budget, block_size: the configuration that ran.
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


# --------------------------------------------------------------------------------------------------- helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Accumulates per-stage wall time (synchronising the device so GPU work is attributed correctly)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times = {s: 0.0 for s in STAGES}
        self._t = 0.0

    def start(self) -> None:
        _sync(self.device)
        self._t = time.perf_counter()

    def lap(self, stage: str) -> None:
        _sync(self.device)
        now = time.perf_counter()
        self.times[stage] += now - self._t
        self._t = now


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


def _stop_set(stop_token_ids: int | Iterable[int] | None) -> set[int]:
    if stop_token_ids is None:
        return set()
    if isinstance(stop_token_ids, int):
        return {int(stop_token_ids)}
    return {int(t) for t in stop_token_ids}


def _target_parts(target: nn.Module) -> tuple[nn.Module, nn.Module]:
    backbone = getattr(target, "model", None)
    head = getattr(target, "lm_head", None)
    if backbone is None or head is None:
        raise ConfigError(
            f"{type(target).__name__} has no .model/.lm_head; fix: pass a transformers Qwen3ForCausalLM target"
        )
    impl = getattr(target.config, "_attn_implementation", None)
    if impl is not None and "flash" in str(impl):
        raise ConfigError(
            f"the target uses attn_implementation={impl!r}, which cannot take the tree attention mask; "
            "fix: load the target with attn_implementation='sdpa' (or 'eager')"
        )
    return backbone, head


def _compact_cache(cache: Any, start: int, rows: Sequence[int]) -> None:
    """Keep cached positions ``[0, start)`` and ``start + rows`` (in that order); drop the rest of the window."""
    total = int(cache.get_seq_length())
    window = total - start
    keep = len(rows)
    if list(rows) != list(range(keep)):
        cpu_src = torch.tensor([start + r for r in rows], dtype=torch.long)
        on_device: dict[torch.device, torch.Tensor] = {}
        for layer in cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if t is None or t.numel() == 0:
                    continue
                src = on_device.setdefault(t.device, cpu_src.to(t.device))
                t[..., start : start + keep, :] = t.index_select(-2, src)
    if window > keep:
        cache.crop(-(window - keep))  # transformers 5.x: a negative count of positions to drop


def _new_cache(target: nn.Module) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


# ---------------------------------------------------------------------------------------------------- public


@torch.inference_mode()
def ddtree_generate(
    target: nn.Module,
    drafter: DFlashDraftModel | None,
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

    Args:
        target: a transformers ``Qwen3ForCausalLM`` (``attn_implementation`` sdpa or eager).
        drafter: its :class:`~spiffy.ar.drafter.DFlashDraftModel` (ignored, may be ``None``, for ``method="ar"``).
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
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; fix: use one of {', '.join(METHODS)}")
    validate_sampling(float(temperature), float(top_p), int(top_k))
    if budget is None:
        budget = DEFAULT_BUDGET
    if int(budget) < 0:
        raise ConfigError(f"budget must be >= 0, got {budget}; fix: pass a node budget such as 64 (0 = no drafts)")
    budget = int(budget)
    if int(max_new_tokens) < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    max_new_tokens = int(max_new_tokens)
    if method != "ar":
        if drafter is None:
            raise ConfigError(f"method {method!r} needs a DFlash drafter; fix: pass drafter=load_drafter(DIR) or use method='ar'")
        check_compatible(drafter, target)
        block = int(block_size if block_size is not None else drafter.block_size)
        if block < 1:
            raise ConfigError(f"block_size must be >= 1, got {block}")
    else:
        block = 1
    # DDTree with budget 0 never drafts: run it without the drafter (no feature hooks, no pending context)
    use_drafter = method == "dflash" or (method == "ddtree" and budget > 0)
    backbone, lm_head = _target_parts(target)
    device = target.get_input_embeddings().weight.device
    dtype = target.get_input_embeddings().weight.dtype
    if use_drafter and drafter.device != device:  # type: ignore[union-attr]
        raise ConfigError(
            f"the drafter is on {drafter.device} but the target on {device}; "  # type: ignore[union-attr]
            "fix: load both on the same device (load_drafter(..., device=...))"
        )
    prompt = _as_prompt(input_ids, device)
    n_prompt = int(prompt.shape[1])
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and n_prompt + max_new_tokens > int(limit):
        raise PromptTooLongError(
            f"prompt ({n_prompt}) + max_new_tokens ({max_new_tokens}) exceeds the target's context of {limit}; "
            "fix: shorten the prompt or lower max_new_tokens"
        )
    stops = _stop_set(stop_token_ids)
    samp = dict(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=int(seed))
    clock = _Clock(device)
    result = ARGenerationResult(
        tokens=[], rounds=0, tau=0.0, acceptance_lengths=[], histogram=[0] * (block + 1),
        stage_times=dict(clock.times), seconds=0.0, prefill_seconds=0.0, time_per_output_token=0.0,
        method=method, budget=budget if method == "ddtree" else (block - 1 if method == "dflash" else 0),
        block_size=block, num_prompt_tokens=n_prompt,
    )
    if max_new_tokens == 0:
        return result

    hooks = TargetFeatureHooks(target, drafter.target_layer_ids) if use_drafter else None  # type: ignore[union-attr]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens, desc=f"spiffy {method}", unit="tok", leave=False)
    try:
        _sync(device)
        t_start = time.perf_counter()
        cache = _new_cache(target)
        out = backbone(
            input_ids=prompt,
            position_ids=torch.arange(n_prompt, device=device).view(1, -1),
            past_key_values=cache,
            use_cache=True,
        )
        first_logits = lm_head(out.last_hidden_state[:, -1])
        tokens: list[int] = [int(sample_tokens(first_logits, [n_prompt], **samp)[0])]
        pending = hooks.features() if hooks is not None else None  # [1, n, nT*H] context not yet drafted on
        dcache = drafter.new_cache() if use_drafter else None  # type: ignore[union-attr]
        _sync(device)
        t_prefill = time.perf_counter()
        result.prefill_seconds = t_prefill - t_start
        if bar is not None:
            bar.update(1)
        stopped = tokens[0] in stops
        mask_id = drafter.mask_token_id if use_drafter else 0  # type: ignore[union-attr]
        embed = target.get_input_embeddings()

        while not stopped and len(tokens) < max_new_tokens:
            clock.start()
            root_tok = tokens[-1]
            root_pos = n_prompt + len(tokens) - 1
            ctx_len = int(cache.get_seq_length())
            depth_limit = min(block - 1, max_new_tokens - len(tokens) - 1) if use_drafter else 0
            wants_tree = depth_limit > 0

            # 1. draft
            draft_logits = None
            if wants_tree:
                n_ctx = int(pending.shape[1])  # type: ignore[union-attr]
                block_ids = torch.full((1, depth_limit + 1), mask_id, dtype=torch.long, device=device)
                block_ids[0, 0] = root_tok
                positions = torch.arange(root_pos - n_ctx, root_pos + depth_limit + 1, device=device).view(1, -1)
                hidden = drafter(pending, embed(block_ids), positions, past_key_values=dcache)  # type: ignore[misc]
                draft_logits = drafter.compute_logits(hidden[0, 1:], lm_head)  # type: ignore[union-attr]
                pending = pending[:, :0]  # type: ignore[index]
            clock.lap("draft")

            # 2. tree build
            if draft_logits is None:
                tree: DraftTree = empty_tree()
            elif method == "dflash":
                tree = build_chain(draft_logits)
            else:
                work = draft_logits if draft_logits.dtype == torch.float64 else draft_logits.float()
                if temperature > 0:
                    work = work / float(temperature)
                tree = build_ddtree(torch.log_softmax(work, dim=-1), budget)
            clock.lap("tree_build")

            # 3. compile
            n_nodes = tree.num_nodes
            node_tok = tree.tokens.tolist()
            node_dep = tree.depths.tolist()
            compiled = compile_tree(
                tree.tokens,
                tree.depths + root_pos,
                tree.parents,
                context_len=ctx_len,
                dtype=dtype,
                device=device,
                prefix_rows=(torch.tensor([root_tok]), torch.tensor([root_pos])),
            )
            clock.lap("compile")

            # 4. verify: one target forward, then walk by the target's own decoding rule
            out = backbone(
                input_ids=compiled.input_ids,
                position_ids=compiled.position_ids,
                attention_mask=compiled.attention_mask,
                past_key_values=cache,
                use_cache=True,
            )
            rows_hidden = out.last_hidden_state[0]  # [1 + N, H]
            lookup = tree.children_lookup()

            def next_token(node: int) -> int:
                row = 0 if node < 0 else node + 1
                depth = 0 if node < 0 else node_dep[node]
                logits = lm_head(rows_hidden[row : row + 1])
                return int(sample_tokens(logits, [root_pos + depth + 1], **samp)[0])

            accepted, bonus = follow(-1, next_token, lambda node, tok: lookup.get((node, tok)))
            clock.lap("verify")

            # 5. commit
            new = [node_tok[n] for n in accepted] + [int(bonus)]
            rows = [0] + [n + 1 for n in accepted]
            _compact_cache(cache, ctx_len, rows)
            if hooks is not None:
                feats = hooks.features()[:, rows]
                pending = feats if pending is None or pending.shape[1] == 0 else torch.cat([pending, feats], dim=1)
                hooks.clear()
            committed = 0
            for t in new:
                tokens.append(t)
                committed += 1
                if t in stops:
                    stopped = True
                    break
                if len(tokens) >= max_new_tokens:
                    break
            result.rounds += 1
            result.acceptance_lengths.append(committed)
            result.nodes_per_round.append(n_nodes)
            if committed >= len(result.histogram):
                result.histogram.extend([0] * (committed + 1 - len(result.histogram)))
            result.histogram[committed] += 1
            if bar is not None:
                bar.update(committed)
            clock.lap("commit")

        _sync(device)
        t_end = time.perf_counter()
    finally:
        if hooks is not None:
            hooks.remove()
        if bar is not None:
            bar.close()

    result.tokens = tokens
    result.stopped = stopped
    result.seconds = t_end - t_start
    result.stage_times = dict(clock.times)
    result.tau = float(sum(result.acceptance_lengths) / result.rounds) if result.rounds else 0.0
    result.time_per_output_token = (t_end - t_prefill) / max(1, len(tokens))
    return result
