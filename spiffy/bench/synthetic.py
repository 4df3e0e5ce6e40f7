"""Synthetic logits at real vocabulary sizes, for measuring what decoding costs besides the model's forward.

* :class:`SyntheticDLLM` stands in for a diffusion LM: its "forward" returns fixed, LLaDA-like logits (a few peaked
  tokens per position over Gaussian noise) chosen by the state, so the baseline transition and Spiffy's ranking see
  realistic distributions at LLaDA-8B's vocabulary without an 8B model. ``tables = 1``: the logits do not depend on
  the state, so every draft the ranking predicts is right; ``tables > 1`` with ``drift``: the table switches with
  the number of decoded tokens, so the next step's distribution differs from the last one (fewer drafts accepted;
  ``drift = inf``: the tables replace the base logits and practically nothing is accepted).
* :func:`synthetic_draft_logits` gives ``[L, V]`` drafter logits for DDTree whose confidence fades with depth.
* :func:`calibrated_graph` calibrates a draft graph on a :class:`SyntheticDLLM`'s baseline trajectories with the
  project's own tools (:func:`~spiffy.selfspec.chains.record_chains` + the greedy
  :func:`~spiffy.selfspec.select.build_graph`).
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from spiffy.decoding import DecodeConfig
from spiffy.decoding.llada import LLaDASession
from spiffy.selfspec.chains import all_chains, record_chains
from spiffy.selfspec.graph import DraftGraph
from spiffy.selfspec.select import build_graph

__all__ = ["SyntheticDLLM", "synthetic_draft_logits", "calibrated_graph", "synthetic_session"]


def _peaked(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """``[rows, V]`` logits: N(0, 1.5) noise plus three boosted tokens per row (top-1 probability ~0.05-0.99)."""
    logits = torch.randn(rows, vocab, generator=generator) * 1.5
    for scale in (1.0, 0.6, 0.35):
        tok = torch.randint(0, vocab, (rows, 1), generator=generator)
        boost = (3.0 + 12.0 * torch.rand(rows, 1, generator=generator)) * scale
        logits.scatter_add_(1, tok, boost)
    return logits


class SyntheticDLLM(nn.Module):
    """A parameter-free stand-in for a LLaDA model that returns precomputed logits (see the module docstring).

    Args:
        vocab: vocabulary size ``V`` (the mask id is ``V - 1`` and never gets a boost).
        seq_len: ``T``, prompt + generation length the logits cover.
        tables: number of state-selected logit tables (``1`` = state-independent).
        drift: weight of the selected table on top of the base logits (``math.inf``: the table alone).
        seed: seed of every table.
        flush_bytes: size of the buffer each forward writes after its logits (evicts the CPU caches; 0 = none).
    Attributes:
        forward_seconds: wall time spent inside :meth:`forward` (what the benchmarks subtract), forward_calls.
    """

    def __init__(self, vocab: int, seq_len: int, *, tables: int = 1, drift: float = 0.0, seed: int = 0,
                 flush_bytes: int = 64 << 20) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.mask_id = int(vocab), int(vocab) - 1
        base = _peaked(seq_len, vocab, g)
        extra = torch.stack([_peaked(seq_len, vocab, g) for _ in range(max(1, tables))])  # [K, T, V]
        if math.isinf(drift):
            self.tables = extra
        else:
            self.tables = base.unsqueeze(0) + float(drift) * extra if tables > 1 else base.unsqueeze(0)
        self.tables[..., self.mask_id] = -30.0
        self.config = SimpleNamespace(model_type="llada", mask_token_id=self.mask_id)
        # a real forward streams gigabytes of weights through the caches; streaming through this buffer after each
        # call makes every method start its non-forward work equally cold (else a small baseline output would still
        # sit in the last-level cache while a speculative batch's would not)
        self._flush = torch.zeros(int(flush_bytes) // 4, dtype=torch.float32)
        # two output buffers used in turn, so no call allocates or frees a large block (a GPU's caching allocator
        # makes that free; on a CPU, unmapping a 120 MB verification output would cost milliseconds in whatever
        # code happens to drop the last reference); an output stays valid until the call after next
        self._outputs: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self.forward_seconds = 0.0
        self.forward_calls = 0

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        """``[N, T']`` ids -> ``.logits [N, T', V]`` (the table picked by each state's count of decoded tokens; valid
        until the call after next)."""
        t0 = time.perf_counter()
        decoded = (input_ids != self.mask_id).sum(dim=-1)  # [N]
        pick = decoded % self.tables.shape[0]
        n = int(input_ids.shape[0])
        buf = self._outputs[self._turn]
        if buf is None or buf.shape[0] < n:
            buf = self._outputs[self._turn] = torch.empty(n, *self.tables.shape[1:], dtype=self.tables.dtype)
        self._turn ^= 1
        out = buf[:n]
        torch.index_select(self.tables, 0, pick, out=out)
        logits = out[:, -input_ids.shape[1]:]  # [N, T', V]
        self._flush.add_(1.0)
        self.forward_seconds += time.perf_counter() - t0
        self.forward_calls += 1
        return SimpleNamespace(logits=logits)


def synthetic_session(model: SyntheticDLLM, prompt_len: int, gen_length: int, block_length: int) -> LLaDASession:
    """A LLaDA session (no cache, one token per step, greedy, low-confidence remasking) on ``model``."""
    cfg = DecodeConfig(gen_length=gen_length, block_length=block_length, steps=gen_length, cache="none")
    prompt = torch.arange(prompt_len, dtype=torch.long).unsqueeze(0) % (model.vocab - 1)
    return LLaDASession(model, prompt, cfg, mask_id=model.mask_id)


def calibrated_graph(
    model: SyntheticDLLM, prompt_len: int, gen_length: int, block_length: int, nodes: int, j_max: int = 4
) -> DraftGraph:
    """A ``nodes``-node draft graph calibrated (greedy objective) on ``model``'s baseline trajectory."""
    session = synthetic_session(model, prompt_len, gen_length, block_length)
    trajectory = record_chains(session, i_max=block_length, j_max=j_max)
    return build_graph(all_chains([trajectory]), nodes, "greedy", trajectories=[trajectory])


def synthetic_draft_logits(depth: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[L, V]`` DFlash-like drafter logits: N(0, 1) noise plus three tokens per depth boosted so that the top-1
    probability falls from 0.9 (depth 1) to 0.35 (depth ``L``) and the runners-up share 55% of the rest (a deep,
    branching DDTree)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g)
    noise_log_mass = math.log(vocab) + 0.5  # log E[sum exp(N(0, 1))] over the vocabulary
    top1 = torch.linspace(0.9, 0.35, depth).tolist()
    for d, p1 in enumerate(top1):
        probs = [p1, 0.4 * (1 - p1), 0.15 * (1 - p1)]
        rest = 1.0 - sum(probs)
        toks = torch.randperm(vocab, generator=g)[: len(probs)]
        for tok, p in zip(toks.tolist(), probs):
            logits[d, tok] = math.log(p / rest) + noise_log_mass
    return logits
