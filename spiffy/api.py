"""The public dLLM decoding API: :func:`generate`, :func:`make_session` and :class:`DiffusionResult`.

``generate(model, input_ids, config)`` decodes with the family's baseline rule (``graph=None``) or with Spiffy
self-speculation (a calibrated draft graph; same tokens, fewer model calls). Families are recognised from the
model config's ``model_type`` (``llada``, ``Dream``, ``sdar``). Token ids (mask, EOS, EoT) come from the config or
the tokenizer, never from constants.

This module is the front door: it sits above both paths it dispatches to, the baseline sessions
(:mod:`spiffy.decoding`) and the speculative runtime (:mod:`spiffy.selfspec`). The familiar-signature wrappers
(LLaDA ``generate``, Dream ``diffusion_generate``, SDAR ``block_diffusion_generate``) live in :mod:`spiffy.compat`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from spiffy.batch_invariance import batch_invariant as invariant_mode
from spiffy.batch_invariance import is_batch_invariant
from spiffy.capture import CompileSetting, compile_fuses, resolve_compile
from spiffy.decoding.batch import row_generators, run_baseline_batch
from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.factory import make_row_sessions, make_session
from spiffy.decoding.session import DecodeSession, StepObserver
from spiffy.models.loading import family_of
from spiffy.selfspec.config import SpiffyConfig
from spiffy.selfspec.graph import runtime_signature
from spiffy.selfspec.runtime import speculative_generate_batch


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
        prompt_len: rows of the prompt in ``sequences`` (the left-padded prompt width of a batch; for an SDAR
            batch of ragged prompts the smallest of ``gen_starts``).
        config: the decoding configuration used.
        family: ``"llada"``, ``"dream"`` or ``"sdar"``.
        gen_starts: column of ``sequences`` where row ``r``'s generated tokens start (``prompt_len`` for every row
            except in an SDAR batch of ragged prompts, whose rows keep their own block anchoring).
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
    gen_starts: list[int] = field(default_factory=list)

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


def generate(
    model: Any,
    input_ids: Any,
    config: DecodeConfig | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    tokenizer: Any = None,
    graph: Any = None,
    budget: int | None = None,
    score: str | None = None,
    observer: StepObserver | None = None,
    progress: bool = False,
    generator: torch.Generator | None = None,
    seeds: Sequence[int] | None = None,
    batch_invariant: bool = False,
    compile: CompileSetting = None,
    **config_overrides: Any,
) -> DiffusionResult:
    """Decode ``input_ids`` with ``model`` (LLaDA, Dream or SDAR).

    Args:
        model: a loaded dLLM (``spiffy.load_model``).
        input_ids: ``[B, P]`` / ``[P]`` prompt ids (or a tokenizer's BatchEncoding).
        config: a :class:`DecodeConfig` (default one if ``None``); ``config_overrides`` (e.g. ``gen_length=64``)
            replace fields.
        attention_mask: ``[B, P]`` for left-padded batches of ragged prompts.
        tokenizer: for special-token lookup and ``result.text``.
        graph: ``None`` = baseline; a calibrated :class:`~spiffy.selfspec.graph.DraftGraph` (or a
            :class:`~spiffy.selfspec.config.SpiffyConfig` holding it with its budget and score) = Spiffy speculative
            decoding (identical tokens, fewer forwards). Every path runs the one batch-first loop
            (:mod:`spiffy.decoding.batch`): a single prompt is a batch of one; a batch (``B > 1``, left padded, or
            ``seeds`` given) gives each prompt its own row session, so row ``r`` equals prompt ``r`` decoded alone with
            its seed (see ``generator``), with or without a graph.
        budget: draft nodes kept per step with a graph (``None`` = the ``D*`` the graph was tuned for, else 3).
        score: the pruning score that picks them (:data:`spiffy.selfspec.pruning.SCORES`; ``None`` = the one the
            graph was calibrated for, else ``"gm"``).
        observer: called with every :class:`~spiffy.decoding.session.StepRecord` (one prompt at a time only).
        progress: show a tqdm progress bar (denoising steps, of every row) on stderr.
        generator: the random generator to consume (default: seeded from ``config.seed``). A batch gives every
            row its own generator: from ``seeds``, else one seed per row drawn from ``generator`` in row order,
            else ``config.seed`` for every row (:func:`spiffy.decoding.batch.row_generators`). The official
            scripts' batched sampling (one generator for the whole batch) is the batch session's own rule:
            ``run_baseline(make_session(model, ids, ...))``.
        seeds: ``B`` seeds, row ``r`` seeded exactly like a single-prompt call with ``seed=seeds[r]``.
        batch_invariant: decode in :func:`spiffy.batch_invariant` mode (exact sums: a row's numbers do not depend on
            the other rows, states or padding of a forward, so Spiffy and batched rows equal the baseline bitwise in
            every dtype and on every device; compare with a baseline decoded in the same mode).
        compile: the static path of every step's forward (``True`` / ``"on"``): static buffers, one CUDA graph per
            (states, window) bucket on a GPU, the same code eagerly on a CPU; ``False`` / ``"off"``: eager (the
            reference); ``None`` / ``"auto"``: :func:`spiffy.capture.resolve_compile`; ``"inductor"``: the steps
            compiled by TorchInductor too (fused kernels: tokens equal eager's up to near ties). Same tokens either way;
            ``result.stats["capture"]`` reports the buckets. Every family has a static path; Fast-dLLM v2's sub-block
            cache (``cache="dual"``, whose forward's shape depends on the state) refuses ``True``.
    Returns:
        :class:`DiffusionResult`.
    """
    if batch_invariant and not is_batch_invariant():
        with invariant_mode(model=model):
            return generate(model, input_ids, config, attention_mask=attention_mask, tokenizer=tokenizer, graph=graph,
                            budget=budget, score=score, observer=observer, progress=progress, generator=generator,
                            seeds=seeds, compile=compile, **config_overrides)
    if isinstance(input_ids, dict) or hasattr(input_ids, "keys"):
        if attention_mask is None and "attention_mask" in input_ids:
            attention_mask = input_ids["attention_mask"]
        input_ids = input_ids["input_ids"]
    session = make_session(
        model, input_ids, config, attention_mask=attention_mask, tokenizer=tokenizer, generator=generator, **config_overrides
    )
    settings = None if graph is None else SpiffyConfig.of(graph, budget, score)
    cfg = session.config  # type: ignore[attr-defined]
    alone = session.x.shape[0] == 1 and seeds is None  # a single prompt: the session is its own row session
    if alone:
        rows = [session]
    else:  # the session makes the forwards of the padded batch, one row session per prompt applies the rule
        gens = row_generators(int(session.x.shape[0]), session.x.device, seeds, generator)
        rows = make_row_sessions(model, input_ids, attention_mask, cfg, gens, tokenizer=tokenizer)
    if settings is not None:
        check_graph(settings.graph, model, rows[0])
    if resolve_compile(compile, session.x.device):
        session.use_static(capture=True, fuse=compile_fuses(compile))
    return _decode(model, session, rows, settings, tokenizer=tokenizer, observer=observer, progress=progress)


def run_session(model: Any, session: DecodeSession, *, tokenizer: Any = None, observer: StepObserver | None = None,
                progress: bool = False) -> DiffusionResult:
    """Decode a prepared ``session`` with its own rule, the baseline loop: a ``[B, T]`` session is its own row
    session and follows the official batched scripts (one generator for the whole batch, each step's draws in the
    official shapes). :mod:`spiffy.compat` runs the familiar wrappers' batches through it; :func:`generate` gives
    every row its own generator instead."""
    return _decode(model, session, [session], None, tokenizer=tokenizer, observer=observer, progress=progress)


def _decode(model: Any, session: DecodeSession, rows: list[DecodeSession], settings: SpiffyConfig | None, *,
            tokenizer: Any, observer: StepObserver | None, progress: bool) -> DiffusionResult:
    """The one loop (baseline or Spiffy) over ``rows`` (``[session]``: the session applies its own rule to its
    whole batch), timed, into a :class:`DiffusionResult`."""
    cfg = session.config  # type: ignore[attr-defined]
    alone = rows == [session]  # the session is its own row session (one prompt, or the official batched stream)
    bar = _progress_bar(session, cfg if alone else None, progress)
    tick: Callable[[int], None] | None = (lambda n: bar.update(n)) if bar is not None else None
    t0 = time.perf_counter()
    try:
        if settings is None:
            base, nfe = run_baseline_batch(session, rows, progress=tick, observer=observer)
            per_row = [dataclasses.asdict(s) for s in base]
            stats: dict[str, Any] = {"batch_nfe": nfe, "rows": per_row}
        else:
            spec, nfe = speculative_generate_batch(session, rows, settings, observer=observer, progress=tick)
            per_row = [s.to_dict() for s in spec]
            stats = {
                "batch_nfe": nfe,
                "rows": per_row,
                "accepted_total": sum(s.accepted_total for s in spec),
                "baseline_equivalent_nfe": [s.baseline_equivalent_nfe for s in spec],
            }
        if session.x.device.type == "cuda":
            torch.cuda.synchronize(session.x.device)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    if session.static is not None:  # the static path's buckets: built, run, capture seconds
        capture = session.static.graphs.stats.as_dict()
        if alone:
            per_row[0] = {**per_row[0], "capture": capture}
        else:
            stats["capture"] = capture
    seqs = session.x if alone else session.x.clone()
    # SDAR aligns blocks to absolute positions, so an unaligned prompt decodes a few positions past gen_length (as
    # the reference does); ``sequences`` keeps them, ``tokens``/``text`` report the gen_length requested.
    gen_len = int(cfg.gen_length)
    starts: list[int] = []
    tokens: list[list[int]] = []
    if alone:  # the session's own rows: every row's generation area starts after the (left-padded) prompt
        starts = [int(session.prompt_len)] * int(seqs.shape[0])
        tokens = [row[start : start + gen_len].tolist() for row, start in zip(seqs, starts)]
    for r, row in enumerate([] if alone else rows):
        pad = int(seqs.shape[1]) - int(row.x.shape[1])
        seqs[r, pad:] = row.x[0].to(seqs.device)
        start = pad + int(row.prompt_len)
        starts.append(start)
        tokens.append(seqs[r, start : start + gen_len].tolist())
    text = tokenizer.batch_decode(tokens, skip_special_tokens=True) if tokenizer is not None and hasattr(tokenizer, "batch_decode") else None
    return DiffusionResult(
        sequences=seqs,
        tokens=tokens,
        nfe=int(nfe),
        steps=max(int(r["steps"]) for r in per_row),
        seconds=seconds,
        stats=per_row[0] if alone else stats,
        text=text,
        prompt_len=int(session.prompt_len),
        config=cfg,
        family=family_of(model),
        gen_starts=starts,
    )


def check_graph(graph: Any, model: Any, session: DecodeSession) -> None:
    """Raise :class:`~spiffy.errors.GraphMismatchError` when ``graph`` was calibrated for another model/rule."""
    check = getattr(graph, "check_compatible", None)
    if callable(check):
        check(runtime_signature(model, session))


def _progress_bar(session: DecodeSession, cfg: Any, enabled: bool) -> Any:
    if not enabled:
        return None
    total = session.planned_steps() if isinstance(cfg, DecodeConfig) else None
    return tqdm(total=total, desc="denoising", unit="step", file=sys.stderr, leave=False)


__all__ = ["DiffusionResult", "check_graph", "family_of", "generate", "make_session", "run_session", "runtime_signature"]
