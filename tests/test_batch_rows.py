"""The batched baseline: row r of ``generate(batch)`` equals prompt r decoded alone (float64, tiny random checkpoints).

Ragged left-padded prompts at B = 3, every cache mode, static and threshold schedules, T = 0 and T = 1 with per-row
seeds, SDAR with prompts whose block anchoring differs (aligned and unaligned prompt ends) and rows stopping early.
Each row is compared with the prompt alone: tokens, the row's state, and the model calls that served it. Batched
Spiffy against this baseline, row for row: tests/test_spiffy_batch.py.
"""

from __future__ import annotations

import pytest
import torch

from batch_cases import BLOCK, GEN, SEEDS, dream, llada, sdar  # noqa: F401 - module fixtures
from batch_cases import decode_kwargs as _kw
from batch_cases import left_pad
from batch_cases import ragged_prompts as _prompts
from spiffy.api import generate
from spiffy.decoding import make_session, run_baseline
from spiffy.decoding.batch import row_generators
from spiffy.errors import ConfigError
from spiffy.selfspec.oracle import oracle_graph_from_records, record_trajectory


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`batch_cases.left_pad`, with no mask when no row is padded (the unpadded path)."""
    ids, am = left_pad(prompts)
    return ids, None if bool(am.all()) else am


def _check_rows(model, prompts: list[torch.Tensor], kw: dict, seeds: list[int] | None = SEEDS, **call) -> object:
    """One batched baseline call vs each prompt alone (seeded with ``seeds[r]``, else ``kw``'s seed)."""
    ids, am = _left_pad(prompts)
    out = generate(model, ids, attention_mask=am, seeds=seeds, **call, **kw)
    alone_nfe = []
    for r, x in enumerate(prompts):
        seed = kw.get("seed") if seeds is None else seeds[r]
        alone = generate(model, x[None], **{**kw, "seed": seed})
        width = alone.sequences.shape[1]
        assert out.tokens[r] == alone.tokens[0], f"row {r} differs from the prompt decoded alone for {kw}"
        assert torch.equal(out.sequences[r, -width:], alone.sequences[0])
        assert out.gen_starts[r] == out.sequences.shape[1] - width + len(x)
        row = out.stats["rows"][r]
        assert (row["nfe"], row["steps"]) == (alone.nfe, alone.steps), f"row {r} was served by other calls than alone"
        alone_nfe.append(alone.nfe)
    assert max(alone_nfe) <= out.nfe < sum(alone_nfe)  # one call serves several rows
    return out


# ------------------------------------------------------------------------------------------ LLaDA / Dream
@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("rule", ["static", "threshold"])
def test_llada_rows_equal_alone(llada, rule: str, cache: str, temp: float) -> None:
    _check_rows(llada, _prompts([4, 7, 2]), _kw(rule, cache, temp))


def test_llada_random_remasking_and_cfg_rows_equal_alone(llada) -> None:
    """Random remasking draws per-row uniforms over each row's own frame; CFG doubles each row's call."""
    _check_rows(llada, _prompts([4, 7, 2]), _kw("static", "none", 1.0, remasking="random", cfg_scale=1.0))


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("rule", ["static", "threshold"])
def test_dream_rows_equal_alone(dream, rule: str, cache: str, temp: float) -> None:
    _check_rows(dream, _prompts([4, 7, 2]), _kw(rule, cache, temp, alg="entropy"))


@pytest.mark.parametrize("alg,alg_temp", [("origin", None), ("maskgit_plus", 0.5)])
def test_dream_sampled_positions_rows_equal_alone(dream, alg: str, alg_temp: float | None) -> None:
    """``origin`` reveals positions by per-row uniforms, ``alg_temp`` draws them by multinomial (T = 1)."""
    _check_rows(dream, _prompts([4, 7, 2]), _kw("static", "none", 1.0, alg=alg, alg_temp=alg_temp))


# ------------------------------------------------------------------------------------------ SDAR
SDAR_RAGGED = [5, 8, 13]  # 5 and 13 end inside a block, 8 fills one (one decode block fewer, left padded by a block)


def _sdar_kw(strategy: str, temp: float, **extra) -> dict:
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=temp, strategy=strategy, denoising_steps=BLOCK // 2)
    if strategy == "low_confidence_dynamic":
        kw["threshold"] = 0.05
    return {**kw, **extra}


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize(
    "strategy", ["sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded"]
)
def test_sdar_ragged_rows_equal_alone(sdar, strategy: str, temp: float) -> None:
    out = _check_rows(sdar, _prompts(SDAR_RAGGED), _sdar_kw(strategy, temp))
    # row 1 (8 tokens, block aligned) is right-aligned one block in: its prompt starts at column 8
    assert out.gen_starts == [8 + 5, 8 + 8, 13]


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_sdar_fused_commit_rows_equal_alone(sdar, temp: float) -> None:
    _check_rows(sdar, _prompts(SDAR_RAGGED), _sdar_kw("low_confidence_static", temp, fuse_commit=True))


def test_sdar_ragged_without_padding_rows_equal_alone(sdar) -> None:
    """Prompts of 3, 8 and 6 tokens end at the same block: no padding column, only the generation starts differ
    (and the 8-token row, whose prompt fills block 0, starts decoding one block later)."""
    out = _check_rows(sdar, _prompts([3, 8, 6]), _sdar_kw("low_confidence_dynamic", 1.0))
    assert out.gen_starts == [3, 8, 6] and out.sequences.shape[1] == 3 * BLOCK
    assert [len(r["steps_per_block"]) for r in out.stats["rows"]] == [3, 2, 3]


@pytest.mark.parametrize("lengths", [[5, 5, 5], SDAR_RAGGED], ids=["equal", "ragged"])
def test_sdar_rows_stopping_early(sdar, lengths: list[int]) -> None:
    """Row 0 produces a stop token in its first block and stops alone; in the batch the others keep decoding (the
    batch session's own rule would stop every row)."""
    prompts = _prompts(lengths)
    kw = _sdar_kw("low_confidence_static", 0.0, denoising_steps=BLOCK)
    probe = make_session(sdar, prompts[0][None], **{**kw, "seed": SEEDS[0]})
    run_baseline(probe)
    first = int(probe.x[0, probe.block_bounds(0)[0] + BLOCK - 1])
    out = _check_rows(sdar, prompts, {**kw, "stop_token_ids": (first,)})
    rows = out.stats["rows"]
    assert rows[0]["steps_per_block"][-1] == 0 and rows[2]["steps_per_block"][-1] > 0


def test_sdar_padded_session_computes_rows_like_alone(sdar) -> None:
    """The padded SDAR session on its own (its batch rule, T = 0: no draws): padding columns hidden, positions and
    block anchoring per row, so each row's state equals the prompt decoded alone."""
    prompts = _prompts(SDAR_RAGGED)
    ids, am = _left_pad(prompts)
    kw = _sdar_kw("low_confidence_dynamic", 0.0)
    batch = make_session(sdar, ids, attention_mask=am, **kw)
    assert batch.pads == [8, 8, 0] and batch.num_blocks == 3
    run_baseline(batch)
    for r, x in enumerate(prompts):
        alone = make_session(sdar, x[None], **kw)
        run_baseline(alone)
        assert torch.equal(batch.x[r, batch.pads[r] :], alone.x[0])


# ------------------------------------------------------------------------------------------ the seed rule
def test_seed_rule_is_shared_by_baseline_and_spiffy_batches(llada) -> None:
    """No seeds: every row takes ``config.seed`` (as alone); a generator: one seed per row drawn in row order.
    Batched Spiffy follows the same rule, so its rows equal the baseline's either way."""
    prompts = _prompts([4, 7, 2])
    ids, am = _left_pad(prompts)
    kw = _kw("threshold", "prefix", 1.0, seed=3)
    base = _check_rows(llada, prompts, kw, seeds=None)
    s = make_session(llada, prompts[0][None], **kw)
    graph = oracle_graph_from_records(record_trajectory(s), s.mask_id)
    spec = generate(llada, ids, attention_mask=am, graph=graph, budget=len(graph.nodes), **kw)
    assert spec.tokens == base.tokens
    g = torch.Generator().manual_seed(9)
    seeds = [int(torch.randint(0, 2**62, (1,), generator=g)) for _ in prompts]
    assert len(set(seeds)) == len(seeds)
    from_gen = _check_rows(llada, prompts, kw, seeds=seeds)
    for spec_graph in (None, graph):
        out = generate(llada, ids, attention_mask=am, graph=spec_graph, budget=len(graph.nodes),
                       generator=torch.Generator().manual_seed(9), **kw)
        assert out.tokens == from_gen.tokens
    gens = row_generators(3, "cpu", seeds=[1, 1, 2])
    draws = [float(torch.rand((), generator=gen)) for gen in gens]  # type: ignore[arg-type]
    assert draws[0] == draws[1] != draws[2]
    assert row_generators(2, "cpu") == [None, None]


# ------------------------------------------------------------------------------------------ wrappers and errors
def test_familiar_wrappers_on_batches(llada, sdar, dream) -> None:
    """LLaDA's and Dream's wrappers follow the official batched stream (one generator for the batch:
    tests/test_compat_batches.py), spiffy.generate gives each row its own; SDAR's wrapper decodes rows alone."""
    from spiffy.compat import dream_diffusion_generate, llada_generate, sdar_block_diffusion_generate

    prompts = _prompts([4, 6])
    ids, am = _left_pad(prompts)
    kw = dict(steps=GEN, gen_length=GEN, block_length=BLOCK, temperature=1.0, seed=4)
    batched = llada_generate(llada, ids, attention_mask=am, **kw)
    official = make_session(llada, ids, attention_mask=am, generator=torch.Generator().manual_seed(4), **kw)
    run_baseline(official)
    assert torch.equal(batched, official.x)
    rows = generate(llada, ids, attention_mask=am, seeds=[4, 4], **kw)
    for r, x in enumerate(prompts):
        assert rows.tokens[r] == llada_generate(llada, x[None], **kw)[0, -GEN:].tolist()
    prompts = _prompts(SDAR_RAGGED)
    ids, am = _left_pad(prompts)
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=1.0, seed=4)
    batched = sdar_block_diffusion_generate(sdar, {"input_ids": ids, "attention_mask": am}, **kw)
    for r, x in enumerate(prompts):
        alone = sdar_block_diffusion_generate(sdar, x[None], **kw)[0]
        assert torch.equal(batched[r, -alone.shape[0] :], alone)
    out = dream_diffusion_generate(dream, torch.stack(_prompts([4, 4])), max_new_tokens=8, steps=8,
                                   return_dict_in_generate=True, output_history=True)
    assert len(out.history) == 8 and torch.equal(out.history[-1], out.sequences)  # the batch's own history


def test_batch_errors(llada, sdar) -> None:
    prompts = _prompts([4, 6])
    ids, am = _left_pad(prompts)
    with pytest.raises(ConfigError, match="one seed per prompt"):
        generate(llada, ids, attention_mask=am, seeds=[1], gen_length=GEN, block_length=BLOCK)
    with pytest.raises(ConfigError, match="one at a time"):
        generate(llada, ids, attention_mask=am, observer=lambda rec: None, gen_length=GEN, block_length=BLOCK)
    with pytest.raises(ConfigError, match="left"):
        generate(sdar, ids, attention_mask=am.flip(1), gen_length=GEN, block_length=BLOCK)
