"""What one AR speculative generation returns (:class:`ARGenerationResult`), and how a round's tokens join it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from spiffy.arspec.stages import STAGES

__all__ = ["ARGenerationResult"]


@dataclass
class ARGenerationResult:
    """Output and statistics of one prompt's generation (:func:`~spiffy.arspec.speculative_generate`, one row of
    :func:`~spiffy.arspec.speculative_generate_batch`).

    Attributes:
        tokens: generated token ids (prompt excluded; ends with the stop token if one was generated).
        rounds: number of verification rounds (target forwards after the prefill).
        tau: mean acceptance length per round, bonus token included (tokens committed per round).
        acceptance_lengths: tokens committed in each round.
        histogram: ``histogram[k]`` = number of rounds that committed ``k`` tokens (``k = 0..block_size``).
        stage_times: seconds spent per stage: draft, tree_build, compile, verify, commit (of the whole batch).
        seconds: total wall time (prefill included; of the whole batch).
        prefill_seconds: prompt forward + first token.
        time_per_output_token: decode seconds (prefill excluded) / number of generated tokens (of every row).
        method, budget, block_size: the configuration that ran (``budget``: draft nodes per round,
            :meth:`~spiffy.arspec.ARSpecConfig.draft_nodes`: the tree budget, the chain length, 0 for ar).
        num_prompt_tokens: prompt length.
        nodes_per_round: draft nodes verified per round (root excluded).
        stopped: generation ended on a stop token.
    """

    tokens: list[int]
    rounds: int
    tau: float
    acceptance_lengths: list[int]
    histogram: list[int]
    stage_times: dict[str, float]
    seconds: float
    prefill_seconds: float
    time_per_output_token: float
    method: str = "ddtree"
    budget: int = 0
    block_size: int = 1
    num_prompt_tokens: int = 0
    nodes_per_round: list[int] = field(default_factory=list)
    stopped: bool = False

    @classmethod
    def start(cls, method: str, budget: int, block_size: int, num_prompt_tokens: int) -> "ARGenerationResult":
        """An empty result (no tokens, no rounds, every stage at zero seconds)."""
        return cls(tokens=[], rounds=0, tau=0.0, acceptance_lengths=[], histogram=[0] * (block_size + 1),
                   stage_times={s: 0.0 for s in STAGES}, seconds=0.0, prefill_seconds=0.0, time_per_output_token=0.0,
                   method=method, budget=budget, block_size=block_size, num_prompt_tokens=num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return asdict(self)

    def append_until_stop(self, new: Sequence[int], stop_token_ids: Sequence[int], max_new_tokens: int) -> int:
        """Append ``new`` to :attr:`tokens` up to and including a stop token (then :attr:`stopped` is set), never
        beyond ``max_new_tokens``; returns how many were appended."""
        appended = 0
        for t in new:
            self.tokens.append(int(t))
            appended += 1
            if t in stop_token_ids:
                self.stopped = True
                break
            if len(self.tokens) >= max_new_tokens:
                break
        return appended

    def record_round(self, committed: int, nodes: int) -> None:
        """Add one verification round that committed ``committed`` tokens after verifying ``nodes`` draft nodes."""
        self.rounds += 1
        self.acceptance_lengths.append(committed)
        self.nodes_per_round.append(nodes)
        if committed >= len(self.histogram):
            self.histogram.extend([0] * (committed + 1 - len(self.histogram)))
        self.histogram[committed] += 1

    def finish(self, seconds: float, prefill_seconds: float, decode_seconds: float, batch_tokens: int,
               stage_times: dict[str, float]) -> None:
        """Fill the timing fields (shared by every row of a batch) and τ."""
        self.seconds = seconds
        self.prefill_seconds = prefill_seconds
        self.stage_times = dict(stage_times)
        self.tau = float(sum(self.acceptance_lengths) / self.rounds) if self.rounds else 0.0
        self.time_per_output_token = decode_seconds / max(1, batch_tokens)
