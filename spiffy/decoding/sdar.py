"""SDAR baseline decoder: block diffusion with a block-causal model and a ``store_kv`` K/V cache.

Reproduces the semantics of SDAR's official ``block_diffusion_generate`` (JetAstra/SDAR ``generate.py``):

* The state is ``prompt + masks`` padded to a whole number of blocks: ``ceil((P + gen_length) / B) * B`` rows.
  Blocks are aligned to absolute positions, so an unaligned prompt shares its last block with the first generated
  positions (that block is the first *decode* block; its prompt rows are never masked).
* The ``P // B`` whole prompt blocks are prefilled in one forward that appends their K/V (``store_kv=True``).
* Each decode block is denoised on its own rows only, attending to the committed K/V (read-only,
  ``store_kv=False``) and bidirectionally to itself; every step samples a token for every row of the block
  (temperature, top-k, top-p; one ``multinomial`` draw per row from :attr:`SDARSession.generator`) and a
  strategy decides which masked rows take their sample: ``sequential``, ``low_confidence_static``,
  ``low_confidence_dynamic`` (confidence strictly above the threshold, at least the schedule's count) or
  ``entropy_bounded`` (JetEngine's rule: lowest-entropy masked rows while the cumulative entropy stays below
  ``eb_threshold``; at least the schedule's count). The per-step count is ``get_num_transfer_tokens(B, steps)``.
* A finished block is committed by one forward that appends its K/V; it counts as one NFE. The reference
  commits inside the block's own loop; here :meth:`SDARSession.begin_block` commits block ``b - 1`` (so the last
  block's commit, whose K/V nothing reads, is skipped: NFE = reference model calls - 1). With
  ``fuse_commit=True`` the commit of block ``b - 1`` (or the prefill) and block ``b``'s first denoising forward
  are one call on rows ``[block b-1 ; block b]`` under the block-causal mask; block ``b``'s K/V are then cropped.
  This is exact and saves one call per block.
* With ``stop_token_ids``, decoding stops after the first block whose completion leaves one of them in
  ``x[:, P:]`` (later blocks stay masked), as the reference's ``stopping_criteria_idx`` does.

Prompts of different lengths (``attention_mask`` ``[B, P]``, 0 = left padding) are laid out so that every row keeps
its own block anchoring. Row ``r`` alone (``p_r`` tokens) has blocks at multiples of ``B`` from position 0 and ends
at ``total_r = ceil((p_r + gen_length) / B) * B``; in the batch its row is right-aligned to the longest layout ``T``
and left padded by ``pad_r = T - total_r`` columns. ``pad_r`` is a whole number of blocks (both lengths are), so
the row's blocks are the batch's blocks shifted by ``pad_r / B``: one block-causal mask, one cache, one window per
step serve every row. Padding columns are hidden from every key (a padding query sees only itself, which keeps its
discarded output finite), and positions are the row's own (``column - pad_r``), so each row computes what it
computes alone (up to floating-point rounding). Rows with an unaligned prompt have one decode block more than
aligned ones (their first decode block holds their prompt's tail); an aligned row's first batch block is then its
last prompt block, which has no masked row to decode. This padding (rather than anchoring blocks per row at other
columns) keeps every model call rectangular and the K/V commit one call for all rows. Equal-length prompts, and
ragged prompts whose layouts happen to match, need no padding (``pad_r = 0``); only the generation start
(``gen_starts``) differs per row.

Additions over the reference (documented deviations):

* ``temperature == 0`` is greedy: argmax of the logits; confidences/entropies come from the softmax of the
  top-k/top-p filtered logits at temperature 1. The reference divides by the temperature.
* A step never transfers more rows than are still masked (the reference's ``torch.topk`` over the whole block
  may also pick decoded - even prompt - rows and overwrite them with fresh samples when the schedule's count
  exceeds the masks left). ``overwrite_quirk=True`` reproduces the reference exactly in that case.
* ``gen_length`` must be a multiple of ``block_length`` (the reference silently rounds up).
* A sampled (or, at ``temperature == 0``, greedy) token equal to the mask id leaves its row masked, as in the
  reference. A block takes at most ``denoising_steps`` denoising steps, the reference's own bound (``for step in
  range(denoising_steps + 1)``, whose last pass only commits); rows still masked then keep the mask id and the
  block is committed as it is, where the reference fails (IndexError on the schedule). Every other block finishes
  within the schedule (each step unmasks at least the schedule's count), exactly as in the reference.
* Every random draw comes from :attr:`SDARSession.generator` (the reference uses the global RNG; passing the
  device's default generator, as :func:`spiffy.compat.sdar_block_diffusion_generate` does without a seed,
  reproduces it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from spiffy.decoding.base import ForwardInputs
from spiffy.decoding.captured import StaticStates
from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.sdar_config import DEFAULT_CONFIDENCE_THRESHOLD, DEFAULT_EB_THRESHOLD, STRATEGIES, SDARDecodeConfig
from spiffy.decoding.sdar_rule import entropy_of, num_transfer_tokens, sdar_sample, select_transfer
from spiffy.decoding.session import DecodeSession, StepInfo, check_state_rows, gather_cache_rows
from spiffy.errors import ConfigError, PromptTooLongError
from spiffy.models.cache import KVCache
from spiffy.models.loading import mask_token_id
from spiffy.models.sdar import block_causal_mask
from spiffy.torch_utils import model_device

def _logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _config_get(model: Any, *names: str) -> Any:
    cfg = getattr(model, "config", None)
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _prompt_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Tokens of each row's prompt: ``P`` each without a mask, else the row's 1s (ConfigError unless padding is on
    the left and every row keeps a token)."""
    b, p = int(input_ids.shape[0]), int(input_ids.shape[1])
    if attention_mask is None:
        return [p] * b
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (b, p):
        raise ConfigError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected [{b}, {p}] like input_ids; "
            "fix: pass the tokenizer's 2-D attention mask"
        )
    am = attention_mask.to(torch.bool).cpu()
    lengths = [int(n) for n in am.sum(dim=1)]
    for r, n in enumerate(lengths):
        if n == 0:
            raise ConfigError(f"prompt {r} is all padding; fix: give every prompt at least one token")
        if not bool(am[r, p - n :].all()):
            raise ConfigError(
                f"prompt {r} is not left padded (its attention_mask has 0s after 1s); fix: pad prompts on the left "
                "(tokenizer.padding_side='left')"
            )
    return lengths


# ---------------------------------------------------------------------------------------------------- session
def _context_fix(room: int, prompt_len: int, gen_length: int, block: int) -> str:
    """What to shorten when a prompt of ``prompt_len`` plus ``gen_length`` exceeds ``room`` whole-block positions:
    gen_length (a multiple of the block) if a shorter one fits, else the prompt."""
    fitting_gen = max(0, room - prompt_len) // block * block
    if fitting_gen >= block:
        return f"shorten the prompt or lower gen_length to at most {fitting_gen}"
    return f"shorten the prompt to at most {max(room - gen_length, 1)} tokens"


class SDARSession(DecodeSession):
    """One SDAR generation (see the module doc for the exact semantics).

    Args:
        model: an SDAR causal LM taking ``(input_ids, attention_mask=4-D bool, position_ids, past_key_values,
            use_cache, store_kv)`` and returning ``.logits [B, L, V]``.
        input_ids: ``[B, P]`` prompt ids (``B > 1``: left padded when ``attention_mask`` says so; single-session
            speculative decoding needs ``B == 1``, batched decoding uses :mod:`spiffy.decoding.batch`).
        config: an :class:`SDARDecodeConfig` (a plain :class:`DecodeConfig` is converted).
        mask_id: overrides the config's / model's mask id. tokenizer: used to find the mask id if needed.
        generator: the generator every draw consumes (default: a new one on the model's device seeded with
            ``config.resolved_seed``).
        attention_mask: optional ``[B, P]`` 0/1 prompt mask (0 = left padding); see the module docstring.

    Attributes beyond :class:`DecodeSession`: ``cache`` (the committed K/V, batch ``B``), ``first_block`` (index
    of the first decode block in absolute block units, ``P // block_length`` without padding), ``total_length``,
    ``schedule`` (per-step counts), ``stopped`` (a stop token was produced), ``config``, ``pads`` (left padding
    columns per row), ``gen_starts`` (column of each row's first generated position; ``prompt_len`` is the smallest).
    """

    rule = "sdar"
    config_class = SDARDecodeConfig

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        config: DecodeConfig | None = None,
        *,
        mask_id: int | None = None,
        tokenizer: Any = None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        cfg = config if isinstance(config, SDARDecodeConfig) else SDARDecodeConfig.from_config(config)
        self.config = cfg
        self.model = model
        if input_ids.dim() == 1:
            input_ids = input_ids[None, :]
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ConfigError(
                f"input_ids must be [B, P] with P >= 1, got shape {tuple(input_ids.shape)}; fix: pass a tokenized prompt"
            )
        device = model_device(model)
        self.device = device
        if mask_id is None:
            mask_id = cfg.mask_id if cfg.mask_id is not None else mask_token_id(model, tokenizer)
        self.mask_id = int(mask_id)
        B = cfg.resolved_block_length
        lengths = _prompt_lengths(input_ids, attention_mask)
        P = max(lengths)
        self.block_length = B
        # each row alone: blocks anchored at position 0, ending at a whole block; the batch right-aligns the rows
        row_blocks = [math.ceil((n + cfg.gen_length) / B) for n in lengths]
        total_blocks = max(row_blocks)
        self.total_length = total_blocks * B
        self.num_blocks = max(nb - n // B for nb, n in zip(row_blocks, lengths))
        self.first_block = total_blocks - self.num_blocks
        self.pads = [(total_blocks - nb) * B for nb in row_blocks]
        self.gen_starts = [pad + n for pad, n in zip(self.pads, lengths)]
        self.prompt_len = min(self.gen_starts)
        max_pos = _config_get(model, "max_position_embeddings", "max_sequence_length")
        if max_pos is not None and self.total_length > int(max_pos):
            raise PromptTooLongError(
                f"prompt ({P} tokens) + gen_length ({cfg.gen_length}) padded to whole blocks of {B} needs "
                f"{self.total_length} positions but the model's context is {int(max_pos)}; fix: "
                + _context_fix((int(max_pos) // B) * B, P, int(cfg.gen_length), B)
            )
        x = torch.full((input_ids.shape[0], self.total_length), self.mask_id, dtype=torch.long, device=device)
        ids = input_ids.to(device)
        pad_id = int(_config_get(model, "pad_token_id") or 0)  # hidden from every key: its value never matters
        for r, (pad, n) in enumerate(zip(self.pads, lengths)):
            x[r, :pad] = pad_id
            x[r, pad : pad + n] = ids[r, ids.shape[1] - n :]
        self.x = x
        padded = any(self.pads)
        # [B, T] keys that are real tokens, and per-row position offsets; None without padding (the plain layout)
        self.key_mask: torch.Tensor | None = None
        self.position_offsets: torch.Tensor | None = None
        if padded:
            cols = torch.arange(self.total_length, device=device)
            offsets = torch.tensor(self.pads, dtype=torch.long, device=device)
            self.key_mask = cols[None, :] >= offsets[:, None]
            self.position_offsets = offsets
        self.strategy = cfg.resolved_strategy
        self.threshold = cfg.resolved_threshold
        self.steps_per_block = cfg.steps_per_block
        self.schedule = num_transfer_tokens(B, self.steps_per_block)
        sampling = cfg.sampling
        self.temperature = float(sampling.temperature)
        self.top_k = sampling.top_k
        self.top_p = sampling.top_p
        self.stop_token_ids = tuple(cfg.stop_token_ids or ())
        self._stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=device)  # made once, read per step
        self.fuse_commit = bool(cfg.fuse_commit)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(cfg.resolved_seed)
        self.generator = generator
        n_layers = _config_get(model, "num_hidden_layers", "n_layers")
        if n_layers is None:
            raise ConfigError("the model config has no num_hidden_layers; fix: pass an SDAR model (spiffy.load_model)")
        self.cache = KVCache(int(n_layers))
        self.nfe = 0
        self.stopped = False
        self._block = -1
        self._committed = 0  # rows [0, _committed) have their K/V in the cache

    # ------------------------------------------------------------------ layout
    tracks_counts = True

    def block_bounds(self, block: int) -> tuple[int, int]:
        start = (self.first_block + block) * self.block_length
        return start, start + self.block_length

    def window_start(self, block: int) -> int:
        return self.block_bounds(block)[0]

    # ------------------------------------------------------------------ model calls
    def _forward(
        self, rows: torch.Tensor, q_start: int, store: bool, batch_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One model call on ``rows`` ``[N, L]`` (absolute rows ``[q_start, q_start + L)``) against the cache
        (``batch_rows``: ``[N]`` the cache's batch entry of each query row; read-only calls only). One NFE."""
        logits = self._call(rows, q_start, store, batch_rows, self.forward_inputs())
        self.nfe += 1
        return logits

    def forward_inputs(self) -> ForwardInputs:
        """The tensors a call reads: the key-padding mask ``[B, T]`` (as ``attention_mask``), the per-row position
        offsets ``[B]`` (as ``position_ids``), the committed cache."""
        return ForwardInputs(self.key_mask, self.position_offsets, None, None, self.cache)  # type: ignore[arg-type]

    def static_layout(self) -> tuple:
        """The Python values :meth:`window_logits` reads from the session (a static bucket's key holds them)."""
        return (self.block_length, self.mask_id)

    def _call(self, rows: torch.Tensor, q_start: int, store: bool, batch_rows: torch.Tensor | None,
              inputs: ForwardInputs) -> torch.Tensor:
        """:meth:`_forward` on explicit ``inputs`` (no NFE counted; no other tensor of the session read)."""
        L = int(rows.shape[1])
        cache = inputs.cache
        if cache.get_seq_length() != q_start:
            raise RuntimeError(f"SDAR cache holds {cache.get_seq_length()} rows but the query starts at row {q_start}")
        mask = block_causal_mask(L, self.block_length, start=q_start, device=rows.device)
        # the block-causal mask hides nothing iff every query row lies in the last block (known here, so the model
        # need not read the mask back to pick its attention layout); key padding: unknown here
        all_visible: bool | None = q_start // self.block_length == (q_start + L - 1) // self.block_length
        positions = torch.arange(q_start, q_start + L, device=rows.device)[None, :].expand(rows.shape[0], L)
        if inputs.attention_mask is not None and inputs.position_ids is not None:
            all_visible = None
            keys = inputs.attention_mask[:, : q_start + L]
            offsets = inputs.position_ids
            if batch_rows is not None:
                keys, offsets = keys[batch_rows], offsets[batch_rows]
            # padding keys hidden; every query sees itself, so a padding query's (discarded) output stays finite
            own = torch.zeros((L, q_start + L), dtype=torch.bool, device=rows.device)
            own[torch.arange(L, device=rows.device), torch.arange(q_start, q_start + L, device=rows.device)] = True
            mask = (mask & keys[:, None, None, :]) | own[None, None]
            positions = (positions - offsets[:, None]).clamp(min=0)
        with torch.no_grad():
            out = self.model(
                rows,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache if batch_rows is None else gather_cache_rows(cache, batch_rows),
                use_cache=True,
                store_kv=store,
                mask_all_visible=all_visible,
            )
        return _logits_of(out)

    def window_logits(self, states: torch.Tensor, rows: torch.Tensor | None, inputs: ForwardInputs,
                      window: tuple[int, int, int]) -> torch.Tensor:
        """The read-only forward of :meth:`forward_states` on explicit tensors: ``states [N, T]``, ``window =
        (q_start, start, end)``: rows ``[q_start, end)`` are computed against the ``q_start`` cached ones and the
        logits of ``[start, end)`` returned. No NFE counted."""
        q_start, start, end = window
        return self._call(states[:, q_start:end], q_start, False, rows, inputs)[:, start - q_start :]

    def use_static(self, capture: bool = True, fuse: bool = False) -> None:
        """Run :meth:`forward_states` on the model's static buffers (:class:`~spiffy.decoding.captured.StaticStates`;
        an MoE model, SDAR-MoE or LLaDA2.0, runs its experts grouped there, or has its CUDA capture refused). On a
        CPU the static code runs as a GPU would capture it."""
        self.static = StaticStates.for_model(self.model, model_device(self.model), capture, fuse)

    def query_start(self) -> int:
        """First row a denoising forward computes: the block start (the rows before it are in the cache)."""
        return self.block_bounds(self._block)[0]

    def _commit(self, start: int, end: int) -> None:
        """Append the K/V of rows ``[start, end)`` of :attr:`x` (prefill or block commit): one NFE."""
        if end > start:
            self._forward(self.x[:, start:end], start, store=True)
            self._committed = end

    def begin_block(self, block: int) -> torch.Tensor | None:
        """Commit what precedes ``block`` (the prefill for block 0, block ``block - 1`` otherwise).

        Returns ``None``, or with ``fuse_commit`` block ``block``'s first-step logits ``[B, L, V]`` computed in the
        same call as the commit (block ``block``'s own K/V are cropped off again).
        """
        self._block = block
        if self.stopped:
            return None
        start, end = self.block_bounds(block)
        pending = self._committed  # rows [pending, start) still need their K/V
        if not self.fuse_commit:
            self._commit(pending, start)
            return None
        if pending == start:  # nothing to commit (no whole prompt block): a plain first denoising forward
            return self.forward_states(self.x)
        logits = self._forward(self.x[:, pending:end], pending, store=True)
        self.cache.crop(start)
        self._committed = start
        return logits[:, start - pending :]

    def begin_block_calls(self, block: int) -> int:
        if self.stopped:
            return 0
        # a fused commit always calls the model; a plain one only when rows precede the block (not the first
        # block of a prompt shorter than one block)
        return 1 if self.fuse_commit or self.block_bounds(block)[0] > 0 else 0

    def begin_block_rule(self, block: int) -> None:
        self._block = block

    def forward_states(self, states: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``F`` for ``N`` candidate states: the current block's rows of each state, attending to the committed
        K/V (read-only; a batch-1 cache is broadcast to ``N``) and bidirectionally to their own block rows.
        With :meth:`use_static` the same call runs on static buffers (a CUDA graph per bucket on a GPU).

        Args:
            states: ``[N, T]``. rows: ``[N]`` batch row of each state (``None``: broadcast a batch-1 cache).
        Returns: ``[N, block_length, V]`` logits (row ``i`` predicts ``block_start + i``).
        """
        start, end = self.block_bounds(self._block)
        q_start = self.query_start()
        if self._committed != q_start:
            raise RuntimeError(f"forward_states for block {self._block} before its prefix was committed; call begin_block first")
        if rows is not None:
            states, rows = check_state_rows(states, rows, self.x)
        window = (q_start, start, end)
        return self.counted_window_forward(states, rows, window)

    # ------------------------------------------------------------------ the rule
    def transition(self, x: torch.Tensor, logits: torch.Tensor, info: StepInfo) -> torch.Tensor:
        """One denoising step on ``x`` ``[B, T]`` with window logits ``[B, L, V]`` (see module doc). Draws one
        multinomial sample per block row from :attr:`generator` (none at temperature 0)."""
        s, e = info.block_start, info.block_end
        off = s - info.window_start
        block_logits = logits[:, off : off + (e - s)]
        tokens, token_probs, probs = sdar_sample(block_logits, self.temperature, self.top_k, self.top_p, self.generator)
        cur = x[:, s:e]
        masked = cur == self.mask_id
        count = self.schedule[info.step]  # step < denoising_steps: block_finished ends the block there
        transfer = select_transfer(
            masked,
            token_probs,
            probs,
            count,
            self.strategy,
            self.threshold,
            float(self.config.eb_threshold),
            self.config.overwrite_quirk,
            self.masked_counts(info.block, x)[1],  # on the host: no read when Spiffy's read of this state left them
        )
        if self.temperature == 0 and self.strategy in ("low_confidence_static", "low_confidence_dynamic"):
            # the confidences the rule's torch.topk ranked (their ties order ranking's drafts as the baseline would)
            self.publish_probs(logits, None, selection=torch.where(masked, token_probs, -torch.inf), selection_start=s)
        out = x.clone()
        out[:, s:e] = torch.where(transfer, tokens, cur)
        return out

    def planned_steps(self) -> int | None:
        """A block ends when no mask is left in it, so a block the prompt partly fills takes fewer steps:
        per block, the steps of the schedule (at most ``schedule[step]`` tokens each) that unmask its masks."""
        if self.config.tokens_per_step == "dynamic":
            return None
        total = 0
        for block in range(self.num_blocks):
            s, e = self.block_bounds(block)
            masks = int((self.x[:, s:e] == self.mask_id).sum(dim=1).max())
            steps = done = 0
            while done < masks:  # bounded: every schedule entry is >= 1
                done += max(1, int(self.schedule[min(steps, len(self.schedule) - 1)]))
                steps += 1
            total += steps
        return total

    def block_finished(self, block: int, step: int, x: torch.Tensor) -> bool:
        """No mask left in the block, or its ``denoising_steps`` steps taken (the reference's bound; rows whose
        token was the mask id itself stay masked), or the generation stopped."""
        return self.finished_by_counts(block, step, x)

    def block_end_by_rule(self, block: int, step: int) -> bool | None:
        return True if self.stopped or step >= self.steps_per_block else None

    def state_flags(self, block: int, x: torch.Tensor) -> torch.Tensor | None:
        """``[B]``: whether row ``r`` holds a stop id in its generated rows, in any block (the stop rule of
        :meth:`end_block`)."""
        if not self.stop_token_ids:
            return None
        return torch.stack([torch.isin(x[r, start:], self._stops).any() for r, start in enumerate(self.gen_starts)])

    def reads_block_end(self, block: int) -> bool:
        return super().reads_block_end(block) or bool(self.stop_token_ids)  # the stop rule reads the last state

    def max_block_steps(self) -> int:
        return int(self.steps_per_block)

    def end_block(self, block: int) -> None:
        """Apply the stop rule: any stop id in a row's generated positions (``x[r, gen_starts[r]:]``) ends the
        generation (of the whole batch, as the reference's batched loop)."""
        if self.stopped or not self.stop_token_ids:
            return
        flags = self.known_flags(self.x)  # Spiffy's walk read them with the last state's counts
        if flags is None:
            flags = self.state_flags(block, self.x).tolist()  # type: ignore[union-attr]
        self.stopped = any(flags)

    # ------------------------------------------------------------------ helpers
    def generated(self) -> torch.Tensor:
        """``[B, total_length - P]`` everything after the prompt (masks remain where decoding stopped early)."""
        return self.x[:, self.prompt_len :]


__all__ = [
    "DEFAULT_CONFIDENCE_THRESHOLD",
    "DEFAULT_EB_THRESHOLD",
    "STRATEGIES",
    "SDARDecodeConfig",
    "SDARSession",
    "entropy_of",
    "num_transfer_tokens",
    "sdar_sample",
    "select_transfer",
]
