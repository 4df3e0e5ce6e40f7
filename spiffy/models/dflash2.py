"""The DFlash2 drafter family (z-lab's ``dflash`` package, ``DFlash2DraftModel``): DFlash plus convolutions inside
each layer and a candidate selector on top; its strict loader.

A DFlash2 drafter is a DFlash drafter (:mod:`spiffy.models.dflash`: target features projected into context rows,
a block ``[root, MASK x (b - 1)]`` embedded with the target's embeddings, queries from the block, keys and values from
``[context ; block]``, the target's ``lm_head`` on the block's final hidden states) with two additions.

**Grouped dynamic causal convolutions.** Each decoder layer wraps its attention and its MLP in a
:class:`GroupedDynamicCausalConv`. Its kernel has ``kernel_size`` taps per channel: a learned base ``base_kernel [2,
K, H]`` (one for the input side, one for the output side) plus a dynamic part predicted from the normed hidden state
of the same block row (``kernel_projection``: ``H -> 2 * K * G``, one value per tap and channel group of
``conv_group_size`` channels, ``G = H / conv_group_size``). Row ``t`` of the output is ``sum_o (base[o] +
dynamic[t, o]) * x[t - o]`` over the rows of the *block only* (zero before the block's first row): causal inside the
block, never across a block boundary and never over the context rows. Around attention the input side convolves the
attention's input (its queries, block keys and block values all see the convolved rows) and the output side the
attention's output, with the second half of the kernel predicted from the same (pre-attention) rows; the MLP is
wrapped the same way.

**Candidate selector.** The head's logits give each drafted position its top-``selector_top_k`` candidates with
*unary* scores (the logits). A candidate ``c`` at position ``d`` following token ``p`` at position ``d - 1`` scores
``unary_d(c) + < predecessor_codebook[p] * hidden_projection(h_d), successor_codebook[c] >`` (a rank-``selector_rank``
bilinear term between the previous token and the candidate, modulated by the position's hidden state ``h_d``). The
official drafter chooses left to right from the root: at ``T = 0`` the best-scoring candidate, at ``T > 0`` a draw
from ``softmax(scores / T)`` over the candidates (the proposal the rejection rule needs). Because a score depends on
the previous token only, the selector is a Markov chain over each position's candidates:
:meth:`CandidateSelector.forward` returns every transition's score at once (``[D - 1, K, K]``), from which
:mod:`spiffy.arspec.selector` builds chains, sampled drafts and DDTree trees.

**Config.** ``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k`` (in ``dflash_config``
or at the top level; :data:`DFLASH2_FIELDS`). The package also reads, and this module honours:
``input_embedding_scale`` (the embedded block is multiplied by it), ``output_multiplier`` and
``final_logit_softcapping`` (``cap * tanh(logits / cap)`` after the multiplier), ``is_causal`` (the top-level config
attribute; unset: a layer is causal when its ``layer_types`` entry is ``sliding_attention``) and ``layer_types`` with
``sliding_window`` (a sliding layer sees keys fewer than ``sliding_window`` positions away; both directions unless
causal). An unknown ``dflash_config`` key is refused (:class:`~spiffy.errors.ConfigError`).

**Checkpoints.** Parameter names are the package's: the DFlash ones, ``layers.{i}.{attention,mlp}_conv.base_kernel``,
``layers.{i}.{attention,mlp}_conv.kernel_projection.weight``, ``candidate_selector.hidden_projection.weight`` and the
codebooks. Released checkpoints store ``candidate_selector.predecessor_codebook`` / ``successor_codebook`` without a
``.weight`` suffix (the package maps them on load), the package's own ``save_pretrained`` writes them with it: the
loader takes either spelling (each codebook exactly once) and otherwise matches keys strictly.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config

from spiffy.errors import CheckpointError, CheckpointKeyError, ConfigError
from spiffy.models.checkpoint import (
    CONFIG_FILE,
    check_keys,
    iter_checkpoint_keys,
    load_state_dict,
    read_config_dict,
    stored_dtype,
)
from spiffy.models.dflash import DFlashDecoderLayer, DFlashDraftModel, drafter_settings, fill_drafter
from spiffy.models.dflash_fields import draft_value as _field  # a drafter field: dflash_config first, then the top level
from spiffy.models.hub import checkpoint_dir
from spiffy.models.placement import dispatch_checkpoint, placement_device
from spiffy.topk import top_ranked, top_ranked_static
from spiffy.torch_utils import resolve_dtype

__all__ = [
    "CODEBOOKS",
    "DFLASH2_FIELDS",
    "DFLASH_CONFIG_KEYS",
    "CandidateSelector",
    "DFlash2DecoderLayer",
    "DFlash2DraftModel",
    "GroupedDynamicCausalConv",
    "causal_group_convolve",
    "dflash2_settings",
    "is_dflash2_config",
    "load_dflash2_drafter",
]

#: config fields only a DFlash2 drafter has, in ``dflash_config`` or at the top level
DFLASH2_FIELDS: tuple[str, ...] = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

#: the selector's codebooks (stored without a ``.weight`` suffix in released checkpoints)
CODEBOOKS: tuple[str, ...] = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
#: every ``dflash_config`` key a DFlash2 drafter has (the official package reads these; any other key is refused)
DFLASH_CONFIG_KEYS: frozenset[str] = frozenset(DFLASH2_FIELDS) | {
    "target_layer_ids", "mask_token_id", "block_size", "input_embedding_scale", "output_multiplier",
    "final_logit_softcapping",
}


def is_dflash2_config(cfg: dict[str, Any]) -> bool:
    """Whether a raw ``config.json`` dict describes a DFlash2 drafter (its architecture, or any DFlash2 field; a
    DFlash2 config is a DFlash config too, :func:`~spiffy.models.dflash.is_dflash_config`)."""
    extra = cfg.get("dflash_config") or {}
    return "DFlash2DraftModel" in (cfg.get("architectures") or []) or any(
        cfg.get(name) is not None or (isinstance(extra, dict) and extra.get(name) is not None) for name in DFLASH2_FIELDS
    )


def dflash2_settings(config: Any) -> dict[str, Any]:
    """The DFlash2 settings of a config, validated: ``kernel_size``, ``group_size``, ``rank``, ``top_k``. (The
    fields it shares with DFlash, ``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping``,
    ``is_causal``, ``layer_types`` and ``sliding_window``, are read by :mod:`spiffy.models.dflash_fields` for both.)

    Raises:
        ConfigError: a DFlash2 field is missing or out of range, or ``dflash_config`` has a key no DFlash2 drafter
            has.
    """
    extra = getattr(config, "dflash_config", None) or {}
    unknown = sorted(set(extra) - DFLASH_CONFIG_KEYS) if isinstance(extra, dict) else []
    if unknown:
        raise ConfigError(
            f"dflash_config has {', '.join(unknown)}, which no DFlash2 drafter reads; fix: remove it from config.json "
            f"(known: {', '.join(sorted(DFLASH_CONFIG_KEYS))})"
        )
    missing = [name for name in DFLASH2_FIELDS if _field(config, name) is None]
    if missing:
        raise ConfigError(f"the DFlash2 drafter config lacks {', '.join(missing)}; fix: add them to dflash_config "
                          "in config.json (the values the drafter was trained with)")
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)
    kernel, group = int(_field(config, "conv_kernel_size")), int(_field(config, "conv_group_size"))
    rank, top_k = int(_field(config, "selector_rank")), int(_field(config, "selector_top_k"))
    if kernel < 1 or group < 1 or hidden % group:
        raise ConfigError(f"conv_kernel_size {kernel} and conv_group_size {group} must be >= 1 with the group size "
                          f"dividing hidden_size {hidden}; fix the drafter's config.json")
    if rank < 1 or not 1 <= top_k <= vocab:
        raise ConfigError(f"selector_rank {rank} must be >= 1 and selector_top_k {top_k} in [1, {vocab}]; "
                          "fix the drafter's config.json")
    return {"kernel_size": kernel, "group_size": group, "rank": rank, "top_k": top_k}


def causal_group_convolve(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """``y[t, c] = sum_o (base[o, c] + dynamic[t, o, c // group_size]) * hidden[t - o, c]`` (zero for ``t - o < 0``).

    Args:
        hidden: ``[B, L, H]`` block rows.
        dynamic: ``[B, L, K, G]`` the dynamic taps of each row (``G = H / group_size``).
        base: ``[K, H]`` the base taps.
    Returns:
        ``[B, L, H]``.
    """
    taps = int(base.shape[0])
    past = F.pad(hidden, (0, 0, taps - 1, 0)).unfold(1, taps, 1).flip(-1)  # [B, L, H, K]: [..., o] = hidden[t - o]
    weight = base.t().to(hidden.dtype) + dynamic.transpose(-1, -2).repeat_interleave(group_size, dim=-2)
    return (weight * past).sum(-1)


class GroupedDynamicCausalConv(nn.Module):
    """The convolution wrapped around one sub-layer (attention or MLP). Called on the sub-layer's input it returns the
    convolved input and the taps it predicted for the output side; called on the sub-layer's output with those taps it
    returns the convolved output (one ``forward``, so placement hooks load its weights on either call)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = int(kernel_size)
        self.group_size = int(group_size)
        self.groups = int(hidden_size) // self.group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.kernel_size, int(hidden_size)))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(int(hidden_size), 2 * self.kernel_size * self.groups, bias=False)

    def forward(self, hidden: torch.Tensor, output_taps: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Input side (``output_taps`` ``None``): ``[B, L, H]`` -> (the convolved input ``[B, L, H]``, the output
        side's dynamic taps ``[B, L, K, G]``). Output side: the sub-layer's output convolved with ``output_taps``."""
        if output_taps is not None:
            return causal_group_convolve(hidden, output_taps, self.base_kernel[1], self.group_size)
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, self.groups)
        convolved = causal_group_convolve(hidden, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size)
        return convolved, dynamic[..., 1, :, :]


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer with its attention and its MLP each wrapped in a :class:`GroupedDynamicCausalConv`."""

    def __init__(self, config: Qwen3Config, layer_idx: int, kernel_size: int, group_size: int) -> None:
        super().__init__(config, layer_idx)
        h = int(config.hidden_size)
        self.attention_conv = GroupedDynamicCausalConv(h, kernel_size, group_size)
        self.mlp_conv = GroupedDynamicCausalConv(h, kernel_size, group_size)

    def forward(self, x, ctx, cos, sin, cache, store_context, attention_mask):  # noqa: ANN001, D102
        h, taps = self.attention_conv(self.input_layernorm(x))
        x = x + self.attention_conv(self.self_attn(h, ctx, cos, sin, cache, store_context, attention_mask), taps)
        h, taps = self.mlp_conv(self.post_attention_layernorm(x))
        return x + self.mlp_conv(self.mlp(h), taps)


class CandidateSelector(nn.Module):
    """Scores each drafted position's top-``top_k`` candidates given the previous token (see the module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = int(top_k)
        self.predecessor_codebook = nn.Parameter(torch.zeros(int(vocab_size), int(rank)))
        self.successor_codebook = nn.Parameter(torch.zeros(int(vocab_size), int(rank)))
        self.hidden_projection = nn.Linear(int(hidden_size), int(rank), bias=False)

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor, root: int | torch.Tensor, static: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every transition score of one drafted block, of one row or of a batch of rows (leading dims ``...``).

        Args:
            hidden: ``[..., D, H]`` the drafter's final hidden states of the drafted positions (block rows ``1..D``).
            logits: ``[..., D, V]`` their logits (:meth:`DFlash2DraftModel.compute_logits`).
            root: the token before position 1 (the round's root): an ``int``, or a ``[...]`` long tensor.
            static: rank the candidates with :func:`~spiffy.topk.top_ranked_static` (the same ranking without a
                host synchronisation: what a captured step runs).
        Returns:
            ``(candidates [..., D, K] long, first [..., K], following [..., D - 1, K, K])``: each position's
            candidates (logit descending, equal logits by token id), the depth-1 scores given the root, and
            ``following[..., d, i, j]``, the score of candidate ``j`` at depth ``d + 2`` after candidate ``i`` at
            depth ``d + 1``.
        """
        lead, depth, vocab = hidden.shape[:-2], int(hidden.shape[-2]), int(logits.shape[-1])
        k = min(self.top_k, vocab)
        if depth == 0:  # nothing drafted (a captured step's empty block)
            return (torch.zeros(*lead, 0, k, dtype=torch.long, device=logits.device), logits.new_zeros(*lead, k),
                    logits.new_zeros(*lead, 0, k, k))
        unary, candidates = (top_ranked_static if static else top_ranked)(logits.reshape(-1, vocab), k)
        unary, candidates = unary.view(*lead, depth, k), candidates.view(*lead, depth, k)
        modulation = self.hidden_projection(hidden)  # [..., D, r]
        successors = self.successor_codebook[candidates]  # [..., D, K, r]
        previous = self.predecessor_codebook[root] * modulation[..., 0, :]  # [..., r]
        first = unary[..., 0, :] + (successors[..., 0, :, :] @ previous.unsqueeze(-1)).squeeze(-1)
        # [..., D - 1, K, r]: each depth's candidates as predecessors, modulated by the next position's hidden state
        predecessors = self.predecessor_codebook[candidates[..., :-1, :]] * modulation[..., 1:, None, :]
        following = unary[..., 1:, None, :] + predecessors @ successors[..., 1:, :, :].transpose(-1, -2)
        return candidates, first, following


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 drafter: the DFlash parameters, :class:`DFlash2DecoderLayer` layers and ``candidate_selector``.

    Its forward, masks (``is_causal``, sliding windows) and logits (``input_embedding_scale``,
    ``output_multiplier``, ``final_logit_softcapping``) are :class:`~spiffy.models.dflash.DFlashDraftModel`'s: only
    the layers (their convolutions) and the read-out through the selector are its own.

    Args:
        config: a transformers ``Qwen3Config`` with the DFlash extras and the DFlash2 fields
            (:func:`dflash2_settings`).
    Attributes:
        candidate_selector: the :class:`CandidateSelector`.
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        settings = dflash2_settings(config)
        self.settings = settings
        self.layers = nn.ModuleList([
            DFlash2DecoderLayer(config, i, settings["kernel_size"], settings["group_size"])
            for i in range(int(config.num_hidden_layers))
        ])
        self.candidate_selector = CandidateSelector(int(config.hidden_size), int(config.vocab_size), settings["rank"],
                                                    settings["top_k"])

    @property
    def top_k(self) -> int:
        return self.candidate_selector.top_k

    def select(self, hidden: torch.Tensor, lm_head: nn.Module, root: int | torch.Tensor, static: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[..., D, H]`` block hidden states -> the selector's ``(candidates, first, following)``
        (:meth:`CandidateSelector.forward`, ``root`` and ``static`` as there)."""
        return self.candidate_selector(hidden, self.compute_logits(hidden, lm_head), root, static)


def _codebook_spelling(keys: Any, root: Any) -> dict[str, str]:
    """``{stored key: model key}`` for the codebooks stored with a ``.weight`` suffix; CheckpointKeyError when a
    codebook is stored under both spellings."""
    keys = set(keys)
    renames: dict[str, str] = {}
    for name in CODEBOOKS:
        if name + ".weight" in keys:
            if name in keys:
                raise CheckpointKeyError(str(root), [], [name + ".weight"], fix=(
                    f"fix: {name} is stored twice (with and without .weight); keep one of them"))
            renames[name + ".weight"] = name
    return renames


def load_dflash2_drafter(
    path: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    device_map: Any = None,
    offload_folder: str | os.PathLike | None = None,
    max_memory: Mapping[Any, Any] | None = None,
) -> DFlash2DraftModel:
    """Load a DFlash2 drafter checkpoint directory with strict key matching (the codebooks in either spelling).

    Args: as :func:`spiffy.models.dflash.load_drafter` (``dtype`` ``None``/``"auto"`` keeps the stored dtype).
    Raises:
        CheckpointError: no config, or not a DFlash2 drafter; ConfigError: a bad DFlash2 field (before any weight is
            read); CheckpointKeyError: missing, unexpected or shape-mismatched keys (named).
    """
    root = checkpoint_dir(path)
    if not (root / CONFIG_FILE).is_file():
        raise CheckpointError(f"no config.json in {root}; fix: point at a DFlash2 drafter checkpoint directory")
    raw = read_config_dict(root)
    if not is_dflash2_config(raw):
        raise CheckpointError(f"{root} is not a DFlash2 drafter (config.json has none of {', '.join(DFLASH2_FIELDS)}); "
                              "fix: load a DFlash drafter with spiffy.models.load_ar_drafter")
    cfg = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
    config = Qwen3Config(**cfg)
    drafter_settings(config)  # config problems first, before reading any weights
    dflash2_settings(config)
    device, device_map = placement_device(device, device_map)
    keep = dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto")
    if device_map is not None:
        if _codebook_spelling(iter_checkpoint_keys(root), root):
            raise CheckpointError(f"{root} stores the selector's codebooks with a .weight suffix, which placement with "
                                  "a device_map cannot rename; fix: load the drafter without device_map (it is small)")
        model = dispatch_checkpoint(lambda: DFlash2DraftModel(config), root, device_map,
                                    stored_dtype(root) if keep else resolve_dtype(dtype), offload_folder, max_memory,
                                    no_split=["DFlash2DecoderLayer", "CandidateSelector"])
        return model.eval()
    state = load_state_dict(root)
    for stored, name in _codebook_spelling(state, root).items():
        state[name] = state.pop(stored)
    want = (next(iter(state.values())).dtype if state else torch.float32) if keep else resolve_dtype(dtype)
    with torch.device("meta"):
        model = DFlash2DraftModel(config)
    check_keys(model, state, root)
    return fill_drafter(model, state, want, device)  # type: ignore[return-value]
