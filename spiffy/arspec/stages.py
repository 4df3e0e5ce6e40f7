"""The stages of one batched AR speculative round, each a small function over tensors, and the clock that times them.

Every generation is a batch (one prompt is a batch of one). A round starts from the committed context (one target
K/V cache of ``B`` rows with a per-row validity mask ``valid [B, C]``) and each row's pending root (bonus) token at
its position ``p0``:

1. :func:`draft`: each row's drafter proposes ``[L, V]`` logits for positions ``p0 + 1 .. p0 + L`` (rows whose
   drafters share a model in one forward, :class:`~spiffy.arspec.drafter.BatchDrafter`);
2. :func:`build_trees`: each row's method builds its draft structure (:meth:`spiffy.arspec.methods.Method.build_tree`);
3. :func:`compile_round`: every row's ``[root, nodes...]`` through :func:`spiffy.verify.compile_tree_rows` into
   preallocated staging buffers (:class:`RoundBuffers`): ids, positions ``[B, R]`` and a 4-D mask (a row sees its
   own committed context, its ancestors and itself);
4. :func:`verify`: ONE target forward over those tensors on top of the cache. It takes tensors only and returns
   the final hidden states ``[B, R, H]``: the seam where ``torch.compile`` or CUDA-graph capture can wrap the step;
   each row's acceptance rule then walks its tree on lazily computed logits;
5. :func:`commit`: each row's kept K/V rows move to the front of the appended window, the window is cropped to the
   longest kept list and the shorter rows' trailing columns are marked invalid (holes, never seen again: position
   ids are explicit); :func:`drop_rows` removes finished rows from the cache batch.

The prefill (:func:`prefill_inputs`, :func:`prefill`) is the round-zero forward over the left-padded prompts. A
round in which no row drafts anything (plain AR) skips stages 1-3 and 5's cache moves: :func:`decode_inputs` gives
the roots' ``[B, 1]`` inputs with the mask empty trees would get, and :func:`commit_roots` marks the new column
valid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from spiffy.arspec.drafter import BatchDrafter, Drafter
from spiffy.arspec.methods import DraftKnobs, Method
from spiffy.arspec.selector import Draft
from spiffy.arspec.tree import DraftTree
from spiffy.errors import ConfigError, PromptTooLongError
from spiffy.models.cache import hf_cache
from spiffy.models.recurrent import RecurrentMixers, crop_attention, select_rows
from spiffy.models.target import check_target_config
from spiffy.torch_utils import device_tensor, execution_device
from spiffy.verify import CompiledDraft, compile_tree_rows
from spiffy.verify.host_tree import MaskWorkspace, compile_one_host_tree

__all__ = [
    "STAGES",
    "RoundBuffers",
    "StageClock",
    "TargetRunner",
    "build_trees",
    "cache_tensors_with_index",
    "check_context",
    "commit",
    "commit_roots",
    "compile_round",
    "decode_inputs",
    "draft",
    "drop_rows",
    "prefill",
    "prefill_inputs",
    "sync",
    "tree_columns",
    "verify",
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
        device, dtype: of the target's embeddings (inputs and the attention mask are built there, in this dtype).
        cache: a transformers ``DynamicCache`` holding exactly the committed context of every batch row.
        recurrent: a hybrid target's recurrent layers with their committed state per row
            (:class:`~spiffy.models.recurrent.RecurrentMixers`); ``None`` when every layer is attention.
    """

    backbone: nn.Module
    lm_head: nn.Module
    device: torch.device
    dtype: torch.dtype
    cache: Any
    recurrent: RecurrentMixers | None = None

    @classmethod
    def for_target(cls, target: nn.Module) -> "TargetRunner":
        """Split ``target`` (a transformers decoder such as ``Qwen3ForCausalLM``, sdpa or eager attention); fresh
        cache. Raises UnsupportedTargetError for a model whose layers cannot be verified exactly
        (:func:`spiffy.models.target.check_target_config`)."""
        check_target_config(target.config, type(target).__name__)
        backbone = getattr(target, "model", None)
        head = getattr(target, "lm_head", None)
        if backbone is None or head is None:
            raise ConfigError(
                f"{type(target).__name__} has no .model/.lm_head; fix: pass a transformers causal LM loaded by load_target"
            )
        impl = getattr(target.config, "_attn_implementation", None)
        if impl is not None and "flash" in str(impl):
            raise ConfigError(
                f"the target uses attn_implementation={impl!r}, which cannot take the tree attention mask; "
                "fix: load the target with attn_implementation='sdpa' (or 'eager')"
            )
        embed = target.get_input_embeddings()  # inputs and masks go to its device (its weight may be offloaded)
        cache = DynamicCache(config=target.config)
        return cls(backbone, head, execution_device(embed), embed.weight.dtype, cache,
                   RecurrentMixers.for_target(target, cache))

    @property
    def context_len(self) -> int:
        """Cached positions (committed context plus holes; the same for every batch row)."""
        return int(self.cache.get_seq_length())


def check_context(target: nn.Module, prompt_len: int, max_new_tokens: int) -> None:
    """PromptTooLongError unless ``prompt_len + max_new_tokens`` fits the target's ``max_position_embeddings``."""
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and prompt_len + max_new_tokens > int(limit):
        raise PromptTooLongError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds the target's context of {limit}; "
            "fix: shorten the prompt or lower max_new_tokens"
        )


@dataclass
class RoundBuffers:
    """Host staging of one round's verification inputs, allocated once per generation for its widest round and
    filled in place every round (:func:`spiffy.verify.compile_tree_rows`'s ``staging``), and the workspace a batch of
    one writes its attention masks into (only what changed since the last round).

    Attributes:
        ids, positions: ``[B, W]`` long; visible: ``[B, W, W]`` bool (``W`` = 1 + the most draft nodes of a round).
        mask: the :class:`~spiffy.verify.host_tree.MaskWorkspace` a batch of one's host masks are views of.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor
    mask: MaskWorkspace = field(default_factory=MaskWorkspace)

    @classmethod
    def allocate(cls, rows: int, width: int) -> "RoundBuffers":
        return cls(torch.empty(rows, width, dtype=torch.long), torch.empty(rows, width, dtype=torch.long),
                   torch.empty(rows, width, width, dtype=torch.bool))

    def ensure(self, rows: int, width: int) -> "RoundBuffers":
        """These buffers if a round of ``rows`` x ``width`` fits them, else larger ones (the mask workspace kept)."""
        if self.ids.shape[0] >= rows and self.ids.shape[1] >= width:
            return self
        grown = RoundBuffers.allocate(max(rows, int(self.ids.shape[0])), max(width, int(self.ids.shape[1])))
        grown.mask = self.mask
        return grown


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device),
                       torch.full((), torch.finfo(dtype).min, dtype=dtype, device=visible.device))


def prefill_inputs(prompts: Sequence[Sequence[int]], device: torch.device, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, list[int]]:
    """The prefill's tensors for left-padded prompts.

    Returns:
        ``(ids [B, P], positions [B, P], mask [B, 1, P, P] or None, valid [B, P] bool, pads)``: a row's position ids
        count from its first real token; its padding columns are invalid and seen by no row. ``mask`` is ``None``
        when no row is padded (the model's own causal mask: a batch of one runs exactly as one sequence).
    """
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, pads[b]:] = torch.tensor(list(p), dtype=torch.long)
    ids = ids.to(device)
    cols = torch.arange(width, device=device)
    if not any(pads):
        return ids, cols.view(1, -1).expand(len(prompts), -1), None, torch.ones_like(ids, dtype=torch.bool), pads
    pad_t = device_tensor(pads, torch.long, device)
    valid = cols.view(1, -1) >= pad_t.view(-1, 1)
    visible = (cols.view(-1, 1) >= cols.view(1, -1)).unsqueeze(0) & valid.unsqueeze(1)
    visible = visible | torch.eye(width, dtype=torch.bool, device=device).unsqueeze(0)  # padding rows see themselves
    positions = (cols.view(1, -1) - pad_t.view(-1, 1)).clamp(min=0)
    return ids, positions, _additive(visible, dtype).unsqueeze(1), valid, pads


def prefill(runner: TargetRunner, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
            valid: torch.Tensor | None = None) -> torch.Tensor:
    """Forward the prompts ``[B, P]`` into the empty cache; returns ``[B, V]`` logits of each row's first new token.

    ``valid`` (``[B, P]`` bool, :func:`prefill_inputs`'): each row's real columns, which a hybrid target's recurrent
    layers run alone (``None``: every column is real)."""
    def forward() -> Any:
        return runner.backbone(input_ids=ids, position_ids=positions, attention_mask=mask, **hf_cache(runner.cache),
                               use_cache=True)

    if runner.recurrent is None:
        out = forward()
    else:
        real = valid.cpu() if valid is not None else torch.ones(ids.shape, dtype=torch.bool)
        with runner.recurrent.prefill([row.nonzero().view(-1).tolist() for row in real]):
            out = forward()
    return runner.lm_head(out.last_hidden_state[:, -1])


def draft(drafters: Sequence[Drafter | None], roots: Sequence[tuple[int, int]], depths: Sequence[int]
          ) -> list[Draft | None]:
    """Every row's draft (``[depth, V]`` logits, or a DFlash2 selector's proposal; ``None``: no drafter or nothing to
    draft), with one forward per group
    of rows whose :class:`~spiffy.arspec.drafter.BatchDrafter` keys agree; any other row proposes alone.

    Args:
        drafters: one drafter per row (``None``: plain AR).
        roots: ``(root token, root position)`` per row.
        depths: positions to draft after each root.
    """
    out: list[Draft | None] = [None] * len(drafters)
    drafting = [i for i, (d, depth) in enumerate(zip(drafters, depths)) if d is not None and depth > 0]
    if len(drafting) == 1:  # nothing to share a forward with
        i = drafting[0]
        out[i] = drafters[i].propose(roots[i][0], roots[i][1], int(depths[i]))  # type: ignore[union-attr]
        return out
    groups: dict[Any, list[int]] = {}
    for i in drafting:
        d = drafters[i]
        key = d.batch_key() if isinstance(d, BatchDrafter) else None
        groups.setdefault(("alone", i) if key is None else (type(d), key), []).append(i)
    for key, rows in groups.items():
        if len(rows) == 1:
            i = rows[0]
            out[i] = drafters[i].propose(roots[i][0], roots[i][1], int(depths[i]))  # type: ignore[union-attr]
            continue
        logits = key[0].propose_batch([drafters[i] for i in rows], [roots[i] for i in rows],
                                      [int(depths[i]) for i in rows])
        for i, lg in zip(rows, logits):
            out[i] = lg
    return out


def build_trees(methods: Sequence[Method], configs: Sequence[DraftKnobs], draft_logits: Sequence[Draft | None],
                roots: Sequence[tuple[int, int]]) -> list[DraftTree]:
    """Each row's draft structure: its method's :meth:`~spiffy.arspec.methods.Method.build_tree`."""
    return [m.build_tree(c, lg, pos) for m, c, lg, (_tok, pos) in zip(methods, configs, draft_logits, roots)]


def compile_round(trees: Sequence[DraftTree], roots: Sequence[tuple[int, int]], valid: torch.Tensor,
                  dtype: torch.dtype, buffers: RoundBuffers) -> tuple[CompiledDraft, list[int]]:
    """Model inputs ``[B, R]`` for every row's ``[root, nodes...]`` with the tree mask over ``[cache ; rows]``.

    Returns ``(compiled, rows)``: row ``b`` occupies verification rows ``[0, rows[b])``.
    """
    if len(trees) == 1 and trees[0].parents.device.type == "cpu":  # one prompt's host tree: no staging, no padding
        (tree,), ((tok, pos),) = trees, roots
        ids, positions, mask = compile_one_host_tree((tree.tokens, tree.depths, tree.parents), ([tok], [pos]), valid,
                                                     dtype, position_offset=pos, workspace=buffers.mask)
        return CompiledDraft(ids, positions, mask, None), [int(ids.shape[1])]
    return compile_tree_rows(
        [(t.tokens, t.depths + pos, t.parents) for t, (_tok, pos) in zip(trees, roots)],
        [(torch.tensor([tok]), torch.tensor([pos])) for tok, pos in roots],
        valid, dtype=dtype, max_depths=None if all(t.parents.device.type == "cpu" for t in trees)
        else [t.max_depth() for t in trees],  # only a device tree's mask walks its levels
        staging=(buffers.ids, buffers.positions, buffers.visible),
    )


def tree_columns(trees: Sequence[DraftTree]) -> list[list[int]]:
    """Each row's parent column per verification column (column 0 the root: ``-1``; node ``i`` is column ``i + 1``)."""
    return [[-1] + [int(p) + 1 for p in t.parents.tolist()] for t in trees]


def decode_inputs(runner: TargetRunner, roots: Sequence[tuple[int, int]], valid: torch.Tensor) -> CompiledDraft:
    """A round with nothing drafted (plain AR, or a last token): each row's root alone, ``[B, 1]``, and the mask
    over ``[cache ; root]`` that :func:`compile_round` would build for empty trees (the same values, so the forward
    is bit for bit the same), without the tree machinery.

    Every row's hidden columns (left padding, holes of uneven commits) are masked, in a batch of one too: a row
    that stays alone after the others left the batch (:func:`drop_rows`) keeps its padding and holes."""
    batch, context_len = int(valid.shape[0]), int(valid.shape[1])
    ids = torch.tensor([[tok for tok, _pos in roots], [pos for _tok, pos in roots]], dtype=torch.long)
    ids = ids.to(runner.device) if runner.device.type != "cpu" else ids
    mask = torch.zeros(batch, 1, 1, context_len + 1, dtype=runner.dtype, device=valid.device)
    # no "batch of one sees everything" shortcut: valid lives on the device (checking it would synchronise) and
    # the fill is one small kernel; a single prompt's valid is all True, so its mask stays zero
    mask[:, 0, 0, :context_len].masked_fill_(~valid, torch.finfo(runner.dtype).min)
    return CompiledDraft(ids[0].view(batch, 1), ids[1].view(batch, 1), mask, None)


def commit_roots(runner: TargetRunner, valid: torch.Tensor) -> torch.Tensor:
    """:func:`commit` for a round that kept only each row's root (its K/V row already sits right after the cache;
    a hybrid target's recurrent layers keep the state their one-token branch ended in)."""
    if runner.recurrent is not None:
        runner.recurrent.advance([[0]] * int(valid.shape[0]))
    return torch.cat([valid, valid.new_ones(int(valid.shape[0]), 1)], dim=1)


def verify(runner: TargetRunner, compiled: CompiledDraft, parents: Sequence[Sequence[int]] | None = None
           ) -> torch.Tensor:
    """ONE target forward over the compiled rows on top of the cache (their K/V are appended to it); returns the
    final hidden states ``[B, R, H]`` (the head runs lazily, per visited node: :class:`~spiffy.arspec.TargetLogits`).

    ``parents`` (:func:`tree_columns`): each row's tree, which a hybrid target's recurrent layers run branch by branch
    (required for such a target; :func:`commit` then advances their state over the accepted path)."""
    def forward() -> Any:
        return runner.backbone(input_ids=compiled.input_ids, position_ids=compiled.position_ids,
                               attention_mask=compiled.attention_mask, **hf_cache(runner.cache), use_cache=True)

    if runner.recurrent is None:
        return forward().last_hidden_state
    if parents is None:
        raise ConfigError("a hybrid target's verification needs each row's tree (parents=tree_columns(trees))")
    with runner.recurrent.tree(parents):
        return forward().last_hidden_state


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


def commit(runner: TargetRunner, valid: torch.Tensor, context_len: int, keep: Sequence[Sequence[int]]) -> torch.Tensor:
    """Keep each row's listed verification rows (root first) right behind the first ``context_len`` cached positions.

    Args:
        valid: ``[B, context_len]`` bool, each row's visible cached positions before the round.
        keep: per row, the kept rows of the verification forward (``[0] + [node + 1, ...]``), in order.
    Returns:
        ``[B, context_len + W]`` the new validity mask (``W`` = the longest kept list; shorter rows' trailing
        columns are ``False``). Nothing moves when every row keeps a prefix of its window (a chain's accepted path).
    """
    cache = runner.cache
    width = max(len(k) for k in keep)
    if any(list(k) != list(range(len(k))) for k in keep):
        src = torch.tensor([[context_len + r for r in k] + [context_len + k[0]] * (width - len(k)) for k in keep],
                           dtype=torch.long)
        for t, idx in cache_tensors_with_index(cache, src):
            index = idx.view(idx.shape[0], 1, width, 1).expand(t.shape[0], t.shape[1], width, t.shape[3])
            t[:, :, context_len : context_len + width] = t.gather(2, index)
    extra = int(cache.get_seq_length()) - (context_len + width)
    if extra > 0:
        crop_attention(cache, extra)
    if runner.recurrent is not None:
        runner.recurrent.advance(keep)
    lengths = [len(k) for k in keep]
    if min(lengths) == width:  # no holes (always so for one row)
        new = valid.new_ones(len(keep), width)
    else:
        new = torch.arange(width, device=valid.device).view(1, -1) < device_tensor(lengths, torch.long, valid.device).view(-1, 1)
    return torch.cat([valid[:, :context_len], new], dim=1)


def drop_rows(runner: TargetRunner, valid: torch.Tensor, kept: Sequence[int]) -> torch.Tensor:
    """Keep only batch rows ``kept`` (in that order) of the cache; returns their validity rows."""
    idx = device_tensor(list(kept), torch.long, valid.device)
    if len(kept):
        select_rows(runner.cache, idx)
        if runner.recurrent is not None:
            runner.recurrent.select_rows(idx)
    return valid[idx]
