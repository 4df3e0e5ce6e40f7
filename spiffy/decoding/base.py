"""Shared machinery of the bidirectional dLLM sessions (LLaDA, Dream): state layout, model calls, cache modes.

Cache modes (Fast-dLLM semantics) and the logits *window* each mode returns (index ``i`` of the window predicts row
``window_start + i``):

========  ======================================================  ==========================
mode      one step's forward                                      window
========  ======================================================  ==========================
none      full sequences (batch dim), no cache                    ``[prompt_len, T)``
prefix    rows ``x[block_start:]`` against the frozen prefix K/V   ``[block_start, T)``
dual      rows ``x[block_start:block_end]`` between prefix+suffix  ``[block_start, block_end)``
========  ======================================================  ==========================

With a cache, :meth:`BidirectionalSession.begin_block` runs one full forward that refreshes the cache and whose
logits (sliced to the window) drive the block's first step. Cached K/V are read-only during the block
(``cache_policy="read"``); a batch-1 cache is broadcast to every candidate state, so :meth:`forward_states`
computes each of ``N`` states exactly as the baseline would in one call (Spiffy's exact verification rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spiffy.batch_invariance import is_batch_invariant
from spiffy.decoding.captured import StaticStates
from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.session import DecodeSession, StepInfo, check_state_rows, gather_cache_rows
from spiffy.errors import ConfigError
from spiffy.models.cache import HF_CACHE_NAME
from spiffy.torch_utils import model_device


@dataclass(frozen=True)
class ForwardInputs:
    """The tensors a window forward reads besides the states: ``attention_mask [B, T]`` (0 = left padding) or
    ``None``; ``position_ids [B|1, T]`` (cached calls); ``full_positions`` (full-sequence calls; ``None``: the
    model's ``arange``); ``prompt_index [B, T]`` (classifier-free guidance); ``cache`` (the block's K/V) or ``None``;
    ``window_start``: ``None``, or the window's first row as a 0-dim long tensor (the static path of a dual cache: one
    step serves every block, so the block's place is data, not a number in the step)."""

    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    full_positions: torch.Tensor | None
    prompt_index: torch.Tensor
    cache: Any
    window_start: torch.Tensor | None = None


class BidirectionalSession(DecodeSession):
    """Base class of :class:`~spiffy.decoding.llada.LLaDASession` and :class:`~spiffy.decoding.dream.DreamSession`.

    Args:
        model: a LLaDA/Dream model following the forward contract (``model(input_ids, attention_mask=...,
            position_ids=..., past_key_values=..., use_cache=..., cache_policy=...) -> .logits``).
        input_ids: ``[B, P]`` prompt ids (left padded when ``B > 1`` with ragged prompts).
        config: the decoding configuration (validated).
        mask_id: the family's mask token id.
        attention_mask: optional ``[B, P]`` 0/1 prompt mask (0 = left padding).
        generator: the generator every random draw consumes (default: a new one on the model's device seeded
            with ``config.resolved_seed``; pass ``torch.default_generator`` to follow ``torch.manual_seed``).
    Attributes:
        x: ``[B, P + gen_length]`` state; ``prompt_len = P``.
        attention_mask: ``[B, T]`` key-padding mask or ``None`` (no padding).
        position_ids: ``[B|1, T]`` absolute positions used for cached calls (and full calls when the family
            derives them from the mask).
    """

    #: Dream reads token i from logits i-1.
    shifted_logits: bool = False
    tracks_counts = True

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        config: DecodeConfig,
        *,
        mask_id: int,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if input_ids.dim() != 2:
            raise ConfigError(f"input_ids must be [B, P], got shape {tuple(input_ids.shape)}; fix: add a batch dim")
        if input_ids.shape[1] < 1:
            raise ConfigError("the prompt is empty; fix: pass at least one prompt token (e.g. a BOS token)")
        self.model = model
        self.config = config
        self.mask_id = int(mask_id)
        device = model_device(model)
        input_ids = input_ids.to(device=device, dtype=torch.long)
        b, p = input_ids.shape
        gen = config.gen_length
        self.prompt_len = p
        self.block_length = config.resolved_block_length
        self.num_blocks = config.num_blocks
        self.steps_per_block = config.steps_per_block
        self.cache_mode = config.cache
        self.x = torch.full((b, p + gen), self.mask_id, dtype=torch.long, device=device)
        self.x[:, :p] = input_ids
        # the reference's prompt_index (rows that were not masks at the start; CFG masks them)
        self.prompt_index = self.x != self.mask_id
        self.attention_mask = self._extend_mask(attention_mask, b, p, gen, device)
        self.position_ids = self._positions(device)
        self.nfe = 0
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(config.resolved_seed)
        self.generator = generator
        self._cache: Any = None
        self._cache_block = -1
        if self.cache_mode != "none" and config.cfg_scale > 0:
            raise ConfigError(
                f"cfg_scale={config.cfg_scale} is not supported with cache={self.cache_mode!r}; "
                "fix: use cache='none' with classifier-free guidance, or cfg_scale=0"
            )

    # ------------------------------------------------------------------ setup helpers
    @staticmethod
    def _extend_mask(attention_mask: torch.Tensor | None, b: int, p: int, gen: int, device: torch.device) -> torch.Tensor | None:
        if attention_mask is None:
            return None
        am = attention_mask.to(device)
        if am.dim() != 2 or tuple(am.shape) != (b, p):
            raise ConfigError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, expected [{b}, {p}] like input_ids; "
                "fix: pass the tokenizer's 2-D attention mask"
            )
        am = torch.cat([am.to(torch.long), torch.ones((b, gen), dtype=torch.long, device=device)], dim=-1)
        if bool((am == 0).any()):
            if bool((am[:, -1 - gen] == 0).any()):
                raise ConfigError(
                    "the prompt's last position is padding; fix: pad prompts on the left (tokenizer.padding_side='left')"
                )
            return am
        return None  # nothing hidden: same as no mask

    def _positions(self, device: torch.device) -> torch.Tensor:
        """Absolute positions ``[1, T]`` (families that derive positions from the mask override this). In
        batch-invariant mode (:mod:`spiffy.batch_invariant`) a left-padded row counts from its first real token, as
        Dream's official code does, so that it is its prompt alone bitwise (the official LLaDA code counts the
        padding: a shifted rotation, equal to the lone row's only up to rounding)."""
        if self.attention_mask is not None and is_batch_invariant():
            return mask_positions(self.attention_mask)
        return torch.arange(self.x.shape[1], device=device)[None]

    def full_position_ids(self) -> torch.Tensor | None:
        """Position ids passed to full-sequence forwards (``None`` = the model's default ``arange``)."""
        return self.position_ids if self.attention_mask is not None and is_batch_invariant() else None

    # ------------------------------------------------------------------ model calls
    def _model(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.model(input_ids, **kwargs)

    def forward_inputs(self) -> ForwardInputs:
        """The tensors this session's window forwards read (its own; the static path passes copies)."""
        return ForwardInputs(self.attention_mask, self.position_ids, self.full_position_ids(), self.prompt_index,
                             self._cache)

    @staticmethod
    def _mask_rows(
        am: torch.Tensor | None, cols: torch.Tensor | None = None, rows: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The ``[B|N, K]`` key mask ``am`` (``cols`` = key order; ``rows`` = the batch row of each state),
        broadcast-compatible with the query rows."""
        if am is None:
            return None
        am = am if rows is None else am[rows]
        return am if cols is None else am[:, cols]

    def _check_states(self, states: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        states, rows = check_state_rows(states, rows, self.x)
        return states, rows

    def full_logits(
        self, states: torch.Tensor, use_cache: bool = False, rows: torch.Tensor | None = None,
        inputs: ForwardInputs | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Raw logits ``[N, T, V]`` of full sequences (CFG combined), and the K/V cache when ``use_cache``.
        ``rows``: ``[N]`` batch row of each state (padding mask and positions of that row); ``inputs``: the
        tensors to read (default: :meth:`forward_inputs`)."""
        inp = self.forward_inputs() if inputs is None else inputs
        am = self._mask_rows(inp.attention_mask, rows=rows)
        pos = _pick_rows(inp.full_positions, rows)
        cfg = self.config.cfg_scale
        if cfg > 0:
            prompt_index = _pick_rows(inp.prompt_index, rows)
            un = torch.where(prompt_index, torch.full_like(states, self.mask_id), states)
            both = torch.cat([states, un], dim=0)
            am2 = None if am is None else (am if am.shape[0] == 1 else torch.cat([am, am], dim=0))
            pos2 = None if pos is None else (pos if pos.shape[0] == 1 else torch.cat([pos, pos], dim=0))
            out = self._model(both, attention_mask=am2, position_ids=pos2)
            cond, uncond = torch.chunk(out.logits, 2, dim=0)
            return uncond + (cfg + 1) * (cond - uncond), None
        if use_cache:
            out = self._model(states, attention_mask=am, position_ids=pos, use_cache=True, cache_policy="append")
            cache = getattr(out, HF_CACHE_NAME, None)
            if cache is None:
                raise ConfigError(
                    f"{type(self.model).__name__} returned no past_key_values with use_cache=True; "
                    "fix: use cache='none' with this model"
                )
            return out.logits, cache
        out = self._model(states, attention_mask=am, position_ids=pos)
        return out.logits, None

    # ------------------------------------------------------------------ windows
    def window_start(self, block: int) -> int:
        if self.cache_mode == "none":
            return self.prompt_len
        return self.block_bounds(block)[0]

    def window_end(self, block: int) -> int:
        if self.cache_mode == "dual":
            return self.block_bounds(block)[1]
        return self.x.shape[1]

    def _slice_full(self, logits: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Aligned window ``[lo, hi)`` of full-sequence raw logits (Dream: shifted by one row)."""
        if self.shifted_logits:
            return logits[:, lo - 1 : hi - 1]
        return logits[:, lo:hi]

    def _align_partial(self, logits: torch.Tensor) -> torch.Tensor:
        """Aligned logits of a cached call on rows ``[lo, hi)``: Dream shifts inside the window and gives the first
        row its own logits (Fast-dLLM; the first block row is decoded at block start, so they are never used)."""
        if self.shifted_logits:
            return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits

    # ------------------------------------------------------------------ DecodeSession contract
    def begin_block(self, block: int) -> torch.Tensor | None:
        self.on_block_start(block)
        if self.cache_mode == "none":
            return None
        start, end = self.block_bounds(block)
        if self.static is not None:  # the same forward on static buffers (a CUDA graph on a GPU)
            logits, cache = self.static.refresh(self)
        else:
            logits, cache = self.full_logits(self.x, use_cache=True)
        self.nfe += 1
        t = self.x.shape[1]
        if self.cache_mode == "prefix":
            cache.crop(start)
        else:
            keep = torch.cat(
                [torch.arange(0, start, device=self.x.device), torch.arange(end, t, device=self.x.device)]
            )
            # the block's K/V go back between prefix and suffix (keys in sequence order, as Fast-dLLM)
            cache = cache.select(keep, insert_at=start)
        self._cache = cache
        self._cache_block = block
        window = self._slice_full(logits, start, self.window_end(block))
        # a captured refresh's logits are overwritten by the next block's: the window is the caller's to keep
        return window.clone() if self.static is not None and self.static.replays else window

    def forward_states(self, states: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, T]`` states -> ``[N, W, V]`` aligned window logits of the current block (one NFE).
        ``rows``: ``[N]`` batch row of each state (its padding, positions and cache rows); see the contract.
        With :meth:`use_static` the same computation runs on static buffers (a CUDA graph per bucket on a GPU)."""
        states, rows = self._check_states(states, rows)
        if self.cache_mode != "none" and self._cache is None:
            raise ConfigError("forward_states called before begin_block; fix: call session.begin_block(block) first")
        start, end = self.window_start(self._cache_block), self.window_end(self._cache_block)
        return self.counted_window_forward(states, rows, (start, end))

    def window_logits(self, states: torch.Tensor, rows: torch.Tensor | None, inputs: ForwardInputs,
                      window: tuple[int, int]) -> torch.Tensor:
        """The forward of :meth:`forward_states` on explicit tensors (no NFE counted): ``states [N, T]``, ``rows
        [N]`` or ``None``, ``inputs`` (mask, positions, cache), ``window = (start, end)`` absolute rows. Reads no
        other tensor of the session, so the static path can run it on its own buffers; with ``inputs.window_start``
        only ``end - start`` of ``window`` is read."""
        if self.cache_mode == "none":
            logits, _ = self.full_logits(states, rows=rows, inputs=inputs)
            return self._slice_full(logits, self.prompt_len, self.x.shape[1])
        start, end = window
        dev = states.device
        if inputs.window_start is None:
            query = torch.arange(start, end, device=dev)
        else:  # the same rows, their place read from the tensor (the static dual cache)
            query = inputs.window_start + torch.arange(end - start, device=dev)
        key_cols = torch.arange(0, self.x.shape[1], device=dev)  # the dual cache inserts the block at its place
        am = self._mask_rows(inputs.attention_mask, key_cols, rows=rows)
        pos = _pick_rows(inputs.position_ids, rows)
        out = self._model(
            states[:, query],
            attention_mask=am,
            position_ids=pos[:, query],
            past_key_values=gather_cache_rows(inputs.cache, rows),
            cache_policy="read",
        )
        return self._align_partial(out.logits)

    def begin_block_calls(self, block: int) -> int:
        return 0 if self.cache_mode == "none" else 1

    def static_layout(self) -> tuple:
        """The Python values :meth:`window_logits` reads from the session itself (a static bucket's key holds them)."""
        return (self.cache_mode, self.prompt_len, float(self.config.cfg_scale), self.mask_id, self.shifted_logits)

    def use_static(self, capture: bool = True, fuse: bool = False) -> None:
        """Run :meth:`forward_states` on the model's static buffers, one step per ``(states, window)`` bucket,
        captured in a CUDA graph on a GPU when ``capture`` (:class:`spiffy.decoding.captured.StaticStates`)."""
        self.static = StaticStates.for_model(self.model, model_device(self.model), capture, fuse)

    def begin_block_rule(self, block: int) -> None:
        self.on_block_start(block)

    def end_block(self, block: int) -> None:
        self._cache = None

    def finish(self) -> None:
        self._cache = None

    # ------------------------------------------------------------------ helpers for transitions
    def on_block_start(self, block: int) -> None:
        """Hook: per-block schedule set-up (called by :meth:`begin_block` before any forward)."""

    def frame(self, info: StepInfo, width: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` over which the reference ranks confidences (and draws per-row noise): the whole
        sequence without cache (official generators), the window with a cache (Fast-dLLM)."""
        if self.cache_mode == "none":
            return 0, self.x.shape[1]
        return info.window_start, info.window_start + width

    def block_mask_in_window(self, x: torch.Tensor, info: StepInfo, width: int) -> torch.Tensor:
        """``[B, W]`` bool: the masked rows of the window a step may unmask.

        Without a cache this is every masked row before the block end, as in the official generators (a row of an
        earlier block stays eligible if the model proposed the mask token for it); with a cache (Fast-dLLM) only
        the current block's masked rows.
        """
        ws = info.window_start
        rows = torch.arange(ws, ws + width, device=x.device)
        eligible = rows < info.block_end
        if self.cache_mode != "none":
            eligible &= rows >= info.block_start
        return (x[:, ws : ws + width] == self.mask_id) & eligible[None, :]

    def max_dynamic_steps(self) -> int:
        """Safety cap on the steps of one block under dynamic (threshold) unmasking: a model that keeps proposing
        the mask token for the last masked row would otherwise never finish the block."""
        return 4 * self.block_length

    def max_block_steps(self) -> int:
        """A static block takes exactly ``steps_per_block`` steps; a dynamic one at most :meth:`max_dynamic_steps`."""
        return self.max_dynamic_steps() if self.config.threshold is not None else int(self.steps_per_block)

    def block_has_mask(self, block: int, x: torch.Tensor) -> bool:
        """Whether ``block`` of ``x`` still has a masked row (host copy when Spiffy's reads left one)."""
        return any(self.masked_counts(block, x)[1])

    def block_finished(self, block: int, step: int, x: torch.Tensor) -> bool:
        return self.finished_by_counts(block, step, x)

    def eligible_start(self, block: int) -> int:
        """The rows :meth:`block_mask_in_window` may take start at the window: the prompt's end without a cache."""
        return self.window_start(block)


def mask_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` positions counted from each row's first real token (``attention_mask`` ``[B, T]``, 0 = left
    padding; padded positions get 1, as Dream's official code gives them)."""
    tok_idx = attention_mask.long().cumsum(-1) - 1
    return tok_idx.masked_fill(attention_mask == 0, 1)


def _pick_rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """Rows ``rows`` of a ``[B|1, ...]`` per-row tensor (a batch-1 tensor broadcasts and is returned as is)."""
    if t is None or rows is None or t.shape[0] == 1:
        return t
    return t[rows]


__all__ = ["BidirectionalSession", "ForwardInputs", "model_device"]
