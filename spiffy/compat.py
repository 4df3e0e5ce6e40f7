"""Familiar-signature wrappers: the official entry points of LLaDA, Dream and SDAR, on spiffy's decoders.

* :func:`llada_generate`: ML-GSAI/LLaDA ``generate(model, prompt, ...)``.
* :func:`dream_diffusion_generate`: Dream's ``model.diffusion_generate(inputs, ...)``.
* :func:`sdar_block_diffusion_generate`: JetAstra/SDAR ``block_diffusion_generate(model, prompt, ...)``.

Each keeps the official arguments and defaults and adds ``graph``/``budget`` (Spiffy self-speculation: same
tokens, fewer model calls). Without a seed the draws come from the device's global generator, so
``torch.manual_seed(K)`` before the call reproduces the official script; ``seed=K`` draws from a generator seeded
with ``K`` (the same stream).

Batches. :func:`llada_generate` and :func:`dream_diffusion_generate` decode a left-padded batch as the official
scripts do: one generator for the whole batch, each step drawing the batch's noise in the official shapes and order
(the batch session's own rule, :func:`spiffy.api.run_session`), so a seeded batch gives the official tokens. Row
``r`` then depends on the other rows' draws; :func:`spiffy.api.generate` instead gives every row its own generator
(row ``r`` equals prompt ``r`` alone). With a graph, a batch whose rule draws no random number (``T = 0``, no
``random`` remasking, Dream without ``origin`` or ``alg_temp``) runs batched Spiffy, whose rows equal the official
rows; a rule that draws is refused (:class:`~spiffy.errors.ConfigError`): Spiffy's rows accept drafts at different
steps, so they cannot consume one shared stream in the official order. :func:`sdar_block_diffusion_generate`
decodes a batch row by row (the official SDAR script takes no attention mask, so it has no ragged batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from spiffy.api import DiffusionResult, generate, run_session
from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.dream_generation import CLASS_DEFAULTS, dream_generation_options, official_call_defaults
from spiffy.decoding.factory import as_batch, make_session
from spiffy.decoding.sdar import DEFAULT_EB_THRESHOLD, SDARDecodeConfig, SDARSession
from spiffy.decoding.batch import run_baseline
from spiffy.decoding.session import StepRecord
from spiffy.errors import ConfigError
from spiffy.selfspec.runtime import speculative_generate
from spiffy.torch_utils import model_device

class _Unset:
    """A Dream option the caller left out (its value then comes from a generation config or the defaults)."""

    def __repr__(self) -> str:
        return "<default>"


_UNSET: Any = _Unset()


def _default_generator(device: torch.device) -> torch.Generator:
    """The device's global generator (what ``torch.manual_seed`` seeds)."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]
    return torch.default_generator


def _official_batch(
    model: Any,
    ids: torch.Tensor,
    cfg: DecodeConfig,
    attention_mask: torch.Tensor | None,
    *,
    tokenizer: Any,
    graph: Any,
    budget: int | None,
    seed: int | None,
    draws: str | None,
    observer: Any = None,
) -> DiffusionResult:
    """A batch through a familiar wrapper (module docstring): the batch session's own rule with one generator (the
    global one, or seeded with ``seed``), or with a graph batched Spiffy when the rule draws nothing (``draws``:
    what draws random numbers, ``None`` when nothing does)."""
    b = int(ids.shape[0])
    if graph is not None:
        if draws is not None:
            raise ConfigError(
                f"graph= on a batch of {b} prompts: the official generator draws {draws} for the whole batch from one "
                "generator, and Spiffy's rows accept drafts at different steps, so they cannot consume that stream in "
                "the official order; fix: decode with spiffy.generate(model, ids, config, graph=graph, seeds=[...]) "
                "(one generator per row: each row equals its prompt alone), pass graph=None for the official batch, "
                "or decode the prompts one at a time"
            )
        if observer is not None:
            raise ConfigError("output_history with a graph on a batch is not available; fix: pass graph=None or "
                              "decode the prompts one at a time")
        return generate(model, ids, cfg, attention_mask=attention_mask, tokenizer=tokenizer, graph=graph, budget=budget)
    device = model_device(model)
    if seed is None:
        generator = _default_generator(device)
    else:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(seed))
    session = make_session(model, ids, cfg, attention_mask=attention_mask, tokenizer=tokenizer, generator=generator)
    return run_session(model, session, tokenizer=tokenizer, observer=observer)


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
    ids = as_batch(prompt)
    if ids.shape[0] > 1:
        draws = "Gumbel noise" if float(temperature) > 0 else ("random confidences" if remasking == "random" else None)
        res = _official_batch(model, ids, cfg, attention_mask, tokenizer=tokenizer, graph=graph, budget=budget,
                              seed=seed, draws=draws)
        return res if return_result else res.sequences
    generator = None if seed is not None else _default_generator(model_device(model))
    res = generate(
        model, ids, cfg, attention_mask=attention_mask, tokenizer=tokenizer, graph=graph, budget=budget, generator=generator
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
    steps: Any = _UNSET,
    eps: Any = _UNSET,
    alg: Any = _UNSET,
    alg_temp: Any = _UNSET,
    temperature: Any = _UNSET,
    top_p: Any = _UNSET,
    top_k: Any = _UNSET,
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
    official_defaults: bool = False,
    **unused: Any,
) -> torch.Tensor | DreamGenerateOutput:
    """Drop-in for Dream's ``model.diffusion_generate(inputs, ...)`` (keyword-compatible; returns ``x`` or, with
    ``return_dict_in_generate``, an object with ``sequences`` and ``history``).

    ``gen_length`` = ``max_new_tokens``, else ``max_length - P``, else 20 (Dream's default ``max_length``). Fast-dLLM
    extras: ``block_length``, ``threshold`` (or ``alg="confidence_threshold"``, threshold 0.9 by default),
    ``dual_cache`` / ``cache``. A ``generation_config`` object's matching attributes are read when the keywords
    are not given (a dict or a ``generation_config.json`` path too; every field is checked:
    :func:`spiffy.decoding.dream_generation.dream_generation_options` refuses what Dream's generator does not have).
    Without ``seed`` the device's global generator is consumed.

    Rule options left out (``steps``, ``eps``, ``alg``, ``alg_temp``, ``temperature``, ``top_p``, ``top_k``) take
    ``DreamGenerationConfig``'s class defaults (512, 1e-3, origin, None, 0, None, None). With
    ``official_defaults=True`` they take what the official ``diffusion_generate`` uses under transformers 4.46.2
    instead (:func:`spiffy.decoding.dream_generation.official_call_defaults`: the model config's values over the
    class defaults, including ``temperature`` 1.0, ``top_k`` 50, ``top_p`` 1.0), so a call written for the official
    code gives its tokens; with a ``generation_config`` the official code starts from the class defaults, and so
    does this wrapper.
    """
    rule = {"steps": steps, "eps": eps, "alg": alg, "alg_temp": alg_temp, "temperature": temperature,
            "top_p": top_p, "top_k": top_k}
    # the official code builds its defaults from the model config only when no generation-config object is given;
    # a given one starts from DreamGenerationConfig's class defaults (its file may name only a few fields)
    use_model_config = official_defaults and generation_config is None
    resolved = official_call_defaults(model.config) if use_model_config else dict(CLASS_DEFAULTS)
    resolved.pop("mask_token_id", None)
    if generation_config is not None:
        given = dream_generation_options(generation_config)
        resolved.update({k: given[k] for k in rule if k in given})

        def pick(name: str, current: Any, default: Any) -> Any:
            return given.get(name, current) if current == default else current

        max_length = pick("max_length", max_length, None)
        max_new_tokens = pick("max_new_tokens", max_new_tokens, None)
        mask_token_id = pick("mask_token_id", mask_token_id, None)
        output_history = pick("output_history", output_history, False)
        return_dict_in_generate = pick("return_dict_in_generate", return_dict_in_generate, False)
    resolved.update({k: v for k, v in rule.items() if v is not _UNSET})
    steps, eps, alg, alg_temp = resolved["steps"], resolved["eps"], resolved["alg"], resolved["alg_temp"]
    temperature, top_p, top_k = resolved["temperature"], resolved["top_p"], resolved["top_k"]
    if unused:
        known = {"generation_tokens_hook_func", "generation_logits_hook_func"}
        bad = sorted(set(unused) - known)
        if bad:
            raise ConfigError(f"unknown diffusion_generate option(s) {', '.join(bad)}; fix: remove them")
    ids = as_batch(inputs)
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
        def record(rec: StepRecord) -> None:
            history.append(rec.x_after.clone())

        observer = record

    if ids.shape[0] > 1:
        draws = None
        if float(temperature) > 0:
            draws = "a categorical sample per masked position"
        elif alg == "origin":
            draws = "the positions to reveal (torch.rand)"
        elif alg_temp is not None and float(alg_temp) > 0:
            draws = "the positions to unmask (multinomial at alg_temp)"
        res = _official_batch(model, ids, cfg, attention_mask, tokenizer=tokenizer, graph=graph, budget=budget,
                              seed=seed, draws=draws, observer=observer)
    else:
        generator = None if seed is not None else _default_generator(model_device(model))
        res = generate(
            model, ids, cfg, attention_mask=attention_mask, tokenizer=tokenizer, graph=graph, budget=budget,
            observer=observer, generator=generator,
        )
    if return_dict_in_generate:
        return DreamGenerateOutput(sequences=res.sequences, history=None if history is None else tuple(history), result=res)
    return res.sequences



@torch.no_grad()
def sdar_block_diffusion_generate(
    model: torch.nn.Module,
    prompt: Any,
    mask_id: int | None = None,
    gen_length: int = 128,
    block_length: int = 8,
    denoising_steps: int = 8,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    remasking_strategy: str = "low_confidence_dynamic",
    confidence_threshold: float = 0.85,
    stopping_criteria_idx: Sequence[int] | int | None = None,
    *,
    eb_threshold: float = DEFAULT_EB_THRESHOLD,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    fuse_commit: bool = False,
    overwrite_quirk: bool = False,
    graph: Any = None,
    budget: int | None = None,
    return_stats: bool = False,
    **speculative_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, Any]:
    """Drop-in for SDAR's ``block_diffusion_generate`` (same positional/keyword arguments and defaults).

    Args:
        prompt: a dict/BatchEncoding with ``"input_ids"`` ``[1, P]`` (as the reference) or the tensor itself;
            ``[B, P]`` decodes a batch (left padded with the dict's ``"attention_mask"`` for ragged prompts): row
            ``r`` equals prompt ``r`` decoded alone with ``seed``, or with a seed drawn per row from the generator,
            with or without a graph (:func:`spiffy.api.generate`).
        mask_id: ``None`` = from the model config.
        seed / generator: the random source. Neither given = the device's global generator, so
            ``torch.manual_seed(K)`` before the call reproduces the official script's draws.
        eb_threshold: entropy budget for ``remasking_strategy="entropy_bounded"``.
        fuse_commit, overwrite_quirk: see :class:`SDARDecodeConfig`.
        graph, budget: a calibrated draft graph -> Spiffy speculative decoding
            (:func:`spiffy.selfspec.runtime.speculative_generate`; same tokens, fewer model calls).
        return_stats: also return the run's statistics (:class:`BaselineStats` or ``SpeculativeStats``).
    Returns:
        ``x`` ``[1, ceil((P + gen_length) / block_length) * block_length]`` (prompt, generated tokens, and masks
        in blocks never decoded because of a stop token), like the reference (a batch: one such row per prompt,
        right-aligned to the longest); with ``return_stats`` also the stats.
    """
    keyed = isinstance(prompt, dict) or hasattr(prompt, "keys")
    input_ids = prompt["input_ids"] if keyed else prompt
    attention_mask = prompt.get("attention_mask") if keyed and hasattr(prompt, "get") else None
    if temperature is None or temperature < 0:
        raise ConfigError(f"temperature={temperature!r} must be >= 0; fix: use 0 for greedy decoding")
    stops = None
    if stopping_criteria_idx is not None:
        stops = (int(stopping_criteria_idx),) if isinstance(stopping_criteria_idx, int) else tuple(int(t) for t in stopping_criteria_idx)
    cfg = SDARDecodeConfig(
        gen_length=int(gen_length),
        block_length=int(block_length),
        denoising_steps=int(denoising_steps),
        temperature=float(temperature),
        top_k=int(top_k) if top_k and int(top_k) > 0 else None,
        top_p=float(top_p) if top_p is not None and float(top_p) < 1.0 else None,
        strategy=remasking_strategy,
        # the threshold only matters to (and is only validated for) low_confidence_dynamic
        threshold=(
            float(confidence_threshold)
            if confidence_threshold is not None and remasking_strategy == "low_confidence_dynamic"
            else None
        ),
        eb_threshold=float(eb_threshold),
        seed=seed,
        fuse_commit=fuse_commit,
        overwrite_quirk=overwrite_quirk,
        stop_token_ids=stops,
        mask_id=mask_id,
    )
    model.eval()
    if generator is None and seed is None:
        generator = _default_generator(model_device(model))
    ids = as_batch(input_ids)
    if ids.shape[0] > 1:  # a batch: one seed per row (from seed, else drawn from the generator), rows as if alone
        seeds = None if seed is None else [int(seed)] * int(ids.shape[0])
        out = generate(
            model, ids, cfg, attention_mask=attention_mask, graph=graph, budget=budget, seeds=seeds, generator=generator
        )
        return (out.sequences, out.stats) if return_stats else out.sequences
    session = SDARSession(model, ids, cfg, generator=generator)
    if graph is None:
        stats: Any = run_baseline(session)
    else:
        stats = speculative_generate(session, graph, budget, **speculative_kwargs)
    return (session.x, stats) if return_stats else session.x



__all__ = ["DreamGenerateOutput", "dream_diffusion_generate", "llada_generate", "sdar_block_diffusion_generate"]
