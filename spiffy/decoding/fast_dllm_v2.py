"""Fast-dLLM v2 baseline decoder: the official generator's block + sub-block threshold rule over a committed K/V cache.

Reproduces ``Fast_dLLM_QwenForCausalLM.generate`` (the checkpoints' ``modeling.py``; ``batch_sample`` in NVlabs/Fast-dLLM
``v2/generation_functions.py`` runs the same loop) for one prompt of ``P`` tokens, block size ``B``, sub-block ``S``:

* Blocks sit at absolute multiples of ``B``. When ``P > B`` the ``P // B`` whole prompt blocks are prefilled (one
  forward appending their K/V); if ``P`` is a multiple of ``B``, the argmax of the prefill's last logits is the
  first token of the first block (the *head*). When ``P < B`` the prompt shares the first block with the masks.
  **Quirk, followed:** when ``P == B`` the official loop neither prefills nor keeps the prompt in the block (it
  decodes ``x[:, -B:]``, all masks, from an empty cache at positions ``0..B-1``): the prompt is ignored.
* A block is decoded sub-block by sub-block (the first sub-block with a mask left). A step forwards the whole block
  against the committed cache (read only) and **shifts** the logits: position ``i`` reads logits ``i - 1``, the
  block's first position its own. On the current sub-block: temperature 0 takes ``argmax(softmax(logits))``,
  else top-p filtering of ``softmax(logits / T)`` and one ``multinomial`` draw per position; a masked position
  whose probability is ``> threshold`` is unmasked, and the most probable masked one always is.
  **Quirk, followed:** the denoising forwards build their block-causal mask with the official forward's default
  ``block_size=32``, not the decoding block (only block sizes that do not divide 32 see a difference).
* A finished block is committed by one forward (appending its K/V, mask in blocks of ``B``) whose last logits'
  argmax (at every temperature) is the next block's head. The commit happens in :meth:`begin_block` of the next
  block (and of a last, one-position block that holds the final head), whose first step places the head.
* Stop: generation ends once the first stop token of the current block (head included) has no mask before it;
  that block is not committed. The official result is ``x`` cut after its first stop token past the prompt.
* ``cache="dual"`` (official ``use_block_cache=True``): a step whose sub-block starts with a mask (or the block's
  first step) forwards the whole block and keeps its K/V; other steps forward only the sub-block, writing its
  fresh K/V over the kept ones (in place, as officially) and attending to all of them.

Documented deviations: ``gen_length`` must be a multiple of ``B`` (the official loop runs ``gen_length // B``
blocks); a block stops after :meth:`FastDLLMv2Session.max_block_steps` steps (the official loop spins forever when
the model proposes the mask id itself); random draws come from :attr:`generator` (officially the global RNG:
seeding both alike reproduces it); a batch decoded by its own session applies the rule to every row on its own.
Ragged batches use SDAR's layout (rows right-aligned by whole blocks, padding hidden, positions the row's own).

Engine speed (issue 37): :meth:`FastDLLMv2Session.forward_states` has a static path
(:meth:`~FastDLLMv2Session.use_static`, ``compile=True``: :class:`~spiffy.decoding.captured.StaticStates`, a CUDA graph
per bucket on a GPU). With ``cache="prefix"`` :meth:`~FastDLLMv2Session.window_logits` is the forward on explicit
tensors (the per-row position offsets and the cache from :meth:`~FastDLLMv2Session.forward_inputs`; the first cached
column in :meth:`~FastDLLMv2Session.static_layout`), and eager runs the same code, so both give the same logits bit for
bit; the sub-block cache's two calls have static buckets of their own
(:mod:`spiffy.decoding.fast_dllm_v2_sub_block`). The commit forward of :meth:`~FastDLLMv2Session.begin_block` stays
eager. The rule runs as one program over rows
(:mod:`spiffy.decoding.fast_dllm_v2_rule`: no ``nonzero`` or ``bool`` per row); what the host must know (each row's
masked count and stop hit, for the block ends and the per-row draws at ``T > 0``) travels on the reads Spiffy makes
anyway (:meth:`~FastDLLMv2Session.count_tensor`), so a Spiffy step makes at most two host reads
(tests/test_spiffy_syncs.py).
"""

from __future__ import annotations

from typing import Any

import torch

from spiffy.decoding.base import ForwardInputs
from spiffy.decoding.captured import StaticStates
from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.fast_dllm_v2_config import FastDLLMv2DecodeConfig
from spiffy.decoding.fast_dllm_v2_rule import stop_hits, sub_block_step, top_p_sample
from spiffy.decoding.fast_dllm_v2_sub_block import SubBlockCache
from spiffy.decoding.sdar import _logits_of, _prompt_lengths
from spiffy.decoding.session import DecodeSession, StepInfo, check_state_rows, gather_cache_rows
from spiffy.errors import ConfigError, PromptTooLongError
from spiffy.models.cache import KVCache
from spiffy.models.fast_dllm_v2 import OFFICIAL_MASK_BLOCK
from spiffy.models.loading import SpecialTokenIds, mask_token_id
from spiffy.torch_utils import device_tensor, model_device


class FastDLLMv2Session(DecodeSession):
    """One Fast-dLLM v2 generation (see the module doc for the exact semantics).

    Args:
        model: a Fast-dLLM v2 causal LM (``spiffy.models.fast_dllm_v2``).
        input_ids: ``[B, P]`` prompt ids (left padded when ``attention_mask`` says so).
        config: a :class:`FastDLLMv2DecodeConfig` (another :class:`DecodeConfig` is converted).
        mask_id: the mask id (default: config, model config or tokenizer). stop_ids: the stop ids when the config
            names none (``for_model`` passes the model's end-of-turn id). generator: the generator every draw
            consumes (default: seeded with ``config.resolved_seed``). attention_mask: ``[B, P]`` 0/1 prompt mask.

    Attributes beyond :class:`DecodeSession`: ``cache`` (committed K/V), ``lengths`` (prompt length per row),
    ``pads``/``offsets`` (left padding / hidden columns per row), ``first_block`` (absolute index of the first
    decode block), ``heads`` (per row, per block: whether the block's first position is a head), ``row_stopped``
    (per row: a stop reached), ``stopped`` (every row's), ``position_offsets`` (``offsets`` as a ``[B]`` tensor).
    ``num_blocks`` is ``gen_length // B + 1``: the last block is the single position of the final head.
    """

    rule = "fast_dllm_v2"
    config_class = FastDLLMv2DecodeConfig

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor, config: DecodeConfig | None = None, *,
                 mask_id: int | None = None, tokenizer: Any = None, stop_ids: tuple[int, ...] = (),
                 generator: torch.Generator | None = None, attention_mask: torch.Tensor | None = None) -> None:
        cfg = config if isinstance(config, FastDLLMv2DecodeConfig) else FastDLLMv2DecodeConfig.from_config(config)
        self.config = cfg
        self.model = model
        if input_ids.dim() == 1:
            input_ids = input_ids[None, :]
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ConfigError(f"input_ids must be [B, P] with P >= 1, got shape {tuple(input_ids.shape)}; fix: pass a "
                              "tokenized prompt")
        self.device = device = model_device(model)
        self.mask_id = int(mask_id if mask_id is not None else (cfg.mask_id if cfg.mask_id is not None
                                                                 else mask_token_id(model, tokenizer)))
        self.stop_ids = tuple(cfg.stop_token_ids) if cfg.stop_token_ids is not None else tuple(stop_ids)
        bs = self.block_length = cfg.resolved_block_length
        self.small_block = int(cfg.small_block_size)
        nb = cfg.gen_length // bs
        self.lengths = _prompt_lengths(input_ids, attention_mask)
        # each row alone: first decode block (absolute), its prompt block ignored (P == B quirk), head at block 0
        firsts = [0 if p < bs else p // bs for p in self.lengths]
        skips = [bs if p == bs else 0 for p in self.lengths]
        total = max(firsts) + nb
        self.first_block = total - nb
        self.num_blocks = nb + 1
        self.pads = [(total - f - nb) * bs for f in firsts]
        self.offsets = [pad + skip for pad, skip in zip(self.pads, skips)]
        self.heads = [[p > bs and p % bs == 0] + [True] * nb for p in self.lengths]
        self.gen_starts = [pad + p for pad, p in zip(self.pads, self.lengths)]
        self.prompt_len = min(self.gen_starts)
        # [B] per-row tensors the forward (position offsets) and the rule (generation starts, stop ids) read on the
        # device, made once: a static forward copies them into its buffers, a step creates none from host lists
        self.position_offsets = torch.tensor(self.offsets, dtype=torch.long, device=device)
        self._gen_cols = torch.tensor(self.gen_starts, dtype=torch.long, device=device)
        self._stops = torch.tensor(self.stop_ids, dtype=torch.long, device=device)
        self._heads = torch.tensor(self.heads, dtype=torch.bool, device=device)  # [B, num_blocks]
        width = total * bs + 1
        max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if max_pos is not None and width - min(self.offsets) > int(max_pos):
            raise PromptTooLongError(
                f"prompt ({max(self.lengths)} tokens) + gen_length ({cfg.gen_length}) in blocks of {bs} needs "
                f"{width - min(self.offsets)} positions but the model's context is {int(max_pos)}; fix: shorten the "
                "prompt or lower gen_length"
            )
        x = torch.full((len(self.lengths), width), self.mask_id, dtype=torch.long, device=device)
        ids = input_ids.to(device)
        pad_id = int(getattr(model.config, "pad_token_id", None) or 0)  # hidden from every key
        for r, (pad, p) in enumerate(zip(self.pads, self.lengths)):
            x[r, :pad] = pad_id
            x[r, pad : pad + p] = ids[r, ids.shape[1] - p :]
        self.x = x
        self.threshold = cfg.resolved_threshold
        self.temperature = float(cfg.temperature)
        self.top_p = float(cfg.top_p)
        self.steps_per_block = bs
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(cfg.resolved_seed)
        self.generator = generator
        self.cache = KVCache(int(model.config.num_hidden_layers))
        # leading columns outside the cache: every column before the first block when nothing is prefilled
        self._needs_prefill = any(p > bs for p in self.lengths)
        self._cache_base = 0 if self._needs_prefill else self.first_block * bs
        self._committed = self._cache_base
        self._block = -1
        self._sub_block = SubBlockCache(self)  # cache="dual": the block's K/V
        self.nfe = 0
        self.row_stopped = [False] * len(self.lengths)
        self.stopped = False

    @classmethod
    def for_model(cls, model: Any, input_ids: torch.Tensor, config: DecodeConfig, *, token_ids: SpecialTokenIds,
                  attention_mask: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> "FastDLLMv2Session":
        """The factory's session: the mask id and, unless the config names stop ids, the end-of-turn id."""
        stop = token_ids.eot if token_ids.eot is not None else token_ids.eos
        return cls(model, input_ids, config, mask_id=token_ids.require("mask"),
                   stop_ids=() if stop is None else (int(stop),), attention_mask=attention_mask, generator=generator)

    # ------------------------------------------------------------------ layout
    def block_bounds(self, block: int) -> tuple[int, int]:
        start = (self.first_block + block) * self.block_length
        return start, start + (1 if block == self.num_blocks - 1 else self.block_length)

    def window_start(self, block: int) -> int:
        return self.block_bounds(block)[0]

    def max_block_steps(self) -> int:
        return 4 * self.block_length + 1

    # ------------------------------------------------------------------ model calls
    def forward_inputs(self) -> ForwardInputs:
        """The tensors a block-causal call reads besides its tokens: the per-row position offsets ``[B]`` (as
        ``position_ids``; the hidden columns of each row, which also hide its padding keys) and the committed cache."""
        return ForwardInputs(None, self.position_offsets, None, None, self.cache)  # type: ignore[arg-type]

    def static_layout(self) -> tuple:
        """The Python values :meth:`window_logits` reads from the session (a static bucket's key holds them): the
        first cached column (the cache holds columns ``[_cache_base, block start)``) and the mask's block."""
        return (self._cache_base, OFFICIAL_MASK_BLOCK)

    def masked_call(self, tokens: torch.Tensor, q_start: int, store: bool, mask_block: int,
                     rows: torch.Tensor | None, inputs: ForwardInputs, cache: Any = None) -> torch.Tensor:
        """One model call on ``tokens`` ``[N, L]`` (columns ``[q_start, q_start + L)``) over the committed keys of
        explicit ``inputs`` (offsets ``[B]``, cache; ``cache`` overrides the latter), with the official block-causal
        mask (blocks of ``mask_block`` over each row's own positions), padding hidden: ``[N, L, V]`` raw logits.
        Reads no other tensor of the session and nothing back from the device (a CUDA graph can hold it); no NFE
        counted."""
        n, length = int(tokens.shape[0]), int(tokens.shape[1])
        dev = tokens.device
        offsets = inputs.position_ids
        offsets = offsets[rows] if rows is not None else offsets.expand(n) if offsets.shape[0] == 1 else offsets
        qcol = torch.arange(q_start, q_start + length, device=dev)
        kcol = torch.arange(self._cache_base, q_start + length, device=dev)
        qpos = qcol[None, :] - offsets[:, None]
        kpos = kcol[None, :] - offsets[:, None]
        visible = (kpos[:, None, :] >= 0) & (kpos[:, None, :] // mask_block <= qpos[:, :, None] // mask_block)
        visible |= qcol[:, None] == kcol[None, :]  # a padding query sees itself (its output is discarded)
        with torch.no_grad():
            out = self.model(tokens, attention_mask=visible[:, None], position_ids=qpos.clamp(min=0),
                             past_key_values=cache if cache is not None else gather_cache_rows(inputs.cache, rows),
                             cache_policy="append" if store else "read")
        return _logits_of(out)

    def window_logits(self, states: torch.Tensor, rows: torch.Tensor | None, inputs: ForwardInputs,
                      window: tuple[int, int]) -> torch.Tensor:
        """The read-only forward of :meth:`forward_states` (``cache="prefix"``) on explicit tensors: ``states
        [N, T]``, ``rows [N]`` or ``None``, ``window = (start, end)`` the block's columns. Returns the shifted logits
        ``[N, end - start, V]`` (index ``i`` = block position ``i``: logits ``i - 1``, the first position its own).
        No NFE counted; the static path runs it on its own buffers."""
        start, end = window
        logits = self.masked_call(states[:, start:end], start, False, OFFICIAL_MASK_BLOCK, rows, inputs)
        return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)

    def use_static(self, capture: bool = True, fuse: bool = False) -> None:
        """Run :meth:`forward_states` on the model's static buffers (:class:`~spiffy.decoding.captured.StaticStates`,
        a CUDA graph per bucket on a GPU; on a CPU the static code runs eagerly): the prefix cache's window forward,
        or the sub-block cache's two calls (:mod:`spiffy.decoding.fast_dllm_v2_sub_block`)."""
        self.static = StaticStates.for_model(self.model, model_device(self.model), capture, fuse)

    def _commit(self, end: int) -> torch.Tensor:
        """Append the K/V of columns ``[committed, end)``: ``[B, 1, V]`` the logits of column ``end - 1``."""
        logits = self.masked_call(self.x[:, self._committed : end], self._committed, True, self.block_length, None,
                                   self.forward_inputs())
        self.nfe += 1
        self._committed = end
        return logits[:, -1:]

    def begin_block(self, block: int) -> torch.Tensor | None:
        """The prefill (block 0) or the commit of block ``block - 1``; returns ``[B, 1, V]`` logits of the block's
        first position (its head when it has one; a no-op step otherwise: zeros when no call is made)."""
        self._block = block
        self._sub_block.reset()
        start = self.block_bounds(block)[0]
        if self._committed < start and (block > 0 or self._needs_prefill):
            logits = self._commit(start)
        else:
            vocab = int(self.model.config.vocab_size)
            logits = torch.zeros((self.x.shape[0], 1, vocab), dtype=self.model.dtype, device=self.x.device)
        # rows without a head get zeros whatever was computed for them, so the first step's logits (from which
        # Spiffy ranks its next drafts) are a row's own alone and in any batch
        for r, heads in enumerate(self.heads):
            if not heads[block]:
                logits[r] = 0
        return logits

    def begin_block_calls(self, block: int) -> int:
        return 1 if block > 0 or self._needs_prefill else 0

    def begin_block_rule(self, block: int) -> None:
        self._block = block
        self._sub_block.reset()

    def forward_states(self, states: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``F`` of ``N`` states: the current block of each (``[N, B]`` tokens) against the committed K/V, logits
        shifted (``[N, B, V]``, index ``i`` = block position ``i``). With :meth:`use_static` the same call runs on
        static buffers (a CUDA graph per bucket on a GPU). ``cache="dual"``: the one state of a single prompt."""
        start, end = self.block_bounds(self._block)
        if self._committed != start:
            raise RuntimeError(f"forward_states for block {self._block} before its prefix was committed")
        if rows is not None:
            states, rows = check_state_rows(states, rows, self.x)
        if self.config.block_cache:
            if states.shape[0] != self.x.shape[0] or rows is not None or self.x.shape[0] != 1:
                raise ConfigError(
                    "cache='dual' (the sub-block cache) decodes one prompt alone without drafts: the logits of a "
                    "state depend on which earlier state last refreshed the block cache, so drafts cannot be verified "
                    "exactly; fix: use cache='prefix' (the official default) for Spiffy and batches")
            return self._sub_block.forward(states.to(self.x.device), start, end)
        states = states.to(self.x.device)
        return self.counted_window_forward(states, rows, (start, end))

    # ------------------------------------------------------------------ the rule
    tracks_counts = True

    def _stop_hits(self, block: int, x: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: whether each row's first stop token in ``block`` of ``x`` ``[B, T]`` (head included, prompt
        excluded) has no mask before it: the official stop test, on the device."""
        s, e = self.block_bounds(block)
        region = x[:, s:e]
        generated = torch.arange(s, e, device=x.device)[None, :] >= self._gen_cols[:, None]
        return stop_hits(region, region == self.mask_id, generated, self._stops)

    def state_flags(self, block: int, x: torch.Tensor) -> torch.Tensor | None:
        """With stop ids, :meth:`_stop_hits` of ``block`` and of the next block (``[B]`` each, joined): what the rule
        reads on the host besides the masked counts (:meth:`DecodeSession.count_tensor` reads them together)."""
        if not self.stop_ids:
            return None
        return torch.cat([self._stop_hits(blk, x) for blk in (block, block + 1) if blk < int(self.num_blocks)])

    def _host_state(self, block: int, x: torch.Tensor) -> tuple[list[int], list[bool]]:
        """``(masked, hit)``: per row of ``x``, its masked columns in ``block`` and whether a stop ended it there
        (:meth:`_stop_hits`), as host values: the copy Spiffy's read of ``x`` left, else one read now."""
        known = self._known(x)
        if known is None or block not in known[0]:
            values = self.count_tensor(block, x).tolist()
            self.remember_counts(block, x, values)
            known = self._parse_counts(block, x, values)
        b = int(x.shape[0])
        masked = known[0][block][1]
        if not self.stop_ids:
            return masked, [False] * b
        i = block - min(known[0])  # the flags hold the stop hits of the read's block, then of the next block
        return masked, [bool(v) for v in known[1][i * b : (i + 1) * b]]

    def transition(self, x: torch.Tensor, logits: torch.Tensor, info: StepInfo) -> torch.Tensor:
        """One step on ``x`` ``[B, T]``: the head (``[B, 1, V]`` logits of the previous commit: argmax, no draw) or a
        denoising step on each row's current sub-block (``[B, B_len, V]`` shifted window logits), as one program
        over the rows. Reads nothing back at temperature 0; above it, which rows draw (in row order, each its own
        ``multinomial``) comes from :meth:`_host_state` (on the host already after Spiffy's reads)."""
        out = x.clone()
        s, e = info.block_start, info.block_end
        if logits.shape[1] == 1:
            place = self._heads[:, info.block] & self._live & (x[:, s] == self.mask_id)
            out[:, s] = torch.where(place, logits[:, 0].argmax(dim=-1), x[:, s])
            return out
        cur = x[:, s:e]
        active = (cur == self.mask_id).any(dim=1) & self._live  # [B]: a mask left, not stopped, no stop reached
        if self.stop_ids:
            active &= ~self._stop_hits(info.block, x)
        sampled: list[int] = []
        if self.temperature > 0.0:  # the draws are per row: the host needs the rows that step (the same rows)
            masked, hits = self._host_state(info.block, x)
            sampled = [r for r, (stopped, n, hit) in enumerate(zip(self.row_stopped, masked, hits))
                       if not stopped and n > 0 and not hit]
        out[:, s:e] = sub_block_step(cur, logits, self.mask_id, active, self.small_block, self.threshold,
                                     self.temperature, self.top_p, self.generator, sampled)
        return out

    @property
    def row_stopped(self) -> list[bool]:
        """Per row: a stop was reached (its generation ended); mirrored on the device (``_live`` ``[B]``, the rows still
        generating) when set, so a step reads it without building a tensor from a host list."""
        return self._row_stopped

    @row_stopped.setter
    def row_stopped(self, value: list[bool]) -> None:
        self._row_stopped = [bool(v) for v in value]
        self._live = device_tensor([not v for v in self._row_stopped], torch.bool, self.device)

    def block_finished(self, block: int, step: int, x: torch.Tensor) -> bool:
        """No mask left in the block, or a stop reached (see :meth:`_stop_hits`), in every row still generating; or
        the step bound. From host counts (:meth:`_host_state`: no read after Spiffy's)."""
        if self.block_end_by_rule(block, step):
            return True
        masked, hits = self._host_state(block, x)
        return all(stopped or n == 0 or hit for stopped, n, hit in zip(self.row_stopped, masked, hits))

    def block_end_by_rule(self, block: int, step: int) -> bool | None:
        return True if self.stopped or step >= self.max_block_steps() else None

    def reads_block_end(self, block: int) -> bool:
        return super().reads_block_end(block) or bool(self.stop_ids)  # the stop rule reads the block's last state

    def end_block(self, block: int) -> None:
        """A stop reached in ``block`` ends its row's generation (:attr:`stopped` once every row stopped)."""
        if self.stop_ids:
            hits = self._host_state(block, self.x)[1]
            self._row_stopped = [stopped or hit for stopped, hit in zip(self._row_stopped, hits)]
            self._live = self._live & ~self._stop_hits(block, self.x)  # the same hits on the device: no copy over
        self.stopped = all(self.row_stopped)

    def planned_steps(self) -> int | None:
        return None

    def generated(self) -> torch.Tensor:
        """``[B, T - P]`` everything after the prompt."""
        return self.x[:, self.prompt_len :]


__all__ = ["FastDLLMv2DecodeConfig", "FastDLLMv2Session", "top_p_sample"]
