"""A test drafter that knows the continuation (the row's plain-AR tokens): confident drafts that speculation accepts
far, and, every ``wrong_every``-th absolute position, a miss that stops a chain (shared by the AR tests that need
drafts accepted without training a drafter)."""

from __future__ import annotations

import torch
from torch import nn

from spiffy.arspec import ContextUpdate


class OracleDrafter:
    """Drafts ``continuation`` (tokens after an ``n_prompt``-token prompt) at logit ``top`` over a floor of ``floor``.

    At every ``wrong_every``-th absolute position the next token id is drafted instead; with ``second`` the true
    token keeps logit ``second`` there (ranked second: a DDTree side branch holds it), without it the true token is
    not drafted at all. ``check_vocab``: :meth:`check` asserts the target's vocabulary is ``vocab``. Proposes alone
    (no :class:`~spiffy.arspec.BatchDrafter`).
    """

    def __init__(self, continuation: list[int], n_prompt: int, vocab: int, block_size: int, wrong_every: int = 0, *,
                 dtype: torch.dtype = torch.float64, floor: float = -8.0, top: float = 4.0,
                 second: float | None = None, check_vocab: bool = False) -> None:
        self.continuation, self.n_prompt, self.vocab = list(continuation), n_prompt, vocab
        self.block_size, self.wrong_every, self.dtype = block_size, wrong_every, dtype
        self.floor, self.top, self.second, self.check_vocab = floor, top, second, check_vocab

    def check(self, target: nn.Module) -> None:
        if self.check_vocab:
            assert int(target.config.vocab_size) == self.vocab

    def attach(self, target: nn.Module) -> None:
        self.check(target)

    def propose(self, root_token: int, root_position: int, depth: int) -> torch.Tensor:
        """``[depth, V]`` draft logits of the positions after ``root_position``."""
        logits = torch.full((depth, self.vocab), self.floor, dtype=self.dtype)
        for d in range(1, depth + 1):
            i = root_position + d - self.n_prompt
            tok = self.continuation[i] if 0 <= i < len(self.continuation) else 0
            if self.wrong_every and (root_position + d) % self.wrong_every == 0:
                logits[d - 1, (tok + 1) % self.vocab] = self.top
                if self.second is not None:
                    logits[d - 1, tok] = self.second
            else:
                logits[d - 1, tok] = self.top
        return logits

    def commit(self, update: ContextUpdate) -> None:
        pass

    def detach(self) -> None:
        pass
