"""Byte-level BPE tokenizers for the tiny demo models, one per model family.

Each family gets its special tokens and chat template in the style of the real checkpoints:

* ``llada``: ``<|endoftext|>`` (EOS/pad), ``<|startoftext|>`` (BOS), ``<|mdm_mask|>`` (mask), ``<|eot_id|>``,
  ``<|start_header_id|>``, ``<|end_header_id|>``; Llama-3 style chat template.
* ``qwen3`` (also used by the DFlash drafter, which shares the target's vocabulary): ``<|endoftext|>`` (EOS/pad),
  ``<|im_start|>``, ``<|im_end|>``, ``<|MASK|>`` (DFlash mask); ChatML template.

Built with :func:`spiffy.models.tokenizer.build_tokenizer` (the library's conventions: special tokens after the learned
vocabulary, left padding); ids are always read from the tokenizer, never hard-coded.
Saved as ``tokenizer.json`` + ``tokenizer_config.json``, loadable with ``AutoTokenizer.from_pretrained(dir)``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from spiffy.errors import ConfigError
from spiffy.io import atomic_write_bytes
from spiffy.models.registry import family_spec
from spiffy.models.tokenizer import build_tokenizer
from spiffy.train.corpus import build_corpus, load_split

#: family -> its special tokens in id order (from the family registry)
FAMILY_SPECIALS: dict[str, list[str]] = {f: list(family_spec(f).special_tokens) for f in ("llada", "qwen3")}

def train_tokenizer(texts: Iterable[str], family: str, out_dir: str | os.PathLike[str] | None = None,
                    vocab_size: int = 4096):
    """Train a byte-level BPE on ``texts`` with ``family``'s special tokens; returns a ``PreTrainedTokenizerFast``.

    Delegates to :func:`spiffy.models.tokenizer.build_tokenizer` (same special-token conventions as the library's
    test tokenizers: specials after the learned vocabulary, left padding, the family's chat template).
    ``vocab_size`` counts everything (256 byte symbols, merges and special tokens). Saved to ``out_dir`` if given.
    """
    if family not in FAMILY_SPECIALS:
        raise ConfigError(f"unknown tokenizer family {family!r}; fix: use one of {sorted(FAMILY_SPECIALS)}")
    fast = build_tokenizer(family, vocab_size=vocab_size, corpus=list(texts))
    if family == "qwen3" and fast.mask_token is None:
        fast.mask_token = family_spec("dflash").mask_token  # the DFlash drafter's mask token, so it is easy to find
    if out_dir is not None:
        save_tokenizer(fast, out_dir)
    return fast


def save_tokenizer(tokenizer, out_dir: str | os.PathLike[str]) -> None:
    """Save ``tokenizer`` into ``out_dir`` (written to a temp dir first, then each file written atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".tok.") as tmp:
        tokenizer.save_pretrained(tmp)
        for f in Path(tmp).iterdir():
            atomic_write_bytes(out / f.name, f.read_bytes())


def special_ids(tokenizer, family: str) -> dict[str, int]:
    """Ids of the family's special tokens, read from the tokenizer: ``{token: id}``."""
    return {s: int(tokenizer.convert_tokens_to_ids(s)) for s in FAMILY_SPECIALS[family]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train a byte-level BPE tokenizer on the stdlib corpus.")
    p.add_argument("--family", choices=sorted(FAMILY_SPECIALS), required=True, help="model family (special tokens)")
    p.add_argument("--out", required=True, help="output dir for tokenizer.json + tokenizer_config.json")
    p.add_argument("--corpus", default=None, help="corpus dir (built if missing; default ~/.cache/spiffy/corpus)")
    p.add_argument("--vocab-size", type=int, default=4096, help="total vocabulary size")
    a = p.parse_args(argv)
    info = build_corpus(a.corpus)
    tok = train_tokenizer(load_split(info.out_dir, "train"), a.family, a.out, a.vocab_size)
    print(f"saved {a.family} tokenizer (vocab {len(tok)}) to {a.out}; specials {special_ids(tok, a.family)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
