"""Graph/runtime compatibility: what a graph was calibrated for versus what a run uses.

:func:`runtime_signature` describes a run (each family's session describes its own rule; the model-config
fingerprint hashes the architecture fields whose spellings the family registry holds); :func:`check_calibrated_for`
compares it with a graph's ``calibrated_for`` section.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from typing import Any, Mapping

from spiffy.checkpoint_ref import checkpoint_name, split_reference
from spiffy.decoding.factory import recalibration_flags
from spiffy.models.loading import family_of
from spiffy.errors import GraphMismatchError
from spiffy.models.registry import fingerprint_fields

#: ``calibrated_for`` fields whose difference makes a graph unusable at run time (GraphMismatchError).
INCOMPATIBLE_FIELDS: tuple[str, ...] = (
    "family",
    "config_fingerprint",
    "mask_id",
    "block_length",
    "steps_per_block",
    "threshold",
    "remasking",
    "alg",
    "strategy",
    "cache",
    "tokens_per_step",
)

#: ``calibrated_for`` fields that may differ (the graph still works; acceptance may be lower).
SOFT_FIELDS: tuple[str, ...] = ("model", "temperature")


_ALIASES: dict[str, str] = {
    "cache_mode": "cache",
    "model_type": "family",
    "mask_token_id": "mask_id",
    "fingerprint": "config_fingerprint",
    "model_fingerprint": "config_fingerprint",
    "model_path": "model",
}



class GraphCompatibilityWarning(UserWarning):
    """A graph is usable at run time but was calibrated under a different soft setting (model path, temperature)."""



def check_calibrated_for(
    calibrated_for: Mapping[str, Any], runtime: Mapping[str, Any], *, path: str | None = None, warn: bool = True
) -> None:
    """Compare the graph's ``calibrated_for`` with the runtime configuration.

    Args:
        runtime: runtime values keyed like ``calibrated_for`` (e.g. from
            :func:`runtime_signature`); fields absent on either side are not compared.
        warn: emit a :class:`GraphCompatibilityWarning` when a soft field differs (the model, compared by
            :func:`model_name`; the temperature).
    Raises:
        GraphMismatchError: an incompatible field differs; ``.field``, ``.graph_value``, ``.runtime_value`` name
            the first, ``.mismatches`` lists all ``(field, graph value, runtime value)``.
    """
    cf = _normalize(calibrated_for)
    rt = _normalize(runtime)
    if cf.get("threshold") is not None and rt.get("threshold") is not None:
        # the step count does not shape threshold decoding (blocks end when fully unmasked)
        cf.pop("steps_per_block", None)
        rt.pop("steps_per_block", None)
    mismatches = [
        (f, cf[f], rt[f]) for f in INCOMPATIBLE_FIELDS if f in cf and f in rt and not _same(cf[f], rt[f])
    ]
    if mismatches:
        where = f"graph {path!r}" if path else "the draft graph"
        diffs = "; ".join(f"{f}: graph {g!r} vs runtime {r!r}" for f, g, r in mismatches)
        field_flags = recalibration_flags()
        flags = sorted({field_flags[f] for f, _, _ in mismatches if f in field_flags})
        model = rt.get("model") or "MODEL_DIR"
        hint = f" (set {', '.join(flags)} like this run)" if flags else ""
        err = GraphMismatchError(
            f"{where} was calibrated for another model or decoding configuration - {diffs}; "
            f"fix: recalibrate with `spiffy calibrate --model {model} --prompts default --out NEW_GRAPH.json` "
            f"using this run's decoding flags{hint}, or pass a graph calibrated for this configuration"
        )
        err.field, err.graph_value, err.runtime_value = mismatches[0]  # type: ignore[attr-defined]
        err.mismatches = mismatches  # type: ignore[attr-defined]
        raise err
    if warn:
        soft = [(f, cf[f], rt[f]) for f in SOFT_FIELDS if f in cf and f in rt and not _same_soft(f, cf[f], rt[f])]
        if soft:
            diffs = "; ".join(f"{f}: graph {g!r} vs runtime {r!r}" for f, g, r in soft)
            warnings.warn(
                f"draft graph calibrated under different settings ({diffs}); decoding stays lossless, "
                "acceptance may be lower - recalibrate with `spiffy calibrate` for the best speedup",
                GraphCompatibilityWarning,
                stacklevel=3,
            )


#: model-config fields that define the architecture: the union of every family's spellings, which the family
#: registry holds (:func:`spiffy.models.registry.fingerprint_fields`).
ARCH_FIELDS: tuple[str, ...] = fingerprint_fields()



def model_config_fingerprint(model_or_config: Any) -> str:
    """Stable 16-hex-digit hash of a model config's architecture fields (:data:`ARCH_FIELDS`).

    Args:
        model_or_config: a model (its ``.config`` is used), a transformers config object, or a plain dict.
    """
    cfg = getattr(model_or_config, "config", model_or_config)
    if isinstance(cfg, Mapping):
        get = cfg.get
    else:
        def get(name: str, default: Any = None) -> Any:
            return getattr(cfg, name, default)
    aliases = set(getattr(cfg, "attribute_map", {}) or {}) if not isinstance(cfg, Mapping) else set()
    values: dict[str, Any] = {}
    for name in ARCH_FIELDS:
        if name in aliases:  # e.g. LLaDA's hidden_size -> d_model: hash the stored spelling only
            continue
        v = get(name, None)
        if name == "rope_theta" and v is None:
            rp = get("rope_parameters", None)
            if isinstance(rp, Mapping):
                v = rp.get("rope_theta")
        if v is None:
            continue
        values[name] = _canon(v)
    if isinstance(values.get("model_type"), str):
        values["model_type"] = values["model_type"].lower()
    payload = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]



def runtime_signature(model: Any, session: Any) -> dict[str, Any]:
    """What a calibrated graph must be compatible with at run time (:meth:`DraftGraph.check_compatible` input):
    the ``calibrated_for`` values of ``model`` + ``session``; calibration writes the same values."""
    sig: dict[str, Any] = {
        "family": family_of(model),
        "model": getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None),
    }
    sig.update(session.rule_signature())  # each family's session describes its own rule
    sig["config_fingerprint"] = model_config_fingerprint(model)
    return sig



def _canon(v: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return float(v)  # 5e5 and 500000 hash alike
    if isinstance(v, Mapping):
        return {str(k): _canon(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_canon(x) for x in v]
    return str(v)



def _normalize(d: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in dict(d).items():
        out.setdefault(_ALIASES.get(k, k), v)
    if isinstance(out.get("family"), str):
        out["family"] = out["family"].lower()
    return out



def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return a == b



def model_name(path_or_id: Any) -> Any:
    """The name a graph's ``model`` field is compared by: the last component of a directory path or hub id
    (``/a/b/tiny-llada`` and ``C:\\x\\tiny-llada`` -> ``tiny-llada``; ``GSAI-ML/LLaDA-8B-Instruct``, with any
    ``@REVISION``, and its cache snapshot ``.../models--GSAI-ML--LLaDA-8B-Instruct/snapshots/COMMIT`` ->
    ``LLaDA-8B-Instruct``), so the same checkpoint in another checkout or cache directory is the same model."""
    return checkpoint_name(path_or_id)


def with_model_revision(calibrated_for: Any) -> Any:
    """``calibrated_for`` with a Hub reference in ``model`` (``ORG/NAME@COMMIT`` or a cache snapshot path) split
    into ``model: ORG/NAME`` and ``model_revision: COMMIT`` (placed right after it); anything else unchanged."""
    if not isinstance(calibrated_for, dict) or "model_revision" in calibrated_for:
        return calibrated_for
    model, revision = split_reference(calibrated_for.get("model"))
    if revision is None:
        return calibrated_for
    out: dict[str, Any] = {}
    for key, value in calibrated_for.items():
        out[key] = model if key == "model" else value
        if key == "model":
            out["model_revision"] = revision
    return out


def _same_soft(field_name: str, a: Any, b: Any) -> bool:
    if field_name == "model":
        return model_name(a) == model_name(b)
    return _same(a, b)



__all__ = [
    "ARCH_FIELDS",
    "INCOMPATIBLE_FIELDS",
    "SOFT_FIELDS",
    "GraphCompatibilityWarning",
    "check_calibrated_for",
    "model_config_fingerprint",
    "model_name",
    "runtime_signature",
]
