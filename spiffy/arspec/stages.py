"""The stages of one AR speculative round, each a small function, and the clock that times them.

One round, starting from the committed context (target K/V cache of length ``C``) and the pending root (bonus)
token at position ``p0``:

1. :func:`draft`: the drafter proposes ``[L, V]`` logits for positions ``p0 + 1 .. p0 + L``;
2. :func:`build_tree`: DDTree (:func:`~spiffy.arspec.tree.build_ddtree`, the optimal ``tree_budget``-node tree),
   the DFlash chain (argmax per depth) or nothing (plain AR);
3. :func:`compile_round`: ``[root, nodes...]`` through :func:`spiffy.verify.compile_tree` (node position = ``p0`` +
   depth; every row sees the committed cache, its ancestors and itself);
4. :func:`verify`: ONE target forward over all rows on top of the cache, giving lazy per-node target logits;
   the acceptance rule then walks the tree;
5. :func:`commit`: the target's K/V of the accepted rows are moved to the front of the appended window and the
   rest cropped (the drafter is told the same rows).

The prefill (:func:`prefill`) is the round-zero forward over the prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from spiffy.arspec.config import ARSpecConfig
from spiffy.arspec.drafter import Drafter
from spiffy.arspec.rules import TargetLogits
from spiffy.arspec.sampling import tempered
from spiffy.arspec.selfselect import build_sampled_tree, proposal_probs, sample_drafts
from spiffy.arspec.tree import DraftTree, build_chain, build_ddtree, empty_tree
from spiffy.errors import ConfigError
from spiffy.models.cache import hf_cache
from spiffy.torch_utils import execution_device
from spiffy.verify import CompiledDraft, compile_tree

__all__ = [
    "STAGES",
    "StageClock",
    "TargetRunner",
    "prefill",
    "draft",
    "build_tree",
    "compile_round",
    "verify",
    "commit",
    "compact_cache",
    "sync",
]

STAGES: tuple[str, ...] = ("draft", "tree_build", "compile", "verify", "commit")


def sync(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock laps are attributed to the stage that caused them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageClock:
    """Accumulates per-stage wall time (synchronising the device so GPU work is attributed correctly)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times = {s: 0.0 for s in STAGES}
        self._t = 0.0

    def start(self) -> None:
        sync(self.device)
        self._t = time.perf_counter()

    def lap(self, stage: str) -> None:
        sync(self.device)
        now = time.perf_counter()
        self.times[stage] += now - self._t
        self._t = now


@dataclass
class TargetRunner:
    """The target split into the parts the stages call, plus its K/V cache for one generation.

    Attributes:
        backbone: ``target.model`` (hidden states); lm_head: ``target.lm_head``.
        device, dtype: of the target's embeddings (the attention mask is built in this dtype).
        cache: a transformers ``DynamicCache`` holding exactly the committed context.
    """

    backbone: nn.Module
    lm_head: nn.Module
    device: torch.device
    dtype: torch.dtype
    cache: Any

    @classmethod
    def for_target(cls, target: nn.Module) -> "TargetRunner":
        """Split ``target`` (a transformers ``Qwen3ForCausalLM`` with sdpa or eager attention); fresh cache."""
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
        embed = target.get_input_embeddings()  # inputs and masks go to its device (its weight may be offloaded)
        return cls(backbone, head, execution_device(embed), embed.weight.dtype, DynamicCache(config=target.config))

    @property
    def context_len(self) -> int:
        """Committed positions in the cache."""
        return int(self.cache.get_seq_length())


def prefill(runner: TargetRunner, prompt: torch.Tensor) -> torch.Tensor:
    """Forward the prompt ``[1, P]`` into the empty cache; returns ``[1, V]`` logits of the first new token."""
    n_prompt = int(prompt.shape[1])
    out = runner.backbone(
        input_ids=prompt,
        position_ids=torch.arange(n_prompt, device=runner.device).view(1, -1),
        **hf_cache(runner.cache),
        use_cache=True,
    )
    return runner.lm_head(out.last_hidden_state[:, -1])


def draft(drafter: Drafter | None, root_token: int, root_position: int, depth: int) -> torch.Tensor | None:
    """``[depth, V]`` drafter logits for the positions after the root, or ``None`` when nothing is drafted."""
    if drafter is None or depth <= 0:
        return None
    return drafter.propose(root_token, root_position, depth)


def build_tree(config: ARSpecConfig, draft_logits: torch.Tensor | None, root_position: int = 0) -> DraftTree:
    """The draft structure of one round from the drafter's ``[L, V]`` logits.

    ``dflash`` / ``deer``: the argmax chain, or (:attr:`ARSpecConfig.samples_drafts`: rejection rule at T > 0) one
    draft sampled from the drafter; ``specdiff``: ``drafts`` joint drafts sampled from the drafter's position-wise
    marginals and merged into one tree (:mod:`spiffy.arspec.selfselect`; draws keyed by ``root_position``);
    ``ddtree``: the optimal ``tree_budget``-node tree of the drafter's distribution at the sampling temperature
    (:func:`~spiffy.arspec.sampling.tempered`); no logits: an empty tree (plain AR).
    """
    if draft_logits is None:
        return empty_tree()
    if config.samples_drafts:
        probs = proposal_probs(draft_logits, config.sampling)
        count = int(config.drafts) if config.method == "specdiff" else 1
        return build_sampled_tree(probs, sample_drafts(probs, count, config.sampling, root_position))
    if config.method != "ddtree":
        return build_chain(draft_logits)
    scores = tempered(draft_logits, float(config.sampling.temperature))
    return build_ddtree(torch.log_softmax(scores, dim=-1), int(config.tree_budget))


def compile_round(
    runner: TargetRunner, tree: DraftTree, root_token: int, root_position: int, root_rows: tuple[torch.Tensor, torch.Tensor]
) -> CompiledDraft:
    """Model inputs ``[1, 1 + N]`` for ``[root, nodes...]`` with the tree mask over ``[cache ; rows]``.

    ``root_rows`` is a pair of ``[1]`` long CPU buffers reused across rounds (filled here with the root).
    """
    root_rows[0][0] = int(root_token)
    root_rows[1][0] = int(root_position)
    return compile_tree(
        tree.tokens,
        tree.depths + root_position,
        tree.parents,
        context_len=runner.context_len,
        dtype=runner.dtype,
        device=runner.device,
        prefix_rows=root_rows,
        max_depth=tree.max_depth(),  # host-side tree: no per-level device sync while building the mask
    )


def verify(runner: TargetRunner, compiled: CompiledDraft) -> TargetLogits:
    """ONE target forward over the compiled rows on top of the cache (their K/V are appended to it)."""
    out = runner.backbone(
        input_ids=compiled.input_ids,
        position_ids=compiled.position_ids,
        attention_mask=compiled.attention_mask,
        **hf_cache(runner.cache),
        use_cache=True,
    )
    return TargetLogits(out.last_hidden_state[0], runner.lm_head)


def cache_tensors_with_index(cache: Any, index: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every non-empty K or V tensor of a transformers cache, with ``index`` (a host tensor) on that tensor's device.

    The index is copied once per device, not once per layer (a placed model's layers may sit on several devices).
    """
    on_device: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is None or t.numel() == 0:
                continue
            idx = on_device.get(t.device)
            if idx is None:
                idx = on_device[t.device] = index.to(t.device)
            yield t, idx


def compact_cache(cache: Any, start: int, rows: Sequence[int]) -> None:
    """Keep cached positions ``[0, start)`` and ``start + rows`` (in that order); drop the rest of the window."""
    total = int(cache.get_seq_length())
    window = total - start
    keep = len(rows)
    if list(rows) != list(range(keep)):
        cpu_src = torch.tensor([start + r for r in rows], dtype=torch.long)
        for t, src in cache_tensors_with_index(cache, cpu_src):
            t[..., start : start + keep, :] = t.index_select(-2, src)
    if window > keep:
        cache.crop(-(window - keep))  # transformers 5.x: a negative count of positions to drop


def commit(runner: TargetRunner, context_len: int, accepted: Sequence[int]) -> list[int]:
    """Keep the root's and the accepted nodes' K/V behind the first ``context_len`` cached positions.

    Returns the kept rows of the verification forward (``[0] + [node + 1 ...]``).
    """
    rows = [0] + [int(n) + 1 for n in accepted]
    compact_cache(runner.cache, context_len, rows)
    return rows
