"""No decoding loop runs without a bound (issue 29, item 1).

A model whose greedy token at a masked position is the mask id itself leaves that position masked: a loop that
waits for the block to hold no mask never ends. Each family here gets a tiny checkpoint built so (the layers' output
projections zeroed, so the residual stream is the token's embedding, and the head's mask row aligned with the mask
token's final hidden state: the mask id wins at every masked position) and is decoded single and batched, baseline
and Spiffy, static and dynamic rules. A model-call counter stops a runaway loop with a failure instead of a hang.

SDAR follows its official generator (JetAstra/SDAR ``generate.py``: ``for step in range(denoising_steps + 1)``):
a block takes at most ``denoising_steps`` denoising steps; positions still masked then keep the mask id (the
official loop fails there with an IndexError). LLaDA and Dream keep their fixed static schedules and cap a dynamic
(threshold) block at ``4 * block_length`` steps. A session whose ``block_finished`` never ends a block is stopped by
the contract's own bound (:meth:`DecodeSession.max_block_steps`) with a :class:`StepLimitError`.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pytest
import torch

from batch_cases import left_pad
from spiffy.api import generate
from spiffy.decoding import make_session, run_baseline
from spiffy.decoding.sdar import SDARSession
from spiffy.decoding.sdar_config import SDARDecodeConfig
from spiffy.errors import StepLimitError
from spiffy.models.loading import load_model, load_tokenizer, mask_token_id, save_checkpoint
from spiffy.models.tiny import make_tiny
from spiffy.selfspec.oracle import random_graph
from spiffy.selfspec.runtime import speculative_generate
from spiffy.verify.backend import follow

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

#: model calls after which a decode counts as runaway (every bounded case here makes far fewer)
CALL_LIMIT = 300
GEN, BLOCK = 8, 4


class RunawayLoop(AssertionError):
    """Raised by the call counter: the decoding loop did not stop within :data:`CALL_LIMIT` model calls."""


@contextlib.contextmanager
def call_limit(model: torch.nn.Module, limit: int = CALL_LIMIT):
    """Count ``model``'s forward calls; raise :class:`RunawayLoop` at call ``limit + 1`` (a hang becomes a failure)."""
    calls = [0]

    def count(_module, _args):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] > limit:
            raise RunawayLoop(f"more than {limit} model calls: the decoding loop has no bound")

    handle = model.register_forward_pre_hook(count)
    try:
        yield calls
    finally:
        handle.remove()


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    inner = model.model
    return inner.transformer.ln_f if hasattr(inner, "transformer") else inner.norm


def make_mask_wins(family: str, out_dir: Path) -> Path:
    """A tiny ``family`` checkpoint (real layout, saved and reloaded through the real loader) whose greedy token at
    every masked position is the mask id (Dream: at every position whose predecessor is masked)."""
    src = make_tiny(family, out_dir / "src", seed=0)
    model = load_model(src, dtype=torch.float32)
    mask = mask_token_id(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("attn_out", "o_proj", "down_proj") or (leaf == "ff_out" and ".blocks." in name):
                module.weight.zero_()  # layers add nothing: the final hidden state is norm(embedding)
        h = _final_norm(model)(model.get_input_embeddings().weight[mask][None])[0]
        head = model.get_output_embeddings().weight
        bound = float(h.norm() * head.norm(dim=-1).max())
        head[mask] = h / h.norm() ** 2 * (10.0 * bound + 10.0)  # logit of the mask = 10 * bound + 10 > any other
    return save_checkpoint(model, out_dir / "model", tokenizer=load_tokenizer(src))


@pytest.fixture(scope="module", params=["llada", "dream", "sdar"])
def mask_wins(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = make_mask_wins(request.param, tmp_path_factory.mktemp(f"maskwins_{request.param}"))
    return request.param, load_model(path, dtype=torch.float64)


def _kw(rule: str, temperature: float) -> dict:
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=temperature)
    if rule == "static":
        kw["steps"] = GEN // 2  # two tokens per step
    else:
        kw["threshold"] = 0.9
    return kw


PROMPTS = [torch.tensor([17, 33, 95]), torch.tensor([41, 7, 200, 11, 9]), torch.tensor([5, 250])]


def test_mask_wins_checkpoint_proposes_the_mask(mask_wins) -> None:
    """The construction holds: greedy decoding keeps masks in the output (nothing else could unmask them)."""
    family, model = mask_wins
    s = make_session(model, PROMPTS[0][None], **_kw("static", 0.0))
    with call_limit(model):
        run_baseline(s)
    assert int((s.x[0, len(PROMPTS[0]) :] == s.mask_id).sum()) >= GEN - 1  # Dream: the first row reads the prompt


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("rule", ["static", "dynamic"])
def test_every_loop_ends_when_the_mask_id_wins(mask_wins, rule: str, temperature: float) -> None:
    """Baseline and Spiffy, alone and batched, end within their bound; Spiffy equals the baseline and every batch
    row equals its prompt alone."""
    family, model = mask_wins
    kw = _kw(rule, temperature)
    graph = random_graph(levels=2, nodes=6, seed=1, i_max=BLOCK, j_max=3)
    alone = []
    for r, prompt in enumerate(PROMPTS):
        s = make_session(model, prompt[None], seed=r + 3, **kw)
        with call_limit(model) as calls:
            stats = run_baseline(s)
        per_block = s.max_block_steps()
        assert stats.nfe == calls[0] <= s.num_blocks * (per_block + 2)
        assert max(stats.steps_per_block) <= per_block
        tokens = s.x[0, s.prompt_len : s.prompt_len + GEN].clone()
        assert bool((tokens == s.mask_id).any())
        spec = make_session(model, prompt[None], seed=r + 3, **kw)
        with call_limit(model):
            speculative_generate(spec, graph, budget=4)
        assert torch.equal(spec.x[0, spec.prompt_len : spec.prompt_len + GEN], tokens)
        alone.append(tokens.tolist())
    ids, am = left_pad(PROMPTS)
    seeds = [r + 3 for r in range(len(PROMPTS))]
    for g in (None, graph):
        with call_limit(model):
            out = generate(model, ids, attention_mask=am, seeds=seeds, graph=g, budget=4, **kw)
        assert out.tokens == alone, f"{family} batch (graph={g is not None}) differs from the prompts alone"


def test_sdar_reproducer_of_the_issue_returns() -> None:
    """The issue's reproducer: a random tiny SDAR (seed 1) whose greedy token for the only masked row is the mask."""
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(make_tiny("sdar", Path(tmp) / "sdar", seed=1), dtype=torch.float32)
        s = make_session(model, torch.tensor([[277, 425]]), SDARDecodeConfig(gen_length=1, block_length=1))
        with call_limit(model):
            stats = run_baseline(s)
    assert stats.steps_per_block == [1]  # denoising_steps = block_length = 1: one step, as the official loop
    assert int(s.x[0, 2]) == s.mask_id


class _NeverFinished(SDARSession):
    """A session whose ``block_finished`` never ends a block (what a broken third-party session might do)."""

    def block_finished(self, block: int, step: int, x: torch.Tensor) -> bool:
        return False


def test_the_session_contract_bounds_a_block_that_never_finishes(tiny_sdar) -> None:
    model = load_model(tiny_sdar, dtype=torch.float64)
    s = _NeverFinished(model, torch.tensor([[17, 33, 95]]), SDARDecodeConfig(gen_length=4, block_length=4, denoising_steps=2))
    with call_limit(model), pytest.raises(StepLimitError, match="block_finished"):
        run_baseline(s)
    spec = _NeverFinished(model, torch.tensor([[17, 33, 95]]), SDARDecodeConfig(gen_length=4, block_length=4, denoising_steps=2))
    with call_limit(model), pytest.raises(StepLimitError):
        speculative_generate(spec, random_graph(levels=2, nodes=4, seed=0, i_max=4, j_max=2), budget=2)


def test_follow_is_bounded() -> None:
    """The shared walk stops a structure whose children never end (a cycle) at its bound."""
    with pytest.raises(StepLimitError, match="max_steps"):
        follow(0, lambda node: node, lambda node, state: node, max_steps=50)
    accepted, final = follow(0, lambda node: node + 1, lambda node, state: state if state < 5 else None, max_steps=50)
    assert accepted == [1, 2, 3, 4] and final == 5
