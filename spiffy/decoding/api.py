"""The public dLLM decoding API: :func:`generate`, :func:`make_session` and the familiar-signature wrappers.

``generate(model, input_ids, config)`` decodes with the family's baseline rule (``graph=None``) or with Spiffy
self-speculation (a calibrated draft graph; same tokens, fewer model calls). Families are recognised from the
model config's ``model_type`` (``llada``, ``Dream``, ``sdar``). Token ids (mask, EOS, EoT) come from the config or
the tokenizer, never from constants.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.session import DecodeSession, StepObserver, StepRecord, run_baseline
from spiffy.errors import ConfigError, MissingTokenError, PromptTooLongError, UnknownModelTypeError

#: config.json ``model_type`` (lower-cased) -> decoding family
_MODEL_TYPES: dict[str, str] = {"llada": "llada", "dream": "dream", "sdar": "sdar"}

#: tokenizer token strings of the end-of-turn marker, per family
_EOT_TOKENS: dict[str, tuple[str, ...]] = {"llada": ("<|eot_id|>",), "dream": ("<|im_end|>",), "sdar": ("<|im_end|>",)}


@dataclass
class DiffusionResult:
    """Output of :func:`generate`.

    Attributes:
        sequences: ``[B, T]`` final states (prompt, including any left padding, then the generated positions).
        tokens: generated ids per row (prompt excluded), ``gen_length`` of them (SDAR may decode a few more
            positions to finish its last block: ``sequences`` keeps those).
        nfe: model forward calls.
        steps: denoising steps taken (accepted speculative steps included).
        seconds: wall-clock time of the decode (model loading and tokenisation excluded).
        stats: the run's statistics (baseline: ``nfe``, ``steps``, ``steps_per_block``; speculative: the
            runtime's counters, e.g. accepted drafts and per-stage times).
        text: decoded generated text per row when a tokenizer was given.
        prompt_len: rows of the prompt in ``sequences``.
        config: the decoding configuration used.
        family: ``"llada"``, ``"dream"`` or ``"sdar"``.
    """

    sequences: torch.Tensor
    tokens: list[list[int]]
    nfe: int
    steps: int
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)
    text: list[str] | None = None
    prompt_len: int = 0
    config: DecodeConfig | None = None
    family: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no tensors)."""
        return {
            "tokens": self.tokens,
            "text": self.text,
            "nfe": self.nfe,
            "steps": self.steps,
            "seconds": self.seconds,
            "family": self.family,
            "config": None if self.config is None else self.config.to_dict(),
            "stats": _jsonable(self.stats),
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


# ---------------------------------------------------------------------------------------------------- lookups
def family_of(model: Any) -> str:
    """The decoding family of ``model`` from its config's ``model_type`` (UnknownModelTypeError otherwise)."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    family = _MODEL_TYPES.get(str(model_type).lower()) if model_type is not None else None
    if family is None:
        raise UnknownModelTypeError(
            f"cannot decode a model with model_type={model_type!r} as a diffusion LM; supported: llada, Dream, sdar; "
            "fix: load a LLaDA, Dream or SDAR checkpoint (Qwen3 targets use spiffy.ddtree_generate)"
        )
    return family


def _tokenizer_token_id(tokenizer: Any, token: str) -> int | None:
    if tokenizer is None or not hasattr(tokenizer, "convert_tokens_to_ids"):
        return None
    try:
        tid = tokenizer.convert_tokens_to_ids(token)
    except Exception:  # noqa: BLE001 - tokenizers raise various errors for unknown tokens
        return None
    if tid is None or isinstance(tid, list):
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and tid == unk and token != getattr(tokenizer, "unk_token", None):
        return None
    return int(tid)


def resolve_mask_id(model: Any, family: str, config: DecodeConfig, tokenizer: Any = None) -> int:
    """The mask id: ``config.mask_id``, else the model config, else the tokenizer's mask token."""
    if config.mask_id is not None:
        return int(config.mask_id)
    cfg = getattr(model, "config", None)
    value = getattr(cfg, "mask_token_id", None)
    if value is not None:
        return int(value)
    if tokenizer is not None:
        value = getattr(tokenizer, "mask_token_id", None)
        if value is not None:
            return int(value)
        try:
            from spiffy.models.registry import family_spec

            token = family_spec(family).mask_token
        except Exception:  # noqa: BLE001
            token = None
        if token is not None:
            tid = _tokenizer_token_id(tokenizer, token)
            if tid is not None:
                return tid
    raise MissingTokenError(
        f"no mask token id for this {family} model: the config has no mask_token_id and no tokenizer provides one; "
        "fix: pass mask_id=... (or a tokenizer with the family's mask token)"
    )


def resolve_eos_eot(model: Any, family: str, tokenizer: Any = None) -> tuple[int | None, int | None]:
    """``(eos_id, eot_id)`` from the model config (``eos_token_id``, ``eot_token_id``) or the tokenizer."""
    cfg = getattr(model, "config", None)
    eos = getattr(cfg, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    eot = getattr(cfg, "eot_token_id", None)
    if eot is None:
        for token in _EOT_TOKENS.get(family, ()):
            eot = _tokenizer_token_id(tokenizer, token)
            if eot is not None:
                break
    return (None if eos is None else int(eos)), (None if eot is None else int(eot))


def context_length(model: Any) -> int | None:
    """The model's context window from its config (``max_position_embeddings`` / ``max_sequence_length``)."""
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "max_sequence_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _as_batch(input_ids: Any) -> torch.Tensor:
    if isinstance(input_ids, dict) or hasattr(input_ids, "keys"):
        input_ids = input_ids["input_ids"]
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids[None, :]
    if input_ids.dim() != 2:
        raise ConfigError(f"input_ids must be [B, P] or [P], got shape {tuple(input_ids.shape)}")
    return input_ids.to(torch.long)


# ---------------------------------------------------------------------------------------------------- sessions
def make_session(
    model: Any,
    input_ids: Any,
    config: DecodeConfig | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    family: str | None = None,
    **config_overrides: Any,
) -> DecodeSession:
    """A prepared :class:`~spiffy.decoding.session.DecodeSession` for ``model``'s family.

    Args:
        model: a loaded LLaDA, Dream or SDAR model.
        input_ids: ``[B, P]`` (or ``[P]``) prompt ids; ragged batches left padded with ``attention_mask``.
        config: decoding configuration (default :class:`DecodeConfig`); ``config_overrides`` replace fields.
        attention_mask: ``[B, P]`` 0/1 prompt mask (LLaDA/Dream).
        tokenizer: used to find special token ids missing from the config.
        generator: the random generator to consume (default: a new one seeded with ``config.seed``).
        family: force the family instead of reading ``model.config.model_type``.
    Raises:
        ConfigError (bad field), PromptTooLongError, MissingTokenError, UnknownModelTypeError.
    """
    family = family_of(model) if family is None else family.lower()
    ids = _as_batch(input_ids)
    if family == "sdar":
        try:
            from spiffy.decoding.sdar import make_session as sdar_make_session
        except ModuleNotFoundError as exc:  # pragma: no cover - depends on the build
            raise ConfigError(f"SDAR decoding is unavailable ({exc}); fix: install the full spiffy package") from exc
        gen_length = int(config_overrides.get("gen_length") or (config.gen_length if config is not None else DecodeConfig.gen_length))
        _check_context(model, ids.shape[1], gen_length)
        return sdar_make_session(
            model, ids, config, attention_mask=attention_mask, tokenizer=tokenizer, generator=generator, **config_overrides
        )
    cfg = config if config is not None else DecodeConfig()
    if config_overrides:
        cfg = cfg.replace(**config_overrides)
    _check_context(model, ids.shape[1], cfg.gen_length)
    mask_id = resolve_mask_id(model, family, cfg, tokenizer)
    if family == "llada":
        from spiffy.decoding.llada import LLaDASession

        eos, eot = resolve_eos_eot(model, family, tokenizer)
        if (cfg.logits_eos_inf or cfg.confidence_eos_eot_inf) and eos is None:
            raise MissingTokenError(
                "logits_eos_inf / confidence_eos_eot_inf need the EOS id but neither the config nor the tokenizer "
                "has one; fix: pass a tokenizer or set eos_token_id in config.json"
            )
        return LLaDASession(
            model, ids, cfg, mask_id=mask_id, attention_mask=attention_mask, generator=generator, eos_id=eos, eot_id=eot
        )
    if family == "dream":
        from spiffy.decoding.dream import DreamSession

        return DreamSession(model, ids, cfg, mask_id=mask_id, attention_mask=attention_mask, generator=generator)
    raise UnknownModelTypeError(f"unknown decoding family {family!r}; fix: use llada, dream or sdar")


def _check_context(model: Any, prompt_len: int, gen_length: int) -> None:
    ctx = context_length(model)
    if ctx is not None and prompt_len + gen_length > ctx:
        raise PromptTooLongError(
            f"prompt ({prompt_len} tokens) + gen_length ({gen_length}) = {prompt_len + gen_length} exceeds the "
            f"model's context of {ctx} positions; fix: shorten the prompt or lower gen_length to at most "
            f"{max(ctx - prompt_len, 0)}"
        )


# ---------------------------------------------------------------------------------------------------- generate
def generate(
    model: Any,
    input_ids: Any,
    config: DecodeConfig | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    tokenizer: Any = None,
    graph: Any = None,
    budget: int | None = None,
    observer: StepObserver | None = None,
    progress: bool = False,
    generator: torch.Generator | None = None,
    **config_overrides: Any,
) -> DiffusionResult:
    """Decode ``input_ids`` with ``model`` (LLaDA, Dream or SDAR).

    Args:
        model: a loaded dLLM (``spiffy.load_model``).
        input_ids: ``[B, P]`` / ``[P]`` prompt ids (or a tokenizer's BatchEncoding).
        config: a :class:`DecodeConfig` (default one if ``None``); ``config_overrides`` (e.g. ``gen_length=64``)
            replace fields.
        attention_mask: ``[B, P]`` for left-padded batches (LLaDA/Dream baseline).
        tokenizer: for special-token lookup and ``result.text``.
        graph: ``None`` = baseline; a calibrated :class:`~spiffy.selfspec.graph.DraftGraph` = Spiffy speculative
            decoding (identical tokens, fewer forwards; batch size 1).
        budget: draft nodes kept per step with a graph (``None`` = the runtime's default).
        observer: called with every :class:`~spiffy.decoding.session.StepRecord`.
        progress: show a tqdm progress bar (steps) on stderr.
        generator: the random generator to consume (default: seeded from ``config.seed``).
    Returns:
        :class:`DiffusionResult`.
    """
    if isinstance(input_ids, dict) or hasattr(input_ids, "keys"):
        if attention_mask is None and "attention_mask" in input_ids:
            attention_mask = input_ids["attention_mask"]
        input_ids = input_ids["input_ids"]
    session = make_session(
        model, input_ids, config, attention_mask=attention_mask, tokenizer=tokenizer, generator=generator, **config_overrides
    )
    cfg = getattr(session, "config", None)
    bar = _progress_bar(session, cfg, progress)
    tick: Callable[[int], None] | None = (lambda n: bar.update(n)) if bar is not None else None
    t0 = time.perf_counter()
    try:
        if graph is None:
            base = run_baseline(session, observer=observer, progress=tick)
            stats = dataclasses.asdict(base)
            nfe, steps = base.nfe, base.steps
        else:
            speculative_generate = _speculative_entry()
            _check_graph(graph, model, session)
            kwargs: dict[str, Any] = {"observer": observer, "progress": tick}
            spec = speculative_generate(session, graph, budget, **kwargs)
            stats = spec.to_dict() if hasattr(spec, "to_dict") else dict(vars(spec))
            nfe, steps = int(spec.nfe), int(spec.steps)
        if session.x.device.type == "cuda":
            torch.cuda.synchronize(session.x.device)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    seqs = session.x
    p = int(session.prompt_len)
    # SDAR aligns blocks to absolute positions, so an unaligned prompt decodes a few positions past gen_length (as
    # the reference does); ``sequences`` keeps them, ``tokens``/``text`` report the gen_length requested.
    gen = int(getattr(cfg, "gen_length", seqs.shape[1] - p) or (seqs.shape[1] - p))
    tokens = [row.tolist() for row in seqs[:, p : p + gen].cpu()]
    text = None
    if tokenizer is not None and hasattr(tokenizer, "batch_decode"):
        text = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    return DiffusionResult(
        sequences=seqs,
        tokens=tokens,
        nfe=int(nfe),
        steps=int(steps),
        seconds=seconds,
        stats=stats,
        text=text,
        prompt_len=p,
        config=cfg,
        family=family_of(model),
    )


def _speculative_entry() -> Callable[..., Any]:
    try:
        from spiffy.selfspec.runtime import speculative_generate
    except ImportError as exc:
        raise ConfigError(
            f"speculative decoding is unavailable in this build ({exc}); fix: install the full spiffy package, "
            "or pass graph=None for baseline decoding"
        ) from exc
    return speculative_generate


def runtime_signature(model: Any, session: DecodeSession) -> dict[str, Any]:
    """What a calibrated graph must be compatible with at run time (``DraftGraph.check_compatible`` input)."""
    cfg = getattr(session, "config", None)
    sig: dict[str, Any] = {
        "family": family_of(model),
        "model": getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None),
        "mask_id": int(session.mask_id),
        "block_length": int(session.block_length),
    }
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
        if sig["family"] == "dream" and sig["tokens_per_step"] != "dynamic":
            # Dream's static schedule (int(n_masked * (1 - s/t)) per step) is not uniform: node sizes may vary by level
            sig["tokens_per_step"] = None
    try:  # the model-config fingerprint used by graph files (H4's helper when present)
        from spiffy.selfspec import graph as graph_mod

        fp = getattr(graph_mod, "model_config_fingerprint", None)
        if fp is not None:
            sig["config_fingerprint"] = fp(model)
    except ImportError:
        pass
    return sig


def _check_graph(graph: Any, model: Any, session: DecodeSession) -> None:
    check = getattr(graph, "check_compatible", None)
    if callable(check):
        check(runtime_signature(model, session))


def _progress_bar(session: DecodeSession, cfg: Any, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return None
    total = None
    if isinstance(cfg, DecodeConfig) and cfg.tokens_per_step != "dynamic":
        total = int(cfg.resolved_steps)
    return tqdm(total=total, desc="denoising", unit="step", file=sys.stderr, leave=False)


# ---------------------------------------------------------------------------------------------------- wrappers
def _default_generator(device: torch.device) -> torch.Generator:
    """The device's global generator (what ``torch.manual_seed`` seeds)."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]
    return torch.default_generator


def _device_of(model: Any) -> torch.device:
    from spiffy.decoding.base import model_device

    return model_device(model)


@torch.no_grad()
def llada_generate(
    model: Any,
    prompt: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    steps: int = 128,
    gen_length: int = 128,
    block_length: int = 128,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    mask_id: int | None = None,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    graph: Any = None,
    budget: int | None = None,
    *,
    threshold: float | None = None,
    cache: str = "none",
    seed: int | None = None,
    tokenizer: Any = None,
    return_result: bool = False,
) -> torch.Tensor | DiffusionResult:
    """Drop-in for ML-GSAI/LLaDA ``generate`` (same arguments and defaults; returns ``x [B, P + gen_length]``).

    Without ``seed`` the draws come from the device's global generator, so ``torch.manual_seed(K)`` before the
    call reproduces the official script (no cache). Extras: ``threshold`` (Fast-dLLM), ``cache``
    (``"none"``/``"prefix"``/``"dual"``), ``graph``/``budget`` (Spiffy; same tokens, fewer forwards),
    ``return_result`` (the full :class:`DiffusionResult`).
    """
    cfg = DecodeConfig(
        gen_length=int(gen_length),
        block_length=int(block_length),
        steps=int(steps),
        threshold=threshold,
        remasking=remasking,
        temperature=float(temperature),
        cfg_scale=float(cfg_scale),
        logits_eos_inf=bool(logits_eos_inf),
        confidence_eos_eot_inf=bool(confidence_eos_eot_inf),
        cache=cache,
        seed=seed,
        mask_id=mask_id,
    )
    generator = None if seed is not None else _default_generator(_device_of(model))
    res = generate(
        model, prompt, cfg, attention_mask=attention_mask, tokenizer=tokenizer, graph=graph, budget=budget, generator=generator
    )
    return res if return_result else res.sequences


@dataclass
class DreamGenerateOutput:
    """What ``dream_diffusion_generate(..., return_dict_in_generate=True)`` returns (like Dream's ModelOutput)."""

    sequences: torch.Tensor
    history: tuple[torch.Tensor, ...] | None = None
    result: DiffusionResult | None = None


@torch.no_grad()
def dream_diffusion_generate(
    model: Any,
    inputs: torch.Tensor,
    generation_config: Any = None,
    *,
    attention_mask: torch.Tensor | None = None,
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    steps: int = 512,
    eps: float = 1e-3,
    alg: str = "origin",
    alg_temp: float | None = None,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    output_history: bool = False,
    return_dict_in_generate: bool = False,
    mask_token_id: int | None = None,
    block_length: int | None = None,
    threshold: float | None = None,
    dual_cache: bool = False,
    cache: str | None = None,
    seed: int | None = None,
    tokenizer: Any = None,
    graph: Any = None,
    budget: int | None = None,
    **unused: Any,
) -> torch.Tensor | DreamGenerateOutput:
    """Drop-in for Dream's ``model.diffusion_generate(inputs, ...)`` (keyword-compatible; returns ``x`` or, with
    ``return_dict_in_generate``, an object with ``sequences`` and ``history``).

    ``gen_length`` = ``max_new_tokens``, else ``max_length - P``, else 20 (Dream's default ``max_length``). Fast-dLLM
    extras: ``block_length``, ``threshold`` (or ``alg="confidence_threshold"``, threshold 0.9 by default),
    ``dual_cache`` / ``cache``. A ``generation_config`` object's matching attributes are read when the keywords
    are not given. Without ``seed`` the device's global generator is consumed.
    """
    if generation_config is not None:
        def pick(name: str, current: Any, default: Any) -> Any:
            return getattr(generation_config, name, current) if current == default else current

        max_length = pick("max_length", max_length, None)
        max_new_tokens = pick("max_new_tokens", max_new_tokens, None)
        steps = pick("steps", steps, 512)
        eps = pick("eps", eps, 1e-3)
        alg = pick("alg", alg, "origin")
        alg_temp = pick("alg_temp", alg_temp, None)
        temperature = pick("temperature", temperature, 0.0)
        top_p = pick("top_p", top_p, None)
        top_k = pick("top_k", top_k, None)
        mask_token_id = pick("mask_token_id", mask_token_id, None)
        output_history = pick("output_history", output_history, False)
        return_dict_in_generate = pick("return_dict_in_generate", return_dict_in_generate, False)
    if unused:
        known = {"generation_tokens_hook_func", "generation_logits_hook_func"}
        bad = sorted(set(unused) - known)
        if bad:
            raise ConfigError(f"unknown diffusion_generate option(s) {', '.join(bad)}; fix: remove them")
    ids = _as_batch(inputs)
    p = ids.shape[1]
    if max_new_tokens is not None:
        gen_length = int(max_new_tokens)
    elif max_length is not None:
        gen_length = int(max_length) - p
    else:
        gen_length = 20
    if gen_length < 1:
        raise ConfigError(
            f"max_length={max_length} leaves no room after the {p}-token prompt; fix: pass max_new_tokens=N"
        )
    if alg == "confidence_threshold":
        alg = "maskgit_plus"
        threshold = 0.9 if threshold is None else threshold
    # Fast-dLLM's block variant (block_length given) always runs with a cache; the original has none
    mode = cache if cache is not None else ("dual" if dual_cache else ("prefix" if block_length is not None else "none"))
    cfg = DecodeConfig(
        gen_length=gen_length,
        block_length=block_length,
        steps=int(steps),
        threshold=threshold,
        temperature=float(temperature),
        cache=mode,
        seed=seed,
        alg=alg,
        alg_temp=alg_temp,
        eps=float(eps),
        top_p=top_p,
        top_k=top_k,
        mask_id=mask_token_id,
    )
    history: list[torch.Tensor] | None = [] if (output_history and return_dict_in_generate) else None
    observer = None
    if history is not None:
        def observer(rec: StepRecord) -> None:
            history.append(rec.x_after.clone())

    generator = None if seed is not None else _default_generator(_device_of(model))
    res = generate(
        model, ids, cfg, attention_mask=attention_mask, tokenizer=tokenizer, graph=graph, budget=budget,
        observer=observer, generator=generator,
    )
    if return_dict_in_generate:
        return DreamGenerateOutput(sequences=res.sequences, history=None if history is None else tuple(history), result=res)
    return res.sequences


__all__ = [
    "DiffusionResult",
    "DreamGenerateOutput",
    "context_length",
    "dream_diffusion_generate",
    "family_of",
    "generate",
    "llada_generate",
    "make_session",
    "resolve_eos_eot",
    "resolve_mask_id",
    "runtime_signature",
]
