"""Typed errors raised by spiffy.

Every error names the problem and, where one exists, the fix. Catch :class:`SpiffyError` to handle
all of them; the subclasses also inherit from the matching built-in (``ValueError``, ``FileNotFoundError``,
...) so code written against the built-ins keeps working.
"""

from __future__ import annotations


class SpiffyError(Exception):
    """Base class of every error spiffy raises on purpose."""


class ConfigError(SpiffyError, ValueError):
    """A decoding or model configuration value is invalid (e.g. ``gen_length % block_length != 0``)."""


class UnknownModelTypeError(ConfigError):
    """A checkpoint's ``config.json`` names a ``model_type`` spiffy does not implement."""


class UnsupportedTargetError(ConfigError):
    """A transformers architecture that cannot be verified exactly as an AR target (linear-attention layers whose
    recurrent state a tree mask does not reach, sliding-window layers); the message names the architecture and why."""


class QuantizationError(ConfigError):
    """A quantization that cannot run as asked: its kernels do not run on the chosen device (FP8 on a CPU), a
    package or kernel it needs is missing, or it does not fit the model (a group size that does not divide a layer).
    The message names the method, the device or layer, and what to do. spiffy never falls back to a silent
    dequantize: the model that runs is the quantized model that was asked for, or none."""


class MissingTokenError(ConfigError):
    """A required special token (mask, EOS, ...) is absent from the config and the tokenizer."""


class PromptTooLongError(ConfigError):
    """Prompt plus requested generation exceeds the model's context window."""


class UnsupportedDecodingError(ConfigError):
    """A decoding option Spiffy cannot keep exact (e.g. LLaDA2.1 token editing); the message says why."""


class DecodingError(SpiffyError, RuntimeError):
    """A decoding loop cannot go on (e.g. a block its rule never finishes)."""


class CheckpointError(SpiffyError, OSError):
    """A checkpoint directory is missing, unreadable, or its tensors do not match the model."""


class CheckpointKeyError(CheckpointError):
    """Strict key matching failed: names the missing and unexpected parameter keys."""

    def __init__(self, path: str, missing: list[str], unexpected: list[str], shape_mismatch: list[str] | None = None,
                 fix: str | None = None):
        self.path = path
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.shape_mismatch = list(shape_mismatch or [])
        parts = [f"checkpoint at {path!r} does not match the model"]
        if self.missing:
            parts.append(f"missing keys ({len(self.missing)}): {', '.join(self.missing[:8])}" + (" ..." if len(self.missing) > 8 else ""))
        if self.unexpected:
            parts.append(
                f"unexpected keys ({len(self.unexpected)}): {', '.join(self.unexpected[:8])}" + (" ..." if len(self.unexpected) > 8 else "")
            )
        if self.shape_mismatch:
            parts.append(f"shape mismatches: {', '.join(self.shape_mismatch[:8])}")
        parts.append(fix or "fix: point at a checkpoint of the family named by its config.json, or rebuild it with `spiffy tiny`")
        super().__init__("; ".join(parts))


class MissingDependencyError(SpiffyError, ImportError):
    """An optional dependency a requested feature needs is not installed (the message names the pip extra)."""


class GraphError(SpiffyError, ValueError):
    """A draft-graph file or object is malformed (schema, levels, subsets, parent closure, cycles)."""


class GraphMismatchError(GraphError):
    """A draft graph was calibrated for a model or decoding configuration incompatible with the runtime one."""


class StepLimitError(DecodingError):
    """A decoding loop reached its step bound without finishing (e.g. a session whose ``block_finished`` never
    ends a block, or a verification walk over a structure that never ends): the loop stops instead of hanging."""


class DrafterMismatchError(ConfigError):
    """A DFlash drafter does not fit its target (hidden size, vocabulary, target layer ids)."""


class CheckpointNotCachedError(CheckpointError):
    """A Hub id was named, downloads are impossible (``HF_HUB_OFFLINE=1`` or no connection) and the Hugging Face
    cache does not hold it. ``.repo_id``, ``.revision`` and ``.cache_dir`` say what was looked for, and where."""

    def __init__(self, message: str, repo_id: str, revision: str | None, cache_dir: str):
        self.repo_id = repo_id
        self.revision = revision
        self.cache_dir = cache_dir
        super().__init__(message)
