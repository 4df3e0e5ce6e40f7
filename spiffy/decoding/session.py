"""The decoding-session contract shared by every dLLM baseline decoder and by Spiffy.

A diffusion LM decodes a state ``x`` (``[B, T]`` token ids: prompt + ``gen_length`` positions, masked ones
holding the mask id) block by block. Each *step* computes the model's distributions on the state, ``F(x)``, and
applies the baseline *transition* ``R(x, F(x))`` which unmasks some positions (consuming the session's random
generator in a fixed order). Spiffy needs exactly these two pieces, separately:

* :meth:`DecodeSession.forward_states` evaluates ``F`` for ``N`` candidate states in **one** model call, each
  exactly as the baseline would compute it if it were in that state (same cache mode, same rows, same positions).
* :meth:`DecodeSession.transition` is the baseline rule, pure apart from the generator.

:func:`spiffy.decoding.batch.run_baseline` is the plain decoder written on top of the contract; Spiffy's loop uses
the same calls (both run :func:`spiffy.decoding.batch.decode_blocks`), so both paths share kernels, caches, RNG use
and NFE accounting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from spiffy.decoding.config import DecodeConfig
from spiffy.errors import ConfigError, StepLimitError
from spiffy.models.loading import SpecialTokenIds
from spiffy.torch_utils import on_device


@dataclass(frozen=True)
class StepInfo:
    """Where a transition happens.

    Attributes:
        block: block index (0-based).
        block_start: absolute row index of the block's first position in ``x``.
        block_end: absolute row index one past the block's last position.
        step: step index inside the block (0-based; the schedule of static decoding is indexed by it).
        window_start: absolute row index of the first row covered by the logits given to the transition
            (logits index ``i`` predicts the token at row ``window_start + i``).
    """

    block: int
    block_start: int
    block_end: int
    step: int
    window_start: int


@dataclass(frozen=True)
class TransitionProbs:
    """What a transition computed that ranking drafts can reuse.

    Attributes:
        probs: ``[B, W, V]`` ``softmax(logits)`` (unmodified logits; float32 or float64); ``None`` when the
            transition computed none that ranking could reuse (e.g. a half-precision softmax).
        top1: ``[B, W]`` the maximum of ``probs`` over the vocabulary, when the transition already has it (greedy
            low-confidence remasking: the confidence of the argmax proposal); ``None`` otherwise.
        selection: ``[B, F]`` the confidence vector the transition's ``torch.topk`` chose positions from, in the
            transition's own dtype (``-inf`` at rows that could not be chosen), when that choice is deterministic
            (greedy proposals; LLaDA and SDAR low-confidence remasking, Dream's top-k rules, whose confidence may be
            a margin or a negative entropy); ``None`` otherwise. Column ``c`` is row
            ``selection_start + c``. Ranking orders positions as repeated ``torch.topk`` calls on it would pick them,
            so draft ranks follow the baseline's own ties and roundings (in bfloat16 most confident rows tie at 1.0).
        selection_start: absolute row of ``selection[:, 0]``.
    """

    probs: torch.Tensor | None = None
    top1: torch.Tensor | None = None
    selection: torch.Tensor | None = None
    selection_start: int = 0


@dataclass
class StepRecord:
    """What an observer sees at every transition (used by calibration).

    ``x_before``/``x_after``: ``[B, T]``; ``logits``: ``[B, W, V]`` aligned window logits that drove the step;
    ``probs``: ``softmax(logits)`` as the transition computed it for its confidences
    (:meth:`DecodeSession.transition_probs`), ``None`` when it computed none.
    """

    info: StepInfo
    x_before: torch.Tensor
    logits: torch.Tensor
    x_after: torch.Tensor
    probs: TransitionProbs | None = None


StepObserver = Callable[[StepRecord], None]


class DecodeSession(ABC):
    """One generation of one dLLM family under one decoding configuration.

    Attributes (set by subclasses):
        x: ``[B, T]`` current state; ``T = prompt_len + gen_length`` (plus left padding if any).
        prompt_len: number of prompt rows (the generation area starts here).
        block_length, num_blocks: block layout of the generation area.
        mask_id: the family's mask token id (from config/tokenizer).
        steps_per_block: the static schedule's steps per block.
        nfe: model forward calls made so far (every call counts once, whatever its batch).
        generator: the ``torch.Generator`` every random draw of the baseline rule consumes.
    """

    #: the decoding rule's name: a family's registry entry names the session class that decodes it by it
    #: (:attr:`spiffy.models.registry.FamilySpec.decoder`, resolved by :data:`spiffy.decoding.factory.SESSIONS`)
    rule: ClassVar[str] = ""
    #: the decoding configuration class the session reads (:meth:`DecodeConfig.from_config` converts others)
    config_class: ClassVar[type[DecodeConfig]] = DecodeConfig

    x: torch.Tensor
    prompt_len: int
    block_length: int
    num_blocks: int
    steps_per_block: int
    mask_id: int
    nfe: int
    generator: torch.Generator | None
    #: the static forward path (:meth:`use_static`), ``None`` = eager (the reference)
    static: Any = None

    @classmethod
    def for_model(
        cls,
        model: Any,
        input_ids: torch.Tensor,
        config: DecodeConfig,
        *,
        token_ids: SpecialTokenIds,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> "DecodeSession":
        """The session the factory builds (:func:`spiffy.decoding.factory.make_session`): ``input_ids`` ``[B, P]``,
        ``config`` of :attr:`config_class`, the model's token ids (``token_ids.mask`` resolved). Default: the
        constructor with the mask id; a rule that reads more token ids overrides this."""
        return cls(model, input_ids, config, mask_id=token_ids.require("mask"),  # type: ignore[call-arg]
                   attention_mask=attention_mask, generator=generator)

    def block_bounds(self, block: int) -> tuple[int, int]:
        """``(start, end)`` absolute rows of ``block``."""
        start = self.prompt_len + block * self.block_length
        return start, start + self.block_length

    def planned_steps(self) -> int | None:
        """Steps the baseline loop takes under a static schedule (what a progress bar counts to): blocks x steps per
        block; ``None`` when the rule decides as it goes (threshold decoding). A stop token may end it sooner."""
        cfg = getattr(self, "config", None)
        if cfg is None or getattr(cfg, "tokens_per_step", None) == "dynamic":
            return None
        return int(self.num_blocks) * int(cfg.steps_per_block)

    @abstractmethod
    def begin_block(self, block: int) -> torch.Tensor | None:
        """Block-start work (e.g. the refreshing full forward of ``prefix``/``dual`` cache modes, SDAR's commit of
        the previous block). Counts its NFE. Returns the ``[B, W, V]`` aligned window logits that drive the block's
        first step when the mode computes them here, else ``None``."""

    @abstractmethod
    def window_start(self, block: int) -> int:
        """First absolute row of the window that :meth:`forward_states` returns logits for, inside ``block``."""

    def begin_block_calls(self, block: int) -> int:
        """Model calls :meth:`begin_block` makes for ``block`` on this session's current state (batched decoding
        counts them for each row session, which never calls the model itself). Default: none."""
        return 0

    def begin_block_rule(self, block: int) -> None:
        """The rule's own block-start bookkeeping (e.g. the static schedule of the block), without any model call.

        Batched Spiffy keeps one batch-1 session per row for the rule (state, generator, schedule) and lets another
        session make the forwards; it calls this on the row sessions instead of :meth:`begin_block`.
        Default: nothing.
        """

    @abstractmethod
    def forward_states(self, states: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``F`` for ``N`` candidate states in one model call.

        Args:
            states: ``[N, T]`` full states.
            rows: ``[N]`` long, the batch row each state belongs to (its padding mask, positions and cache rows
                are that row's). ``None``: a batch-1 session broadcasts its row to every state; a batch-``B``
                session takes exactly ``B`` states, one per row.
        Returns:
            ``[N, W, V]`` aligned logits of the current window (index ``i`` predicts row ``window_start + i``),
            each row computed exactly as the baseline computes ``F`` on that state. Counts one NFE.
        """

    @abstractmethod
    def transition(self, x: torch.Tensor, logits: torch.Tensor, info: StepInfo) -> torch.Tensor:
        """``R(x, F(x))``: the baseline unmasking rule.

        Args:
            x: ``[B, T]`` state.
            logits: ``[B, W, V]`` aligned window logits computed on ``x``.
            info: where the step happens.
        Returns:
            ``[B, T]`` next state (a new tensor). Consumes :attr:`generator` exactly as the baseline does.
        """

    @abstractmethod
    def block_finished(self, block: int, step: int, x: torch.Tensor) -> bool:
        """Whether ``block`` needs no further step after ``step`` steps have been taken on state ``x``
        (static schedules: ``step == steps_per_block``; dynamic: no mask left in the block). Must be true once
        ``step`` reaches :meth:`max_block_steps`: a model may propose the mask id itself for a masked row, which
        keeps it masked forever."""

    # ------------------------------------------------------------------ host copies of the state's counts
    #: the session's rule reads the state's masked counts through :meth:`masked_counts` (so a read made elsewhere,
    #: Spiffy's ranking or walk, serves it) and splits :meth:`block_finished` into :meth:`block_end_by_rule` and them
    tracks_counts: ClassVar[bool] = False

    def eligible_start(self, block: int) -> int:
        """First row whose mask the rule may take in ``block`` (default: the block start; the no-cache LLaDA and Dream
        rules also take rows of earlier blocks left masked)."""
        return self.block_bounds(block)[0]

    def state_flags(self, block: int, x: torch.Tensor) -> torch.Tensor | None:
        """``[K]`` long flags of ``x`` the rule reads at a block end besides its counts, read with the counts of
        ``block`` and the next (SDAR: a stop id generated, per row; Fast-dLLM v2: a stop reached in each of the two
        blocks, per row); ``None``: none."""
        return None

    def count_tensor(self, block: int, x: torch.Tensor) -> torch.Tensor:
        """``[K]`` long, on ``x``'s device: what the rule reads of ``x [B, T]`` on the host, for ``block`` and the next
        block (the next block's start reads the same state): per block, each row's masked count from
        :meth:`eligible_start` to the block end, then each row's masked count inside the block; then
        :meth:`state_flags`. Building it makes no host read: it joins a read made anyway (:meth:`remember_counts`)."""
        masked = x == self.mask_id  # [B, T]
        parts = []
        for blk in (block, block + 1):
            if blk >= int(self.num_blocks):
                break
            start, end = self.block_bounds(blk)
            parts += [masked[:, self.eligible_start(blk) : end].sum(dim=1), masked[:, start:end].sum(dim=1)]
        flags = self.state_flags(block, x)
        return torch.cat(parts + ([] if flags is None else [flags.to(torch.long)]))

    def remember_counts(self, block: int, x: torch.Tensor, values: list) -> None:
        """Keep the host copy ``values`` of :meth:`count_tensor` ``(block, x)`` for the rule's later reads of ``x``
        (valid while ``x`` is the same tensor, unmodified: keyed by the object and its version counter; an inference
        tensor (``torch.inference_mode()``) has no version counter, so its copy is never reused: a read more per
        step there, the same tokens)."""
        version = None if x.is_inference() else x._version
        self._known_counts = (x, version, *self._parse_counts(block, x, values))

    def _parse_counts(self, block: int, x: torch.Tensor,
                      values: list) -> tuple[dict[int, tuple[list[int], list[int]]], list[int]]:
        """:meth:`count_tensor`'s values as ``({block: (eligible, in_block)} for block and the next, flags)``."""
        b = int(x.shape[0])
        vals = [int(v) for v in values]
        known: dict[int, tuple[list[int], list[int]]] = {}
        pos = 0
        for blk in (block, block + 1):
            if blk >= int(self.num_blocks):
                break
            known[blk] = (vals[pos : pos + b], vals[pos + b : pos + 2 * b])
            pos += 2 * b
        return known, vals[pos:]

    def _known(self, x: torch.Tensor) -> tuple[dict[int, tuple[list[int], list[int]]], list[int]] | None:
        held = getattr(self, "_known_counts", None)
        if held is None or held[0] is not x or held[1] is None or held[1] != x._version:
            return None
        return held[2], held[3]

    def counts_known(self, block: int, x: torch.Tensor) -> bool:
        """Whether :meth:`masked_counts` ``(block, x)`` is on the host already (no read)."""
        known = self._known(x)
        return known is not None and block in known[0]

    def masked_counts(self, block: int, x: torch.Tensor) -> tuple[list[int], list[int]]:
        """``(eligible, in_block)``: per batch row, ``x``'s masked rows from :meth:`eligible_start` to ``block``'s
        end and inside ``block``, as host ints: the copy a read made elsewhere left (:meth:`remember_counts`),
        else one read of :meth:`count_tensor` now."""
        if self.counts_known(block, x):
            return self._known(x)[0][block]  # type: ignore[index]
        values = self.count_tensor(block, x).tolist()
        self.remember_counts(block, x, values)
        return self._parse_counts(block, x, values)[0][block]

    def known_flags(self, x: torch.Tensor) -> list[int] | None:
        """:meth:`state_flags` of ``x`` on the host when a read left them, else ``None``."""
        known = self._known(x)
        return None if known is None or not known[1] else known[1]

    def block_end_by_rule(self, block: int, step: int) -> bool | None:
        """The part of :meth:`block_finished` decided on the host: ``True`` / ``False`` whatever the state (a static
        schedule, the step bound, a stopped generation), ``None``: it ends iff the block has no mask left. Must be
        ``True`` from :meth:`max_block_steps` on. Default (sessions without :attr:`tracks_counts`): ``None``."""
        return None

    def reads_block_end(self, block: int) -> bool:
        """Whether Spiffy's walk reads the state a rule-ended block ends on (:meth:`count_tensor`): the next block's
        start needs its counts. Default: unless ``block`` is the last."""
        return block + 1 < int(self.num_blocks)

    def finished_by_counts(self, block: int, step: int, x: torch.Tensor) -> bool:
        """:meth:`block_finished` of a :attr:`tracks_counts` session: its rule part, else no mask left in the block
        (:meth:`masked_counts`: no read when a copy is on the host)."""
        ends = self.block_end_by_rule(block, step)
        if ends is not None:
            return ends
        return not any(self.masked_counts(block, x)[1])

    def max_block_steps(self) -> int:
        """The most steps one block may take: the bound of every decoding loop over the block (the baseline's,
        Spiffy's walk, the batched ones). :meth:`step_info` refuses a step past it with a :class:`StepLimitError`,
        so a session whose :meth:`block_finished` never ends a block stops instead of hanging.
        Default: ``max(steps_per_block, 4 * block_length)``; the families override it with their own bound."""
        return max(int(getattr(self, "steps_per_block", 0) or 0), 4 * int(self.block_length))

    def counted_window_forward(self, states: torch.Tensor, rows: torch.Tensor | None,
                               window: tuple[int, ...]) -> torch.Tensor:
        """``window_logits`` of ``states [N, T]`` (``rows [N]`` or ``None``) over ``window``, on the static path
        when :meth:`use_static` set one up and eagerly otherwise: the one call of a family's ``forward_states``
        (one NFE counted). For sessions that plug into :class:`~spiffy.decoding.captured.StaticStates`
        (``forward_inputs``, ``window_logits``, ``static_layout``)."""
        if self.static is not None:
            logits = self.static.forward(self, states, rows, window)
        else:
            logits = self.window_logits(states, rows, self.forward_inputs(), window)  # type: ignore[attr-defined]
        self.nfe += 1
        return logits

    def use_static(self, capture: bool = True, fuse: bool = False) -> None:
        """Run :meth:`forward_states` with static shapes per bucket, captured in CUDA graphs on a GPU (the
        ``compile=`` switch). Default: refused (a session without a static path; every shipped family has one, and
        Fast-dLLM v2's sub-block cache refuses it with its own reason)."""
        cache = getattr(getattr(self, "config", None), "cache", None)
        raise ConfigError(f"compile=True cannot run {type(self).__name__} (cache={cache!r}): its forward has no static "
                          "path yet; fix: pass compile=False (eager, same tokens)")

    def end_block(self, block: int) -> None:
        """Block-end work (counted in :attr:`nfe` if it calls the model). Default: nothing."""

    def publish_probs(self, logits: torch.Tensor, probs: torch.Tensor | None, top1: torch.Tensor | None = None,
                      selection: torch.Tensor | None = None, selection_start: int = 0) -> None:
        """Called by a transition that computed ``probs = softmax(logits)`` ``[B, W, V]`` (unmodified logits,
        float32 or float64) for its confidences, and possibly their maximum ``top1`` ``[B, W]``, and/or chose
        positions with ``torch.topk`` from the confidence vector ``selection`` ``[B, F]`` (column 0 = row
        ``selection_start``; see :class:`TransitionProbs`), so that ranking the next drafts reuses them instead of a
        second pass over the vocabulary, and follows the baseline's tie-breaking. Kept until the next transition or
        :meth:`forget_transition_probs`."""
        self._published_probs = (logits, TransitionProbs(probs, top1, selection, int(selection_start)))

    def forget_transition_probs(self) -> None:
        """Drop the published probabilities (called before a forward, so they do not sit in memory during it)."""
        self._published_probs = None

    def transition_probs(self, logits: torch.Tensor) -> TransitionProbs | None:
        """The :class:`TransitionProbs` of the last transition, when it was driven by exactly this ``logits`` tensor
        (the same object) and published them (:meth:`publish_probs`); else ``None``.

        Spiffy ranks the latest distribution with these probabilities (calibration sees the same ones in
        :attr:`StepRecord.probs`), so ranking costs no softmax of its own."""
        published = getattr(self, "_published_probs", None)
        if published is None or published[0] is not logits:
            return None
        return published[1]

    def finish(self) -> None:
        """Generation-end work. Default: nothing."""

    def rule_signature(self) -> dict[str, Any]:
        """What this session's rule looks like to a calibrated draft graph: ``mask_id``, ``block_length`` and the
        rule fields of the decoding configuration (keyed like a graph file's ``calibrated_for``). A family whose rule
        needs another description overrides this (e.g. Dream's static schedule is not uniform per step)."""
        sig: dict[str, Any] = {"mask_id": int(self.mask_id), "block_length": int(self.block_length)}
        cfg = getattr(self, "config", None)
        if isinstance(cfg, DecodeConfig):
            rule = cfg.rule_dict()
            sig.update(
                {
                    "steps_per_block": None if rule.get("tokens_per_step") == "dynamic" else cfg.steps_per_block,
                    "threshold": rule.get("threshold"),
                    "remasking": rule.get("remasking"),
                    "alg": rule.get("alg"),
                    "strategy": rule.get("strategy"),
                    "temperature": rule.get("temperature"),
                    "cache": rule.get("cache"),
                    "tokens_per_step": rule.get("tokens_per_step"),
                    "decode_fingerprint": cfg.fingerprint(),
                }
            )
        return sig

    def step_info(self, block: int, step: int) -> StepInfo:
        """Where step ``step`` of ``block`` happens; every loop asks before each transition, so this is where the
        step bound holds (:class:`StepLimitError` past :meth:`max_block_steps`)."""
        limit = self.max_block_steps()
        if step >= limit:
            raise StepLimitError(
                f"block {block} is still unfinished after {step} steps, the bound of {type(self).__name__} "
                f"(max_block_steps() = {limit}); its block_finished() must end a block by then (a model proposing "
                "the mask id keeps a row masked forever); fix: make block_finished() true once step >= max_block_steps()"
            )
        start, end = self.block_bounds(block)
        return StepInfo(block=block, block_start=start, block_end=end, step=step, window_start=self.window_start(block))


def check_state_rows(
    states: torch.Tensor, rows: torch.Tensor | None, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate the ``states`` ``[N, T]`` / ``rows`` ``[N]`` arguments of :meth:`DecodeSession.forward_states`
    against the session state ``x`` ``[B, T]``; returns them on ``x``'s device (ConfigError when malformed)."""
    if states.dim() != 2 or states.shape[1] != x.shape[1]:
        raise ConfigError(f"states must be [N, {x.shape[1]}], got {tuple(states.shape)}")
    b = x.shape[0]
    if rows is None:
        if states.shape[0] != b and b != 1:
            raise ConfigError(
                f"forward_states got {states.shape[0]} states for a batch-{b} session; fix: pass rows= (the batch "
                "row of each state) or use a batch-1 session"
            )
        return on_device(states, x.device), None
    rows = on_device(rows, x.device).long()
    if rows.dim() != 1 or rows.shape[0] != states.shape[0]:
        raise ConfigError(f"rows must be [N] = [{states.shape[0]}], got {tuple(rows.shape)}")
    if rows.numel() and not bool(((rows >= 0) & (rows < b)).all()):  # one host read per forward
        raise ConfigError(f"rows must index the session's {b} batch rows, got values in [{int(rows.min())}, {int(rows.max())}]")
    return on_device(states, x.device), rows


def gather_cache_rows(cache: Any, rows: torch.Tensor | None) -> Any:
    """``cache`` with batch entry ``n`` taken from row ``rows[n]`` (``None``: ``cache`` unchanged)."""
    if rows is None or cache is None:
        return cache
    gather = getattr(cache, "gather_batch", None)
    if gather is None:
        raise ConfigError(
            f"{type(cache).__name__} cannot be indexed by batch row; fix: decode with spiffy's own models "
            "(spiffy.load_model) or one prompt at a time"
        )
    return gather(rows)


@dataclass
class BaselineStats:
    """Counters of one baseline run, returned beside the tokens."""

    nfe: int = 0
    steps: int = 0
    steps_per_block: list[int] = field(default_factory=list)


def close_block(session: DecodeSession, block: int, steps: int, stats: Any) -> None:
    """Close ``block`` of ``session`` after ``steps`` denoising steps and count them in ``stats`` (a
    :class:`BaselineStats` or any counters with ``steps`` and ``steps_per_block``)."""
    session.end_block(block)
    stats.steps_per_block.append(steps)
    stats.steps += steps
