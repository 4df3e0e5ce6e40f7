"""Heterogeneous AR batches (issue 40): rows that differ in everything a row may differ in, each one equal to itself.

A batch row may have its own method, drafter (DFlash, DFlash2, a dLLM, an oracle that knows the row's continuation,
or none), drafted block length, denoising steps, budget, chain length, draft count, ``max_new_tokens`` (0 too), stop
tokens, seed, prompt length, acceptance rule and sampling rule (T = 0, T > 0 with top-p / top-k). Rows finish at
different rounds and leave the batch; rows draft windows of different lengths and commit different amounts (holes);
rows that draft nothing share rounds with rows that draft. For every batch drawn, in float32 and float64:

* every row equals the same row decoded alone: tokens, the length of every round, and every draft its drafter
  proposed (:class:`DraftSpy` on the drafting stage: a random tiny drafter's drafts are rarely accepted, so a row
  fed another row's features, grouped with rows of other settings or shown their padding changes its drafts long
  before its tokens);
* every row under the coupled rule (and every row at T = 0) equals plain AR decoding;
* no emitted token lies outside the support of the row's own sampling rule (greedy: the argmax; otherwise the
  top-k / top-p filter of the target's distribution, judged on one full forward of the prompt and the output).

The same for :func:`~spiffy.arspec.ddtree_generate_batch` (one method and sampling rule for every row; per-row seeds,
prompts and drafters). The two reproducers of issue 40 (a row left alone after the others finished kept its left
padding and holes, but the one-token decode round of a batch of one showed it every cached column) are regular tests.

Tiers (:mod:`property_tiers`): the default tier draws a fixed set of examples, enough to find issue 40 without its
fix; ``SPIFFY_PROPERTY_LONG=1 python -m pytest -q tests/test_batch_hetero.py -m slow`` runs ten times as many
fresh ones (a few minutes; ``SPIFFY_PROPERTY_EXAMPLES=N`` for ``N`` each).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pytest
import torch
from hypothesis import given, seed
from hypothesis import strategies as st
from oracle_drafter import OracleDrafter
from property_tiers import fast_settings, long_run, long_settings
from torch import nn

from spiffy.arspec import (
    METHODS,
    ARSpecConfig,
    DFlash2Drafter,
    DFlashDrafter,
    DLLMDrafter,
    SamplingConfig,
    ddtree_generate,
    ddtree_generate_batch,
    get_method,
    speculative_generate,
    speculative_generate_batch,
)
from spiffy.arspec import batch as batch_loop
from spiffy.arspec.result import ARGenerationResult
from spiffy.arspec.selector import SelectorDraft
from spiffy.arspec.sampling import tempered
from spiffy.models import load_model, make_tiny_dflash, make_tiny_target
from spiffy.models.ar_checkpoints import make_tiny_dflash2
from spiffy.models.ar_drafters import load_ar_drafter, make_tiny_dllm_drafter
from spiffy.sampling import top_k_filter

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

#: each drafter model's block (the oracle's too)
BLOCKS = {"dflash": 8, "dflash2": 8, "dllm": 6, "oracle": 8}
DRAFTING = tuple(m for m in METHODS if get_method(m).needs_drafter)
#: below these margins (logits; probability mass) a token's side of the support edge is a matter of rounding
TOLERANCE = {"float32": 1e-3, "float64": 1e-9}
#: a row's drafts in a shared drafter forward (padded keys) and alone agree to rounding
DRAFT_TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    """The checkpoints of issue 40's reproducers (target seed 5, dLLM seed 5, DFlash seed 4), plus a DFlash2."""
    root = tmp_path_factory.mktemp("hetero")
    target = make_tiny_target(root / "t", seed=5, vocab_size=300)
    return {"target": target, "dllm": make_tiny_dllm_drafter(root / "d", target, seed=5, block_size=BLOCKS["dllm"]),
            "dflash": make_tiny_dflash(root / "df", target, seed=4, block_size=BLOCKS["dflash"]),
            "dflash2": make_tiny_dflash2(root / "df2", target, seed=6, block_size=BLOCKS["dflash2"])}


_MODELS: dict[str, dict[str, nn.Module]] = {}


def models(paths: dict[str, Path], dtype: str) -> dict[str, nn.Module]:
    """The target and the three drafter models in ``dtype`` (loaded once per dtype)."""
    if dtype not in _MODELS:
        loaded = {"target": load_model(paths["target"], dtype=dtype)}
        for kind in ("dflash", "dflash2", "dllm"):
            loaded[kind] = load_ar_drafter(paths[kind], dtype=getattr(torch, dtype))
        _MODELS[dtype] = loaded
    return _MODELS[dtype]


def make_drafter(loaded: dict[str, nn.Module], row: dict[str, Any], ar: list[int], n_prompt: int, dtype: str) -> Any:
    """A fresh drafter of the row's kind (``None`` for plain AR) with its drafted block and denoising steps."""
    kind = row["kind"]
    block = None if row["own_block"] else min(row["drafter_block"], BLOCKS.get(kind, 1))
    if kind == "dflash":
        return DFlashDrafter(loaded["dflash"], block)  # type: ignore[arg-type]
    if kind == "dflash2":
        return DFlash2Drafter(loaded["dflash2"], block)  # type: ignore[arg-type]
    if kind == "dllm":
        return DLLMDrafter(loaded["dllm"], block, denoise_steps=row["denoise_steps"])
    if kind == "oracle":
        vocab = int(loaded["target"].config.vocab_size)
        return OracleDrafter(ar, n_prompt, vocab, block or BLOCKS["oracle"], row["wrong_every"], dtype=getattr(torch, dtype),
                             second=3.0, check_vocab=True)
    return None


def drafter_block(row: dict[str, Any]) -> int:
    """The block the row's drafter has (its model's, or the one it was wrapped with)."""
    own = BLOCKS.get(row["kind"], 1)
    return own if row["own_block"] else min(row["drafter_block"], own)


def until_stop(tokens: list[int], stop: tuple[int, ...]) -> list[int]:
    """``tokens`` up to and including the first stop token (what a run with these stop tokens generates)."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def plain_ar(target: nn.Module, prompt: list[int], max_new_tokens: int, sampling: SamplingConfig) -> list[int]:
    cfg = ARSpecConfig(method="ar", max_new_tokens=max_new_tokens, sampling=sampling)
    return speculative_generate(target, None, prompt, cfg).tokens


def outside_support(logits: torch.Tensor, token: int, sampling: SamplingConfig, tol: float) -> bool:
    """Whether ``token`` lies beyond the support of ``sampling``'s rule for the target's ``logits [V]`` by more than
    ``tol`` (greedy: its logit below the maximum; T > 0: more than ``top_k`` tokens score above it, or the mass
    above it reaches ``top_p``: the AR paths' ``nucleus="reaches"`` after top-k)."""
    row = logits.double()
    if sampling.greedy:
        return bool(row[token] < row.max() - tol)
    scores = tempered(row, float(sampling.temperature))
    above = scores > scores[token] + tol / float(sampling.temperature)
    if sampling.top_k and int(above.sum()) >= int(sampling.top_k):
        return True
    if sampling.top_p < 1.0:
        probs = torch.softmax(top_k_filter(scores, int(sampling.top_k)), dim=-1)
        return bool(float(probs[above].sum()) >= float(sampling.top_p) + tol)
    return False


@torch.inference_mode()
def check_support(target: nn.Module, prompt: list[int], tokens: list[int], sampling: SamplingConfig, dtype: str,
                  where: str) -> None:
    """Every token of ``tokens`` lies in the support of ``sampling``'s rule (one target forward over the row)."""
    if not tokens:
        return
    logits = target(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    for i, tok in enumerate(tokens):
        assert not outside_support(logits[i], tok, sampling, TOLERANCE[dtype]), (
            f"{where}: token {tok} at generated position {i} lies outside the {sampling} support")


class DraftSpy:
    """Records every draft of the generation loop's drafting stage (:func:`spiffy.arspec.stages.draft` as
    :mod:`spiffy.arspec.batch` calls it), per drafter object, and the drafters :func:`~spiffy.arspec.as_drafter` made
    there. A spy, not a mock: the stages run unchanged; it makes the drafter side of a row's bookkeeping visible (a
    random tiny drafter's drafts are rarely accepted, so wrong drafts seldom change the tokens or the rounds)."""

    def __init__(self) -> None:
        self.drafts: dict[int, list[tuple[tuple[int, int], int, Any]]] = {}
        self.made: list[Any] = []

    def __enter__(self) -> "DraftSpy":
        self._draft, self._as_drafter = batch_loop.draft, batch_loop.as_drafter

        def draft(drafters: Sequence[Any], roots: Sequence[tuple[int, int]], depths: Sequence[int]) -> list[Any]:
            out = self._draft(drafters, roots, depths)
            for d, root, depth, lg in zip(drafters, roots, depths, out):
                if lg is not None:
                    self.drafts.setdefault(id(d), []).append((root, int(depth), lg))
            return out

        def as_drafter(model: Any, block_size: int | None = None) -> Any:
            self.made.append(self._as_drafter(model, block_size))
            return self.made[-1]

        batch_loop.draft, batch_loop.as_drafter = draft, as_drafter  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        batch_loop.draft, batch_loop.as_drafter = self._draft, self._as_drafter  # type: ignore[assignment]

    def of(self, drafters: Sequence[Any]) -> list[list[tuple[tuple[int, int], int, Any]]]:
        """Each drafter's drafts in order (``[]`` for ``None``: a plain-AR row)."""
        return [[] if d is None else self.drafts.get(id(d), []) for d in drafters]


def same_draft(a: Any, b: Any, tol: float) -> bool:
    """``[depth, V]`` logits equal to rounding; a DFlash2 selector's proposal: equal candidates, scores to rounding."""
    def close(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.shape == y.shape and torch.allclose(x.double(), y.double(), rtol=tol, atol=tol)

    if isinstance(a, SelectorDraft) or isinstance(b, SelectorDraft):
        return (isinstance(a, SelectorDraft) and isinstance(b, SelectorDraft)
                and torch.equal(a.candidates, b.candidates) and close(a.first, b.first)
                and close(a.following, b.following))
    return close(a, b)


def check_rows(target: nn.Module, prompts: list[list[int]], batched: list[ARGenerationResult],
               alone: list[ARGenerationResult], ar: list[list[int] | None], samplings: list[SamplingConfig],
               dtype: str, case: Any, drafts: tuple[list[Any], list[Any]]) -> None:
    """Row ``b`` == alone (tokens, rounds, every draft: ``drafts`` = the batch's and the lone runs' per row);
    == plain AR where ``ar[b]`` is given; inside its rule's support."""
    for b, (res, solo, mine, lone) in enumerate(zip(batched, alone, *drafts)):
        where = f"row {b} of {case}"
        assert res.tokens == solo.tokens, f"{where}: batched {res.tokens} != alone {solo.tokens}"
        assert res.acceptance_lengths == solo.acceptance_lengths, f"{where}: rounds differ"
        assert [r[:2] for r in mine] == [r[:2] for r in lone], f"{where}: drafted (root, depth) differ from alone"
        for k, (x, y) in enumerate(zip(mine, lone)):
            assert same_draft(x[2], y[2], DRAFT_TOLERANCE[dtype]), f"{where}: round {k}'s draft differs from alone"
        if ar[b] is not None:
            assert solo.tokens == ar[b], f"{where}: {solo.tokens} != plain AR {ar[b]}"
        check_support(target, prompts[b], res.tokens, samplings[b], dtype, where)


def _prompts(lengths: list[int], prompt_seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(prompt_seed)
    return [torch.randint(0, 290, (n,), generator=g).tolist() for n in lengths]


# ----------------------------------------------------------------------------------------------- reproducers
REPRO_1_PROMPTS = [[69, 261, 220, 72, 220, 260, 220, 81, 64, 77, 70, 68, 7],
                   [54, 81, 280, 68, 285, 220, 69, 84, 77, 66, 83, 72, 78, 77, 220, 83, 71, 64, 83, 220, 81, 68, 85,
                    68, 81, 82, 68, 82, 285, 262, 83, 81, 260, 70, 13]]
REPRO_2_PROMPTS = [[66, 282], [82, 65], [87, 234, 208, 66, 30, 34, 148, 276, 218, 14, 2, 106, 276], [25],
                   [69, 261, 220, 72, 220, 260, 220]]


def _check_reproducer(loaded: dict[str, nn.Module], prompts: list[list[int]], cfgs: list[ARSpecConfig],
                      drafters: Any, dtype: str) -> None:
    target = loaded["target"]
    mine, lone = drafters(), drafters()
    with DraftSpy() as spy:
        batched = speculative_generate_batch(target, mine, prompts, cfgs)
        alone = [speculative_generate(target, lone[b], p, c) for b, (p, c) in enumerate(zip(prompts, cfgs))]
    ar = [plain_ar(target, p, c.max_new_tokens, c.sampling) for p, c in zip(prompts, cfgs)]
    check_rows(target, prompts, batched, alone, ar, [c.sampling for c in cfgs], dtype, "issue 40's reproducer",
               (spy.of(mine), spy.of(lone)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reproducer_ddtree_with_dllm_drafters(paths, dtype):
    """Issue 40, reproducer 1: row 1 drafts nothing (a block of 1), outlives row 0's uneven commits and decoded its
    last token seeing row 0's holes (greedy: the target's rank-2 token instead of AR's)."""
    loaded = models(paths, dtype)
    cfgs = [ARSpecConfig(method="ddtree", budget=32, chain_length=1, max_new_tokens=8,
                         sampling=SamplingConfig(temperature=0.0, seed=s)) for s in (998350, 204539)]

    def drafters() -> list[Any]:
        return [DLLMDrafter(loaded["dllm"], None, denoise_steps=3), DLLMDrafter(loaded["dllm"], 1, denoise_steps=2)]

    _check_reproducer(loaded, REPRO_1_PROMPTS, cfgs, drafters, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reproducer_mixed_drafters_top_p(paths, dtype):
    """Issue 40, reproducer 2: T = 1.5, top-p 0.5, rows finishing at 0, 3, 3, 5 and 16 tokens; row 0 (two prompt
    tokens, left padded) decoded alone in the batch saw its padding columns and drew a token outside the nucleus."""
    loaded = models(paths, dtype)
    seeds, limits = [986294, 146283, 80999, 314838, 669576], [16, 5, 3, 3, 0]
    cfgs = [ARSpecConfig(method="dflash", budget=150, chain_length=5, block_size=1, max_new_tokens=n,
                         sampling=SamplingConfig(temperature=1.5, top_p=0.5, seed=s)) for s, n in zip(seeds, limits)]
    dllm, dfl = loaded["dllm"], loaded["dflash"]

    def drafters() -> list[Any]:
        return [DLLMDrafter(dllm, 2, denoise_steps=3), DFlashDrafter(dfl, None),  # type: ignore[arg-type]
                DFlashDrafter(dfl, None), DLLMDrafter(dllm, 3, denoise_steps=2),  # type: ignore[arg-type]
                DFlashDrafter(dfl, 1)]  # type: ignore[arg-type]

    _check_reproducer(loaded, REPRO_2_PROMPTS, cfgs, drafters, dtype)


# ------------------------------------------------------------------------------ speculative_generate_batch
def draft_size(*sizes: int) -> st.SearchStrategy[int]:
    """A draft size knob, one of ``sizes`` (the first drafts nothing: a budget or chain length of 0, a block of 1);
    rows that draft nothing beside rows that draft are what issue 40 needed."""
    return st.sampled_from(sizes)


#: the sizes drawn: a block (root included), a chain length, a tree budget
BLOCK_SIZES, CHAIN_LENGTHS, BUDGETS = tuple(range(1, 9)), tuple(range(0, 8)), (0, 1, 2, 3, 5, 8, 16, 40)
sampling_rules = st.tuples(st.sampled_from([0.0, 0.0, 0.7, 1.5]), st.sampled_from([1.0, 0.9, 0.5]),
                           st.sampled_from([0, 0, 3, 20]))
drafters_of_rows = {
    "own_block": st.booleans(),
    "drafter_block": draft_size(*BLOCK_SIZES),
    "denoise_steps": st.sampled_from([1, 2, 3]),
    "seed": st.integers(0, 10**6),
    "prompt_len": st.integers(1, 14),
    "wrong_every": st.sampled_from([0, 2, 3]),
}
rows = st.fixed_dictionaries({
    **drafters_of_rows,
    "pick": st.sampled_from([0, 0, 1, 2]),  # the row's drafter kind: an entry of the batch's kinds (the first often)
    "method": st.sampled_from(DRAFTING),
    "block_size": st.one_of(st.none(), draft_size(*BLOCK_SIZES)),
    "budget": draft_size(*BUDGETS),
    "chain_length": st.one_of(st.none(), draft_size(*CHAIN_LENGTHS)),
    "drafts": st.sampled_from(range(4)),
    "accept": st.sampled_from(["coupled", "rejection"]),
    "sampling": sampling_rules,
    "max_new_tokens": st.sampled_from(range(13)),
    "stop_at": st.one_of(st.none(), st.integers(0, 11)),
})
batches = st.fixed_dictionaries({
    "dtype": st.sampled_from(["float32", "float64"]),
    # a few kinds per batch, so that rows often share a drafter model (and one drafting forward)
    "kinds": st.lists(st.sampled_from(["ar", "dflash", "dflash2", "dllm", "oracle"]), min_size=1, max_size=3,
                      unique=True),
    "rows": st.lists(rows, min_size=2, max_size=5),
    "prompt_seed": st.integers(0, 10_000),
})


def with_kinds(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The case's rows, each with its drafter ``kind`` (its ``pick`` of the batch's ``kinds``)."""
    return [dict(r, kind=case["kinds"][r["pick"] % len(case["kinds"])]) for r in case["rows"]]


def check_batch(paths: dict[str, Path], case: dict[str, Any]) -> None:
    """Every row of a heterogeneous :func:`speculative_generate_batch` == alone, == AR when coupled, in support."""
    dtype = case["dtype"]
    rows_ = with_kinds(case)
    loaded = models(paths, dtype)
    target = loaded["target"]
    prompts = _prompts([r["prompt_len"] for r in rows_], case["prompt_seed"])
    samplings, cfgs, ar, conts = [], [], [], []
    for r, prompt in zip(rows_, prompts):
        t, p, k = r["sampling"]
        sampling = SamplingConfig(temperature=t, top_p=p, top_k=k, seed=r["seed"])
        cont = plain_ar(target, prompt, r["max_new_tokens"], sampling)  # the oracle's continuation, the stops' source
        stop = (cont[r["stop_at"]],) if r["stop_at"] is not None and r["stop_at"] < len(cont) else ()
        block = None if r["block_size"] is None else min(r["block_size"], drafter_block(r))
        cfgs.append(ARSpecConfig(method="ar" if r["kind"] == "ar" else r["method"], budget=r["budget"],
                                 chain_length=r["chain_length"], drafts=r["drafts"], accept=r["accept"],
                                 max_new_tokens=r["max_new_tokens"], stop_token_ids=stop, block_size=block,
                                 sampling=sampling))
        samplings.append(sampling)
        conts.append(cont)
        ar.append(until_stop(cont, stop) if r["accept"] == "coupled" or sampling.greedy else None)

    def drafter(b: int) -> Any:
        return make_drafter(loaded, rows_[b], conts[b], len(prompts[b]), dtype)

    mine, lone = [drafter(b) for b in range(len(prompts))], [drafter(b) for b in range(len(prompts))]
    with DraftSpy() as spy:
        batched = speculative_generate_batch(target, mine, prompts, cfgs)
        alone = [speculative_generate(target, lone[b], prompts[b], cfgs[b]) for b in range(len(prompts))]
    check_rows(target, prompts, batched, alone, ar, samplings, dtype, case, (spy.of(mine), spy.of(lone)))


@given(case=batches)
@fast_settings(20)  # 400 more in the slow tier (below)
def test_heterogeneous_batch_rows_are_their_prompts_alone(paths, case) -> None:
    check_batch(paths, case)


@pytest.mark.slow
@long_run
@seed(40)
@given(case=batches)
@long_settings(40)
def test_heterogeneous_batch_rows_are_their_prompts_alone_long(paths, case) -> None:
    check_batch(paths, case)


# ---------------------------------------------------------------------------------- ddtree_generate_batch
keyword_batches = st.fixed_dictionaries({
    "dtype": st.sampled_from(["float32", "float64"]),
    "method": st.sampled_from(METHODS),
    "drafter": st.sampled_from(["dflash", "dflash2", "dllm", "per row"]),  # one model for every row, or per row:
    "kinds": st.lists(st.sampled_from(["dflash", "dflash2", "dllm", "oracle"]), min_size=1, max_size=3, unique=True),
    # rows share max_new_tokens and the stop tokens: a token early in some rows' continuations (stop_at) stops
    # every row that generates it, so rows leave the batch apart
    "rows": st.lists(st.fixed_dictionaries({**drafters_of_rows, "stop_at": st.sampled_from([None, 0, 1, 2, 3, 4]),
                                            "pick": st.sampled_from([0, 0, 1, 2])}),
                     min_size=2, max_size=3),
    "budget": st.one_of(st.none(), draft_size(*BUDGETS)),
    "block_size": st.one_of(st.none(), draft_size(*BLOCK_SIZES)),
    "sampling": sampling_rules,
    "max_new_tokens": st.sampled_from(range(13)),  # uniform: small limits leave no room for a stop
    "prompt_seed": st.integers(0, 10_000),
})


def check_keyword_batch(paths: dict[str, Path], case: dict[str, Any]) -> None:
    """:func:`ddtree_generate_batch` (coupled rule): every row == :func:`ddtree_generate` alone == AR, in support."""
    dtype = case["dtype"]
    loaded = models(paths, dtype)
    target = loaded["target"]
    rows_ = with_kinds(case)
    prompts = _prompts([r["prompt_len"] for r in rows_], case["prompt_seed"])
    t, p, k = case["sampling"]
    samplings = [SamplingConfig(temperature=t, top_p=p, top_k=k, seed=r["seed"]) for r in rows_]
    conts = [plain_ar(target, pr, case["max_new_tokens"], s) for pr, s in zip(prompts, samplings)]
    stop = tuple(c[r["stop_at"]] for r, c in zip(rows_, conts) if r["stop_at"] is not None and r["stop_at"] < len(c))
    per_row = case["drafter"] == "per row"
    limit = min(drafter_block(r) for r in rows_) if per_row else BLOCKS[case["drafter"]]
    block = None if case["block_size"] is None else min(case["block_size"], limit)
    kw: dict[str, Any] = dict(method=case["method"], budget=case["budget"], max_new_tokens=case["max_new_tokens"],
                              temperature=t, top_p=p, top_k=k, stop_token_ids=stop, block_size=block)

    def drafter(b: int) -> Any:
        return make_drafter(loaded, rows_[b], conts[b], len(prompts[b]), dtype) if per_row else loaded[case["drafter"]]

    n = len(prompts)
    mine, lone = [drafter(b) for b in range(n)], [drafter(b) for b in range(n)]
    with DraftSpy() as batch_spy:  # a drafter model is wrapped inside, once per row
        batched = ddtree_generate_batch(target, mine if per_row else mine[0], prompts, seed=[r["seed"] for r in rows_],
                                        **kw)
    with DraftSpy() as solo_spy:
        alone = [ddtree_generate(target, lone[b], prompts[b], seed=rows_[b]["seed"], **kw) for b in range(n)]
    if not per_row:
        mine, lone = batch_spy.made or [None] * n, solo_spy.made or [None] * n
    check_rows(target, prompts, batched, alone, [until_stop(c, stop) for c in conts], samplings, dtype, case,
               (batch_spy.of(mine), solo_spy.of(lone)))


@given(case=keyword_batches)
@fast_settings(25)
def test_ddtree_generate_batch_rows_are_their_prompts_alone(paths, case) -> None:
    check_keyword_batch(paths, case)


@pytest.mark.slow
@long_run
@seed(40)
@given(case=keyword_batches)
@long_settings(25)
def test_ddtree_generate_batch_rows_are_their_prompts_alone_long(paths, case) -> None:
    check_keyword_batch(paths, case)
