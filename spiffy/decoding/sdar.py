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

Additions over the reference (documented deviations):

* ``temperature == 0`` is greedy: argmax of the logits; confidences/entropies come from the softmax of the
  top-k/top-p filtered logits at temperature 1. The reference divides by the temperature.
* A step never transfers more rows than are still masked (the reference's ``torch.topk`` over the whole block
  may also pick decoded - even prompt - rows and overwrite them with fresh samples when the schedule's count
  exceeds the masks left). ``overwrite_quirk=True`` reproduces the reference exactly in that case.
* ``gen_length`` must be a multiple of ``block_length`` (the reference silently rounds up).
* A sampled token equal to the mask id leaves its row masked (as in the reference); should a block then still
  hold masks after ``denoising_steps`` steps, the reference fails (IndexError) while here further steps reuse
  the last step's count until the block is complete.
* Every random draw comes from :attr:`SDARSession.generator` (the reference uses the global RNG; passing the
  device's default generator, as :func:`spiffy.compat.sdar_block_diffusion_generate` does without a seed,
  reproduces it).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.session import BaselineStats, DecodeSession, StepInfo, run_baseline
from spiffy.errors import ConfigError, MissingTokenError, PromptTooLongError
from spiffy.models.cache import KVCache
from spiffy.models.loading import mask_token_id
from spiffy.models.registry import FAMILIES
from spiffy.sampling import filter_logits

STRATEGIES: tuple[str, ...] = ("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded")
DEFAULT_CONFIDENCE_THRESHOLD = 0.85  # the reference's default for low_confidence_dynamic
DEFAULT_EB_THRESHOLD = 0.35  # JetEngine's default entropy budget
_ENTROPY_EPS = 1e-12


# ---------------------------------------------------------------------------------------------------- config
@dataclass
class SDARDecodeConfig(DecodeConfig):
    """:class:`~spiffy.decoding.config.DecodeConfig` plus SDAR's options.

    Shared fields keep their meaning; for SDAR: ``block_length`` defaults to 4 (SDAR's training block);
    ``threshold`` is the ``low_confidence_dynamic`` confidence threshold (strictly ``>``, as the reference);
    ``cache`` is always SDAR's block-causal ``store_kv`` cache (``"none"``/``"prefix"`` are both normalised to
    ``"prefix"``; ``"dual"`` is an error); ``remasking``/``cfg_scale``/Dream fields are ignored.

    Attributes:
        strategy: ``"sequential"``, ``"low_confidence_static"``, ``"low_confidence_dynamic"`` or
            ``"entropy_bounded"``; ``None`` = dynamic when ``threshold`` is set, else static.
        denoising_steps: steps per block (the reference's ``denoising_steps``); ``None`` = ``steps // num_blocks``
            when ``steps`` is given, else ``block_length``. Must be in ``[1, block_length]``.
        eb_threshold: entropy budget of ``entropy_bounded`` (nats, summed over the rows unmasked in a step).
        overwrite_quirk: reproduce the reference's over-selection when a step's count exceeds the masks left.
        fuse_commit: fuse each commit forward with the next block's first denoising forward (same tokens,
            one call fewer per block).
        stop_token_ids: stop after the block in which one of these ids appears (``None`` = never).
    """

    block_length: int | None = 4
    cache: str = "prefix"
    strategy: str | None = None
    denoising_steps: int | None = None
    eb_threshold: float = DEFAULT_EB_THRESHOLD
    overwrite_quirk: bool = False
    fuse_commit: bool = False
    stop_token_ids: tuple[int, ...] | None = None

    NON_RULE_FIELDS: ClassVar[tuple[str, ...]] = ("gen_length", "seed", "mask_id", "fuse_commit", "stop_token_ids")
    FLOAT_FIELDS: ClassVar[tuple[str, ...]] = DecodeConfig.FLOAT_FIELDS + ("eb_threshold",)
    CLI_FLAGS: ClassVar[dict[str, str]] = {**DecodeConfig.CLI_FLAGS, "strategy": "--strategy"}

    def validate(self) -> None:
        if self.cache in ("none", "prefix"):
            self.cache = "prefix"
        elif self.cache == "dual":
            raise ConfigError(
                "cache='dual' does not apply to SDAR (a block-causal model never reads future K/V); "
                "fix: use cache='prefix' (SDAR's store_kv cache, the default)"
            )
        super().validate()
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy={self.strategy!r} is unknown; fix: use one of {', '.join(STRATEGIES)}")
        if self.denoising_steps is not None:
            if isinstance(self.denoising_steps, bool) or not isinstance(self.denoising_steps, int):
                raise ConfigError(f"denoising_steps must be an integer, got {self.denoising_steps!r}")
            if self.steps is not None and self.steps != self.denoising_steps * self.num_blocks:
                raise ConfigError(
                    f"steps={self.steps} (total) contradicts denoising_steps={self.denoising_steps} per block "
                    f"x {self.num_blocks} blocks; fix: pass only one of them"
                )
        spb = self.steps_per_block
        bl = self.resolved_block_length
        if not 1 <= spb <= bl:
            raise ConfigError(
                f"SDAR needs 1 <= denoising steps per block <= block_length, got {spb} steps for block_length={bl}; "
                f"fix: pass denoising_steps between 1 and {bl}"
            )
        if isinstance(self.eb_threshold, bool) or not isinstance(self.eb_threshold, (int, float)) or not (
            float(self.eb_threshold) >= 0.0
        ):
            raise ConfigError(f"eb_threshold={self.eb_threshold!r} must be a number >= 0; fix: use e.g. 0.35")
        if self.stop_token_ids is not None:
            ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, int) else tuple(self.stop_token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ConfigError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
            self.stop_token_ids = ids

    # ------------------------------------------------------------------ derived values
    @property
    def steps_per_block(self) -> int:
        if self.denoising_steps is not None:
            return int(self.denoising_steps)
        if self.steps is not None:
            return int(self.steps) // self.num_blocks
        return self.resolved_block_length

    @property
    def resolved_steps(self) -> int:
        return self.steps_per_block * self.num_blocks

    @property
    def resolved_strategy(self) -> str:
        if self.strategy is not None:
            return self.strategy
        return "low_confidence_dynamic" if self.threshold is not None else "low_confidence_static"

    @property
    def resolved_threshold(self) -> float:
        """Confidence threshold of ``low_confidence_dynamic`` (``threshold`` or the reference's 0.85)."""
        return DEFAULT_CONFIDENCE_THRESHOLD if self.threshold is None else float(self.threshold)

    @property
    def tokens_per_step(self) -> int | str | None:
        strategy = self.resolved_strategy
        if strategy in ("low_confidence_dynamic", "entropy_bounded"):
            return "dynamic"
        bl, spb = self.resolved_block_length, self.steps_per_block
        return bl // spb if bl % spb == 0 else None

    def rule_dict(self) -> dict[str, Any]:
        d = super().rule_dict()
        d.pop("denoising_steps", None)
        d["strategy"] = self.resolved_strategy
        # only the parameters the strategy reads are part of the rule
        d["threshold"] = self.resolved_threshold if d["strategy"] == "low_confidence_dynamic" else None
        if d["strategy"] != "entropy_bounded":
            d["eb_threshold"] = None
        for name in ("remasking", "cfg_scale", "logits_eos_inf", "confidence_eos_eot_inf", "alg", "alg_temp", "eps"):
            d.pop(name, None)  # not part of SDAR's rule
        return d

    @classmethod
    def from_config(cls, config: DecodeConfig | None = None, **overrides: Any) -> "SDARDecodeConfig":
        """An :class:`SDARDecodeConfig` from ``None``, a plain :class:`DecodeConfig` (shared fields copied) or an
        :class:`SDARDecodeConfig`, with ``overrides`` applied."""
        if config is None:
            base: dict[str, Any] = {}
        elif isinstance(config, SDARDecodeConfig):
            base = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        elif isinstance(config, DecodeConfig):
            base = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        else:
            raise ConfigError(f"config must be a DecodeConfig, got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(
                f"unknown SDAR decoding option(s) {', '.join(unknown)}; fix: use options among {', '.join(sorted(names))}"
            )
        base.update(overrides)
        return cls(**base)


# ---------------------------------------------------------------------------------------------------- rule pieces
def num_transfer_tokens(block_length: int, steps: int) -> list[int]:
    """The reference's ``get_num_transfer_tokens``: ``block_length // steps`` per step, plus one for the first
    ``block_length % steps`` steps."""
    base, rem = divmod(int(block_length), int(steps))
    return [base + (1 if i < rem else 0) for i in range(int(steps))]


def sdar_sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDAR's sampling step on window logits.

    Args:
        logits: ``[B, W, V]``.
        temperature: ``0`` = greedy (argmax; probabilities at temperature 1), else ``logits / T`` when ``T != 1``.
        top_k: keep the ``k`` largest logits (``None``/``0`` = off). top_p: nucleus mass (``None``/``1`` = off).
        generator: source of the one ``multinomial`` draw per row (``[B * W, V]`` probabilities, one sample each).
    Returns:
        tokens ``[B, W]`` long, their probabilities ``[B, W]`` and the sampling distribution ``[B, W, V]``.
    """
    shape = logits.shape[:-1]
    z = logits.reshape(-1, logits.shape[-1])
    greedy = float(temperature) == 0.0
    if not greedy and float(temperature) != 1.0:
        z = z / temperature
    # SDAR's filters: top-k then top-p, removed logits set to -inf, the crossing token kept
    filtered = filter_logits(
        z,
        top_k=int(top_k) if top_k is not None and int(top_k) > 0 else 0,
        top_p=float(top_p) if top_p is not None else 1.0,
        fill="-inf",
        order="k_then_p",
        nucleus="exceeds",
    )
    probs = torch.softmax(filtered, dim=-1)
    if greedy:
        tokens = torch.argmax(z, dim=-1, keepdim=True)
    else:
        tokens = torch.multinomial(probs, num_samples=1, generator=generator)
    token_probs = torch.gather(probs, -1, tokens)
    return tokens.view(shape), token_probs.view(shape), probs.view(*shape, -1)


def entropy_of(probs: torch.Tensor) -> torch.Tensor:
    """Entropy per row as JetEngine computes it: ``-sum(p log p)`` with ``p`` clamped at 1e-12. ``[..., V] -> [...]``."""
    p = probs.clamp_min(_ENTROPY_EPS)
    return -(p * p.log()).sum(dim=-1)


def select_transfer(
    masked: torch.Tensor,
    token_probs: torch.Tensor,
    probs: torch.Tensor | None,
    count: int,
    strategy: str,
    threshold: float,
    eb_threshold: float,
    overwrite_quirk: bool = False,
) -> torch.Tensor:
    """Which block rows take their sampled token in one step.

    Args:
        masked: ``[B, L]`` bool, rows of the block still masked.
        token_probs: ``[B, L]`` probability of each row's sampled token (the confidence).
        probs: ``[B, L, V]`` sampling distribution (needed by ``entropy_bounded`` only).
        count: the schedule's count for this step.
        strategy, threshold, eb_threshold: the rule (see module doc).
        overwrite_quirk: use ``count`` even when fewer rows are masked (the reference's behaviour).
    Returns:
        ``[B, L]`` bool transfer mask.
    """
    transfer = torch.zeros_like(masked)
    entropy = entropy_of(probs) if strategy == "entropy_bounded" else None
    for r in range(masked.shape[0]):
        m = masked[r]
        n = int(m.sum())
        if n == 0 and not (overwrite_quirk and strategy != "entropy_bounded"):
            continue
        k = int(count) if overwrite_quirk else min(int(count), n)
        if strategy == "sequential":
            rows = m.nonzero()[:, 0]
            if overwrite_quirk:
                if n == 0:
                    raise ValueError("No mask tokens found in the current block.")
                first = int(rows[0])
                transfer[r, first : first + k] = True
            else:
                transfer[r, rows[:k]] = True
        elif strategy in ("low_confidence_static", "low_confidence_dynamic"):
            conf = torch.where(m, token_probs[r], -torch.inf)
            if strategy == "low_confidence_dynamic":
                high = conf > threshold
                if int(high.sum()) >= k:
                    transfer[r] = high
                    continue
            transfer[r, torch.topk(conf, k).indices] = True
        elif strategy == "entropy_bounded":
            ent = torch.where(m, entropy[r], torch.inf)  # type: ignore[index]
            ent_sorted, order = torch.sort(ent, stable=True)
            cum = torch.cumsum(ent_sorted, dim=0)
            c = int(torch.searchsorted(cum, cum.new_tensor([float(eb_threshold)]), right=False)[0])
            c = min(max(c, min(int(count), n), 1), n)
            transfer[r, order[:c]] = True
        else:
            raise ConfigError(f"strategy={strategy!r} is unknown; fix: use one of {', '.join(STRATEGIES)}")
    return transfer


def block_causal_mask(q_start: int, q_end: int, k_end: int, block_length: int, device: torch.device | str) -> torch.Tensor:
    """``[1, 1, q_end - q_start, k_end]`` bool (True = visible): absolute row ``i`` sees column ``j`` iff
    ``j // block_length <= i // block_length``."""
    qb = torch.arange(q_start, q_end, device=device) // block_length
    kb = torch.arange(k_end, device=device) // block_length
    return (kb[None, :] <= qb[:, None])[None, None]


def _logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - parameterless model
        return torch.device("cpu")


def _config_get(model: Any, *names: str) -> Any:
    cfg = getattr(model, "config", None)
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def resolve_mask_id(model: Any, mask_id: int | None = None, tokenizer: Any = None) -> int:
    """The mask id: ``mask_id`` if given, else from the model config / tokenizer (``MissingTokenError`` if none)."""
    if mask_id is not None:
        return int(mask_id)
    try:  # the registry's lookup (config first, then tokenizer)
        return int(mask_token_id(model, tokenizer))
    except MissingTokenError:
        raise
    except Exception:  # noqa: BLE001 - not a checkpoint the registry recognises: fall back to the plain lookups below
        pass
    mask_token = FAMILIES["sdar"].mask_token
    value = _config_get(model, "mask_token_id")
    if value is None and tokenizer is not None:
        value = getattr(tokenizer, "mask_token_id", None)
        if value is None and hasattr(tokenizer, "convert_tokens_to_ids"):
            tid = tokenizer.convert_tokens_to_ids(mask_token)
            if tid is not None and tid != getattr(tokenizer, "unk_token_id", None):
                value = tid
    if value is None:
        raise MissingTokenError(
            "SDAR decoding needs a mask token id but the model config has no mask_token_id and no tokenizer "
            "provides <|MASK|>; fix: pass mask_id=... (SDAR checkpoints use <|MASK|>) or a tokenizer"
        )
    return int(value)


# ---------------------------------------------------------------------------------------------------- session
class SDARSession(DecodeSession):
    """One SDAR generation (see the module doc for the exact semantics).

    Args:
        model: an SDAR causal LM taking ``(input_ids, attention_mask=4-D bool, position_ids, past_key_values,
            use_cache, store_kv)`` and returning ``.logits [B, L, V]``.
        input_ids: ``[B, P]`` prompt ids (no padding; ``B > 1`` decodes equal-length prompts side by side,
            speculative decoding needs ``B == 1``).
        config: an :class:`SDARDecodeConfig` (a plain :class:`DecodeConfig` is converted).
        mask_id: overrides the config's / model's mask id. tokenizer: used to find the mask id if needed.
        generator: the generator every draw consumes (default: a new one on the model's device seeded with
            ``config.resolved_seed``).

    Attributes beyond :class:`DecodeSession`: ``cache`` (the committed K/V, batch ``B``), ``first_block`` (index
    of the first decode block in absolute block units, ``P // block_length``), ``total_length``, ``schedule``
    (per-step counts), ``stopped`` (a stop token was produced), ``config``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        config: DecodeConfig | None = None,
        *,
        mask_id: int | None = None,
        tokenizer: Any = None,
        generator: torch.Generator | None = None,
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
        device = _model_device(model)
        self.device = device
        self.mask_id = resolve_mask_id(model, cfg.mask_id if mask_id is None else mask_id, tokenizer)
        B = cfg.resolved_block_length
        P = int(input_ids.shape[1])
        self.prompt_len = P
        self.block_length = B
        self.first_block = P // B
        total_blocks = math.ceil((P + cfg.gen_length) / B)
        self.total_length = total_blocks * B
        self.num_blocks = total_blocks - self.first_block
        max_pos = _config_get(model, "max_position_embeddings", "max_sequence_length")
        if max_pos is not None and self.total_length > int(max_pos):
            raise PromptTooLongError(
                f"prompt ({P} tokens) + gen_length ({cfg.gen_length}) padded to whole blocks of {B} needs "
                f"{self.total_length} positions but the model's context is {int(max_pos)}; fix: shorten the prompt "
                f"or lower gen_length to at most {max(0, (int(max_pos) // B) * B - P) // B * B}"
            )
        x = torch.full((input_ids.shape[0], self.total_length), self.mask_id, dtype=torch.long, device=device)
        x[:, :P] = input_ids.to(device)
        self.x = x
        self.strategy = cfg.resolved_strategy
        self.threshold = cfg.resolved_threshold
        self.steps_per_block = cfg.steps_per_block
        self.schedule = num_transfer_tokens(B, self.steps_per_block)
        sampling = cfg.sampling
        self.temperature = float(sampling.temperature)
        self.top_k = sampling.top_k
        self.top_p = sampling.top_p
        self.stop_token_ids = tuple(cfg.stop_token_ids or ())
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
    def block_bounds(self, block: int) -> tuple[int, int]:
        start = (self.first_block + block) * self.block_length
        return start, start + self.block_length

    def window_start(self, block: int) -> int:
        return self.block_bounds(block)[0]

    # ------------------------------------------------------------------ model calls
    def _forward(self, rows: torch.Tensor, q_start: int, store: bool) -> torch.Tensor:
        """One model call on ``rows`` ``[N, L]`` (absolute rows ``[q_start, q_start + L)``) against the cache."""
        L = int(rows.shape[1])
        if self.cache.get_seq_length() != q_start:
            raise RuntimeError(
                f"SDAR cache holds {self.cache.get_seq_length()} rows but the query starts at row {q_start}"
            )
        mask = block_causal_mask(q_start, q_start + L, q_start + L, self.block_length, rows.device)
        positions = torch.arange(q_start, q_start + L, device=rows.device)[None, :].expand(rows.shape[0], L)
        with torch.no_grad():
            out = self.model(
                rows,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=self.cache,
                use_cache=True,
                store_kv=store,
            )
        self.nfe += 1
        return _logits_of(out)

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

    def forward_states(self, states: torch.Tensor) -> torch.Tensor:
        """``F`` for ``N`` candidate states: the current block's rows of each state, attending to the committed
        K/V (read-only; a batch-1 cache is broadcast to ``N``) and bidirectionally to their own block rows.

        Args:
            states: ``[N, T]``. Returns: ``[N, block_length, V]`` logits (row ``i`` predicts ``block_start + i``).
        """
        start, end = self.block_bounds(self._block)
        if self._committed != start:
            raise RuntimeError(f"forward_states for block {self._block} before its prefix was committed; call begin_block first")
        return self._forward(states[:, start:end], start, store=False)

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
        # past the schedule (only when a sampled token was the mask id itself, which leaves its row masked; the
        # reference then fails with an IndexError) the last step's count is reused
        count = self.schedule[min(info.step, len(self.schedule) - 1)]
        transfer = select_transfer(
            masked,
            token_probs,
            probs,
            count,
            self.strategy,
            self.threshold,
            float(self.config.eb_threshold),
            self.config.overwrite_quirk,
        )
        out = x.clone()
        out[:, s:e] = torch.where(transfer, tokens, cur)
        return out

    def block_finished(self, block: int, step: int, x: torch.Tensor) -> bool:
        if self.stopped:
            return True
        s, e = self.block_bounds(block)
        return not bool((x[:, s:e] == self.mask_id).any())

    def end_block(self, block: int) -> None:
        """Apply the stop rule: any stop id in ``x[:, prompt_len:]`` ends the generation."""
        if self.stopped or not self.stop_token_ids:
            return
        gen = self.x[:, self.prompt_len :]
        if any(bool((gen == t).any()) for t in self.stop_token_ids):
            self.stopped = True

    # ------------------------------------------------------------------ helpers
    def generated(self) -> torch.Tensor:
        """``[B, total_length - P]`` everything after the prompt (masks remain where decoding stopped early)."""
        return self.x[:, self.prompt_len :]


def make_session(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    config: DecodeConfig | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    **overrides: Any,
) -> SDARSession:
    """An :class:`SDARSession` for ``input_ids`` ``[B, P]``; ``config`` (or defaults) with ``overrides`` applied.

    ``attention_mask`` (``[B, P]``) is accepted only without padding: SDAR's reference decodes unpadded prompts.
    """
    if attention_mask is not None and not bool((attention_mask != 0).all()):
        raise ConfigError(
            "SDAR decoding does not support padded prompts (the reference decodes one unpadded prompt); "
            "fix: decode prompts of different lengths one at a time"
        )
    cfg = SDARDecodeConfig.from_config(config, **overrides)
    return SDARSession(model, input_ids, cfg, tokenizer=tokenizer, generator=generator)


def sdar_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    config: DecodeConfig | None = None,
    **overrides: Any,
) -> tuple[torch.Tensor, BaselineStats]:
    """Baseline SDAR decode. Returns the final state ``[B, total_length]`` and :class:`BaselineStats`."""
    session = make_session(model, input_ids, config, **overrides)
    stats = run_baseline(session)
    return session.x, stats


__all__ = [
    "STRATEGIES",
    "SDARDecodeConfig",
    "SDARSession",
    "block_causal_mask",
    "entropy_of",
    "make_session",
    "num_transfer_tokens",
    "resolve_mask_id",
    "sdar_generate",
    "sdar_sample",
    "select_transfer",
]


def __getattr__(name: str) -> Any:
    """Deprecated path (one release): ``sdar_block_diffusion_generate`` now lives in :mod:`spiffy.compat`.

    Imported on first use because the wrapper sits above this module (it dispatches to the speculative runtime).
    """
    if name == "sdar_block_diffusion_generate":
        return getattr(importlib.import_module("spiffy.compat"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
