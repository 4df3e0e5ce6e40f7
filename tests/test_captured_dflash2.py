"""DFlash2 drafters, and DFlash drafters with causal or sliding-window layers, on the captured path's static drafter
(:mod:`spiffy.arspec.captured_drafter`).

On a CPU the static drafter's step runs eagerly with the static shapes a GPU captures (a context cache of slots with
a length per row, the block padded to its bucket, masks instead of shapes), so these tests check the code a GPU
replays against the eager drafter (the reference):

* the selector over a batch of rows (each from its own root, a device tensor, ranked without a host read) scores
  every row as the one-row call does;
* one prompt, DFlash2 drafters plain, causal with a sliding first layer (the official test config's layout) and
  bidirectional with a sliding window; ``dflash2``, ``ddtree-dflash2`` and SpecDiff-2, coupled and rejection rules,
  float32 and float64: every round's selector scores are the eager drafter's (candidates equal, scores within
  rounding: attention over a padded key set sums in another order), tokens and acceptance lengths equal, the drafts
  guessing a known continuation so that accepted paths go deep;
* ragged batches, the causal and sliding drafters too;
* the draft stage reads nothing back, and the step traces as one graph (slow tier);
* a DFlash drafter with causal and sliding layers runs on the static drafter too (it kept its eager drafter before).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from captured_rounds import DRAFT_TOLERANCE, RecordedDrafts, guess_selector_drafts, prompt_ids
from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, ddtree_generate, speculative_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.captured_drafter import static_drafter_of
from spiffy.bench.syncs import SyncCounter
from spiffy.capture import trace_steps
from spiffy.models import load_ar_drafter, load_target, make_tiny_dflash, make_tiny_dflash2, make_tiny_target

torch.set_num_threads(1)
BLOCK = 6

#: config edits of the drafter variants: plain (every layer bidirectional, unmasked), causal with a sliding first
#: layer (the layout of the official package's test config) and bidirectional with a sliding first layer
_SLIDING_FIRST = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3,
                  "use_sliding_window": True}
VARIANTS = {"plain": {}, "causal-sliding": {"is_causal": True, **_SLIDING_FIRST},
            "sliding": {"is_causal": False, **_SLIDING_FIRST}}


def _variant(src: Path, dst: Path, edits: dict[str, Any]) -> Path:
    """A copy of the checkpoint at ``src`` with its config's fields ``edits`` set."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(edits)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("captured_dflash2")
    target = make_tiny_target(base / "target", seed=2, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              vocab_size=48, weight_std=0.3, with_tokenizer=False)
    plain = make_tiny_dflash2(base / "plain", target, seed=4, num_layers=2, target_layer_ids=[0, 1], block_size=BLOCK,
                              selector_top_k=5, selector_rank=6, conv_kernel_size=3, conv_group_size=16)
    dflash = make_tiny_dflash(base / "dflash", target, seed=5, num_layers=2, block_size=BLOCK)
    out = {"target": target, "dflash": _variant(dflash, base / "dflash-masked", VARIANTS["causal-sliding"])}
    for name, edits in VARIANTS.items():
        out[name] = plain if not edits else _variant(plain, base / name, edits)
    return out


def _drafters_of(model: Any, rows: int) -> list[Any]:
    return [as_drafter(model) for _ in range(rows)]


def test_the_selector_scores_a_batch_as_rows_alone(dirs):
    """:meth:`CandidateSelector.forward` over ``[R, D, H]`` rows with a root per row (a device tensor), ranked as
    the static step ranks them, gives each row what the one-row call gives it."""
    model = load_ar_drafter(dirs["plain"], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    rows, depth = 4, BLOCK - 1
    hidden = torch.randn(rows, depth, 64, generator=g, dtype=torch.float64)
    logits = torch.randn(rows, depth, 48, generator=g, dtype=torch.float64)
    logits[0, 1, 7] = logits[0, 1, 9] = logits[0, 1].max() + 1  # a tie: the lower token id ranks first
    roots = torch.tensor([3, 0, 47, 3])
    batch = model.candidate_selector(hidden, logits, roots, static=True)
    for r in range(rows):
        alone = model.candidate_selector(hidden[r], logits[r], int(roots[r]))
        assert torch.equal(batch[0][r], alone[0])
        for b, a in zip(batch[1:], alone[1:]):
            torch.testing.assert_close(b[r], a, rtol=0, atol=DRAFT_TOLERANCE[torch.float64])
    assert batch[0][0, 1, :2].tolist() == [7, 9]


CASES = [("plain", "dflash2", "coupled", 0.0), ("plain", "ddtree-dflash2", "coupled", 0.7),
         ("causal-sliding", "ddtree-dflash2", "coupled", 0.0), ("causal-sliding", "dflash2", "rejection", 0.9),
         ("sliding", "ddtree-dflash2", "rejection", 0.9), ("sliding", "specdiff", "rejection", 0.9),
         pytest.param("causal-sliding", "specdiff", "coupled", 0.7, marks=pytest.mark.slow),
         pytest.param("plain", "ddtree-dflash2", "rejection", 1.3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("variant,method,accept,temperature", CASES)
def test_static_dflash2_drafter_equals_eager(dirs, dtype, variant, method, accept, temperature):
    """One prompt: the static drafter's selector scores are the eager drafter's every round; tokens and acceptance
    lengths are equal (under the coupled rule plain AR's, with deep accepted paths)."""
    target = load_target(dirs["target"], dtype, "cpu")
    model = load_ar_drafter(dirs[variant], dtype=dtype)
    assert [layer.window for layer in model.layer_attention] == ([None, None] if variant == "plain" else [3, None])
    sampling = SamplingConfig(temperature=temperature, seed=3)
    prompt, n = [5, 9, 2, 17], 14
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=n, sampling=sampling))
    config = ARSpecConfig(method=method, budget=9, drafts=2, max_new_tokens=n, accept=accept, sampling=sampling)
    runs = []
    with pytest.MonkeyPatch.context() as mp:
        drafts = RecordedDrafts(mp)
        guess_selector_drafts(mp, len(prompt), ar.tokens, {2, 7}, False)  # after the recorder: it records raw drafts
        for compile_ in (False, True):
            runs.append(speculative_generate(target, as_drafter(model), prompt, config, compile=compile_))
    eager, captured = runs
    assert captured.tokens == eager.tokens and len(captured.tokens) == n
    assert captured.acceptance_lengths == eager.acceptance_lengths
    assert captured.nodes_per_round == eager.nodes_per_round
    if accept == "coupled":
        assert captured.tokens == ar.tokens and max(captured.acceptance_lengths) > 2, captured.acceptance_lengths
    drafts.assert_close(dtype)
    static = static_drafter_of(model)
    assert static is not None and static.selector
    assert sum(static.graphs.stats.runs.values()) == len(drafts.static) - 1  # + the prompt's round


@pytest.mark.parametrize("variant,accept,temperature", [("plain", "coupled", 0.0), ("sliding", "rejection", 0.9),
                                                        ("causal-sliding", "coupled", 0.8)])
def test_static_dflash2_drafter_batches(dirs, variant, accept, temperature):
    """Ragged batches (prompts of different lengths, rows leaving at different rounds): every row's selector scores
    are what its eager drafter scores (a sliding drafter's eager rows draft alone), with the eager rows' tokens."""
    target = load_target(dirs["target"], torch.float64, "cpu")
    model = load_ar_drafter(dirs[variant], dtype=torch.float64)
    prompts = [prompt_ids(1, 2), prompt_ids(2, 9), prompt_ids(3, 5)]
    prompts = [[t % 48 for t in p] for p in prompts]
    lengths = [12, 5, 9]
    configs = [ARSpecConfig(method="ddtree-dflash2", budget=6, max_new_tokens=m, accept=accept,
                            sampling=SamplingConfig(temperature=temperature, seed=s))
               for m, s in zip(lengths, (1, 2, 3))]
    with pytest.MonkeyPatch.context() as mp:
        drafts = RecordedDrafts(mp)
        eager = speculative_generate_batch(target, _drafters_of(model, 3), prompts, configs, compile=False)
        captured = speculative_generate_batch(target, _drafters_of(model, 3), prompts, configs, compile=True)
    assert [r.tokens for r in captured] == [r.tokens for r in eager]
    assert [r.acceptance_lengths for r in captured] == [r.acceptance_lengths for r in eager]
    assert [len(r.tokens) for r in captured] == lengths
    drafts.assert_close(torch.float64)
    rows = {rows for rows, _block in static_drafter_of(model).graphs.stats.runs}
    assert 3 in rows and min(rows) < 3  # rows left the batch on the static path


def test_static_dflash2_draft_reads_nothing_back(dirs):
    """The block forward and its read-out through the selector (a bucket's step) read nothing back from the device
    and may run twice (a capture's recording); nor does a whole draft stage (the roots and depths go down in one
    copy)."""
    target = load_target(dirs["target"], torch.float32, "cpu")
    model = load_ar_drafter(dirs["causal-sliding"], dtype=torch.float32)
    ddtree_generate(target, model, [3, 1, 4], method="ddtree-dflash2", budget=8, max_new_tokens=8, compile=True)
    static = static_drafter_of(model)
    with torch.inference_mode():
        first = [t.clone() for t in static.graphs.run((1, BLOCK))]
        with SyncCounter() as step_counter:
            again = static.graphs.run((1, BLOCK))
        again = [t.clone() for t in again]  # a replay's outputs: the draft's replay below overwrites them
        with SyncCounter() as draft_counter:
            drafts = static.draft([(3, 20)], [BLOCK - 1])
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for counter in (step_counter, draft_counter):  # "to_cpu": the forward's .to(device), a no-op on a CPU
        assert {k: v for k, v in counter.counts.items() if k != "to_cpu"} == {}, counter.counts
    assert drafts[0].depth == BLOCK - 1 and drafts[0].following.shape == (BLOCK - 2, 5, 5)


@pytest.mark.slow
@pytest.mark.parametrize("variant,method,accept", [("causal-sliding", "ddtree-dflash2", "coupled"),
                                                   ("plain", "specdiff", "rejection")])
def test_static_dflash2_steps_trace_as_one_graph(dirs, variant, method, accept):
    """The drafter's step (block forward, masks, selector) is one graph for TorchDynamo (no host read, no
    data-dependent shape: :func:`spiffy.capture.trace_steps`), and gives the eager tokens."""
    config = ARSpecConfig(method=method, budget=9, max_new_tokens=10, accept=accept,
                          sampling=SamplingConfig(temperature=0.9, seed=2))
    runs = []
    for compile_ in (False, True):
        target = load_target(dirs["target"], torch.float32, "cpu")
        model = load_ar_drafter(dirs[variant], dtype=torch.float32)
        with trace_steps(compile_):
            runs.append(speculative_generate(target, as_drafter(model), [5, 9, 2, 17], config, compile=compile_).tokens)
    assert runs[1] == runs[0]
    assert static_drafter_of(model) is not None and static_drafter_of(model).graphs.stats.runs


@pytest.mark.parametrize("method,temperature", [("ddtree", 0.0), ("dflash", 0.8)])
def test_masked_dflash_drafters_take_the_static_drafter(dirs, method, temperature):
    """A DFlash drafter with a causal sliding layer (positions from the static cache's slots) drafts on the static
    drafter: its drafts are the eager ones to rounding, and its tokens the eager tokens."""
    target = load_target(dirs["target"], torch.float64, "cpu")
    model = load_ar_drafter(dirs["dflash"], dtype=torch.float64)
    assert any(model.sliding_layers)
    kw = {"method": method, "budget": 6, "max_new_tokens": 12, "temperature": temperature, "seed": 7}
    prompt = [4, 8, 15, 16, 23, 42]
    with pytest.MonkeyPatch.context() as mp:
        drafts = RecordedDrafts(mp)
        eager = ddtree_generate(target, model, prompt, compile=False, **kw)
        captured = ddtree_generate(target, model, prompt, compile=True, **kw)
    assert captured.tokens == eager.tokens and captured.acceptance_lengths == eager.acceptance_lengths
    drafts.assert_close(torch.float64)
    assert static_drafter_of(model) is not None and not static_drafter_of(model).selector
