"""Prompts in and stops out: how a user message becomes token ids, and which ids end a response.

Both are facts about a model and its tokenizer, asked by calibration, the benchmarks and the command line alike:

* :func:`prompt_token_ids`: one user message as token ids, through the tokenizer's chat template when asked.
* :func:`stop_token_ids`: the ids that end generation: every EOS id the checkpoint declares (generation config,
  config, tokenizer) and, for a chat prompt, the family's end-of-turn token (from
  :func:`spiffy.models.loading.special_token_ids`, i.e. the family registry).
"""

from __future__ import annotations

from typing import Any

from spiffy.errors import ConfigError, UnknownModelTypeError
from spiffy.models.loading import special_token_ids

__all__ = ["prompt_token_ids", "stop_token_ids"]


def prompt_token_ids(tokenizer: Any, text: str, *, chat: bool = True, require_template: bool = False) -> list[int]:
    """Token ids of one prompt: the one prompt encoder (calibration, the benchmarks and the command line use it).

    A chat turn is rendered by the tokenizer's chat template and tokenized without adding special tokens (the
    template writes them); raw text is tokenized as ``tokenizer(text)`` does (special tokens the tokenizer adds, e.g.
    a BOS, included). A prompt that tokenizes to nothing becomes ``[BOS]`` (else ``[EOS]``): a diffusion LM needs at
    least one prompt position.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the user message.
        chat: wrap ``text`` as a user turn of the chat template (with the generation prompt) when the tokenizer has
            one (else raw text, as for a base checkpoint).
        require_template: refuse ``chat`` without a chat template instead of falling back to raw text.
    Returns:
        ``[L]`` token ids as a list, ``L >= 1``.
    Raises:
        ConfigError: ``require_template`` and no chat template; an empty encoding and no BOS/EOS token.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat and require_template and not has_template:
        raise ConfigError("a chat prompt needs a tokenizer with a chat template; fix: drop --chat or use an instruct checkpoint")
    if chat and has_template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    if ids and isinstance(ids[0], list):  # batched output
        ids = ids[0]
    if not ids:
        fallback = next((t for t in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None))
                         if t is not None), None)
        if fallback is None:
            raise ConfigError("the prompt is empty and the tokenizer has no BOS/EOS token; fix: pass --prompt TEXT")
        ids = [fallback]
    return [int(t) for t in ids]


def _eos_ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {int(e) for e in value}
    return set()


def stop_token_ids(model: Any, tokenizer: Any, chat: bool) -> list[int]:
    """Sorted ids that end a response of ``model``.

    Args:
        model: a loaded model (its ``generation_config`` and ``config`` are read).
        tokenizer: its tokenizer, or ``None``.
        chat: the prompt was a chat turn: the family's end-of-turn token (Qwen3: ``<|im_end|>``) also stops.
    Returns:
        every EOS id of the generation config, the config and the tokenizer, plus the end-of-turn id when ``chat``.
    """
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        ids |= _eos_ids(getattr(src, "eos_token_id", None) if src is not None else None)
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        if chat:
            try:
                eot = special_token_ids(model, tokenizer).eot
            except UnknownModelTypeError:  # a model of no known family: nothing more to ask the registry
                eot = None
            if eot is not None:
                ids.add(int(eot))
    return sorted(ids)
