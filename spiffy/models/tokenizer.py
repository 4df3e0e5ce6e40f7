"""Small offline byte-level BPE tokenizers with each family's special tokens and chat template.

:func:`build_tokenizer` trains a byte-level BPE (``tokenizers``) on a small built-in corpus - a fixed list of
Python standard-library source files read from disk - or on a corpus you pass, adds the family's special tokens
and a chat template in the family's style, and returns a ``PreTrainedTokenizerFast``. Nothing is downloaded.
The result is deterministic for a given corpus and vocabulary size.

Special tokens (placed after the learned vocabulary, so their ids are the highest; code must read them from the tokenizer or config):

* LLaDA: ``<|endoftext|>`` (eos/pad), ``<|mdm_mask|>`` (mask), ``<|eot_id|>`` (end of turn),
  ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|startoftext|>`` (bos); Llama-3 style chat template.
* Dream: ``<|endoftext|>`` (eos/pad), ``<|mask|>`` (mask), ``<|im_start|>``, ``<|im_end|>`` (end of turn);
  ChatML template with Dream's default system prompt.
* SDAR / Qwen3 / DFlash: ``<|endoftext|>`` (eos/pad), ``<|im_start|>``, ``<|im_end|>`` (end of turn),
  ``<|MASK|>`` (SDAR's / DFlash's mask); ChatML template.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from spiffy.errors import ConfigError
from spiffy.models.registry import family_spec

#: standard-library modules (relative to the stdlib dir) forming the default training corpus, in this order
DEFAULT_CORPUS_FILES: tuple[str, ...] = (
    "textwrap.py",
    "string.py",
    "functools.py",
    "heapq.py",
    "bisect.py",
    "fractions.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "collections/__init__.py",
    "random.py",
    "dataclasses.py",
    "shlex.py",
    "glob.py",
)


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus(max_chars: int = 200_000) -> list[str]:
    """The built-in training corpus: :data:`DEFAULT_CORPUS_FILES` read from this Python's stdlib (at most
    ``max_chars`` characters in total). Falls back to spiffy's own sources if the stdlib is not on disk."""
    texts: list[str] = []
    total = 0
    roots = [_stdlib_dir() / name for name in DEFAULT_CORPUS_FILES]
    files = [p for p in roots if p.is_file()]
    if not files:  # pragma: no cover - frozen / zipped interpreters
        files = sorted(Path(__file__).resolve().parent.parent.rglob("*.py"))
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text[: max(0, max_chars - total)])
        total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


#: pre-tokenizer split (the pattern of Qwen2/Qwen3 tokenizers): contractions, letter runs with one leading
#: non-letter, single digits, punctuation runs (with trailing newlines), newline runs, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(family: str, vocab_size: int = 512, corpus: Iterable[str] | None = None):  # noqa: ANN201
    """Train a byte-level BPE tokenizer for ``family`` and return it as a ``PreTrainedTokenizerFast``.

    Args:
        family: ``"llada"``, ``"dream"``, ``"sdar"``, ``"qwen3"`` or ``"dflash"``.
        vocab_size: total vocabulary size including the 256 byte symbols and the special tokens (>= 256 + the
            number of special tokens). The result may be smaller if the corpus has too few merges.
        corpus: texts to train on (default: :func:`default_corpus`).

    The tokenizer has ``bos/eos/pad/mask`` set per family, ``chat_template`` in the family's style, and
    ``padding_side="left"``.
    """
    spec = family_spec(family)
    specials = list(spec.special_tokens)
    minimum = 256 + len(specials)
    if vocab_size < minimum:
        raise ConfigError(f"vocab_size must be >= {minimum} (256 bytes + {len(specials)} special tokens), got {vocab_size}")
    texts = list(corpus) if corpus is not None else default_corpus()
    if not texts:
        raise ConfigError("build_tokenizer got an empty corpus; pass at least one text or use the default corpus")
    tok = Tokenizer(models.BPE())
    # Qwen2-style split: a newline run is its own piece, so indentation never fuses with the newline before it and a
    # prompt ending in "\n" (every HumanEval prompt) tokenizes exactly as the same text does in training.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # tokenizers trains in parallel; one thread keeps merges (ties) independent of scheduling
    previous = os.environ.get("RAYON_NUM_THREADS")
    os.environ["RAYON_NUM_THREADS"] = "1"
    try:
        tok.train_from_iterator(texts, trainer=trainer)
    finally:
        if previous is None:
            os.environ.pop("RAYON_NUM_THREADS", None)
        else:
            os.environ["RAYON_NUM_THREADS"] = previous
    # special tokens go after the learned vocabulary (high ids, as in the real checkpoints)
    tok.add_special_tokens(specials)
    kwargs: dict[str, object] = {"tokenizer_object": tok, "padding_side": "left", "clean_up_tokenization_spaces": False}
    for role, token in spec.token_roles().items():
        kwargs[f"{role}_token"] = token
    fast = PreTrainedTokenizerFast(**kwargs)
    fast.chat_template = spec.chat_template
    return fast


def python_version_tag() -> str:
    """``"3.11"``-style tag of the running interpreter (the default corpus depends on its stdlib)."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"
