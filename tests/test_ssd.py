"""SSD (arXiv 2510.04147) as a Spiffy graph: the verification tree's shape, losslessness (float64, every family x
cache mode x rule x temperature, single prompts and batches; the shipped tiny-sdar bitwise in bfloat16), a runtime
that used SSD's drafts without the baseline's check (it must diverge, or the equality tests could not fail), and
the ``ssd`` rows of ``spiffy bench dllm`` / ``spiffy generate --graph ssd:K``."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_cases import BLOCK, GEN, SEEDS, dream, llada, sdar  # noqa: F401 - module fixtures
from batch_cases import left_pad, ragged_prompts
from pairwise import pairwise_params
from spiffy.api import generate
from spiffy.decoding import DecodeConfig
from spiffy.embedded import embedded_model_path
from spiffy.errors import ConfigError
from spiffy.models import load_model, load_tokenizer
from spiffy.selfspec import runtime
from spiffy.selfspec.freedave import freedave_graph
from spiffy.selfspec.rivals import RIVALS, parse_rival, parse_rival_list, rival_graph
from spiffy.selfspec.ssd import parse_ssd_states, ssd_graph

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

#: rules of the bidirectional families: SSD's own (stepwise: one token per step), two per step, threshold
RULES = {"stepwise": dict(steps=GEN), "two_per_step": dict(steps=GEN // 2), "threshold": dict(threshold=0.05)}
SDAR_RULES = {"stepwise": dict(strategy="low_confidence_static", denoising_steps=BLOCK),
              "two_per_step": dict(strategy="low_confidence_static", denoising_steps=BLOCK // 2),
              "threshold": dict(strategy="low_confidence_dynamic", denoising_steps=BLOCK, threshold=0.05)}
#: a few drawn cases per matrix cell: the matrix is the breadth, hypothesis varies the width K and the prompts
FEW = settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
WIDTHS = st.integers(min_value=2, max_value=6)
LENGTHS = st.lists(st.integers(min_value=2, max_value=9), min_size=2, max_size=3)


def test_ssd_graph_is_the_path_tree(llada) -> None:
    """K states per forward = the real state + a path of K - 1 nodes, level d adding the d-th step's drafts (one
    token per step, S under S tokens per step, one under threshold decoding), tuned to verify all of it."""
    g = ssd_graph(llada, DecodeConfig(gen_length=GEN, block_length=BLOCK, steps=GEN), 4)
    assert [n.level for n in g.nodes] == [1, 2, 3] and [n.parents for n in g.nodes] == [(), (0,), (1,)]
    assert [n.pairs for n in g.nodes] == [((1, 1),), ((1, 1), (2, 1)), ((1, 1), (2, 1), (3, 1))]
    assert g.tuned_budget == 3 and g.meta["calibration"]["method"] == "ssd"
    two = ssd_graph(llada, DecodeConfig(gen_length=GEN, block_length=BLOCK, steps=GEN // 2), 3)
    assert [len(n.pairs) for n in two.nodes] == [2, 4] and two.calibrated_for["tokens_per_step"] == 2
    thr = ssd_graph(llada, DecodeConfig(gen_length=GEN, block_length=BLOCK, threshold=0.9), "ssd:3")
    assert [len(n.pairs) for n in thr.nodes] == [1, 2]
    # under these assumptions SSD drafts FreeDave's states at the same width (module docstring of spiffy.selfspec.ssd)
    cfg = DecodeConfig(gen_length=GEN, block_length=BLOCK, steps=GEN)
    assert [n.pairs for n in freedave_graph(llada, cfg, 4).nodes] == [n.pairs for n in g.nodes]
    assert parse_ssd_states("ssd:5") == 5 and parse_ssd_states(2) == 2
    for bad in ("ssd:1", "ssd:x", 0):
        with pytest.raises(ConfigError, match="SSD"):
            parse_ssd_states(bad)
    assert parse_rival("ssd:4") == ("ssd", 4) and parse_rival("freedave:3") == ("freedave", 3)
    assert parse_rival("graphs/x.json") is None and parse_rival_list("ssd", " 2, 6 ") == [2, 6]
    assert set(RIVALS) == {"freedave", "ssd"}
    from spiffy.selfspec import ssd_graph as exported  # the Python API's lazy name

    assert exported is ssd_graph
    with pytest.raises(ConfigError, match="unknown rival"):
        rival_graph(llada, cfg, "medusa", 3)


def _check(model, kw: dict, k: int, lengths: list[int]) -> int:
    """SSD with ``k`` states per forward equals the baseline for every prompt alone and for the batch (rows equal the
    prompts alone, and each row is served by as many forwards as alone). Returns the drafts accepted."""
    prompts = ragged_prompts(lengths)
    graph = ssd_graph(model, None, k, **kw)
    accepted, alone_nfe = 0, []
    for x, seed in zip(prompts, SEEDS):
        base = generate(model, x[None], **{**kw, "seed": seed})
        spec = generate(model, x[None], graph=graph, **{**kw, "seed": seed})
        assert spec.tokens == base.tokens, f"SSD {k} changed prompt {x.tolist()} under {kw}"
        assert spec.stats["baseline_equivalent_nfe"] == base.nfe
        accepted += int(spec.stats["accepted_total"])
        alone_nfe.append(spec.nfe)
    ids, am = left_pad(prompts)
    seeds = SEEDS[: len(prompts)]
    batch = generate(model, ids, attention_mask=am, graph=graph, seeds=seeds, **kw)
    base = generate(model, ids, attention_mask=am, seeds=seeds, **kw)
    assert batch.tokens == base.tokens, f"batched SSD {k} differs from the batched baseline under {kw}"
    assert [r["nfe"] for r in batch.stats["rows"]] == alone_nfe
    return accepted


@pytest.mark.parametrize(("rule", "cache", "temp"), pairwise_params(list(RULES), ["none", "prefix", "dual"], [0.0, 1.0]))
def test_ssd_lossless_llada(llada, rule: str, cache: str, temp: float) -> None:
    kw = dict(gen_length=GEN, block_length=BLOCK, cache=cache, temperature=temp, **RULES[rule])

    @FEW
    @given(k=WIDTHS, lengths=LENGTHS)
    def case(k: int, lengths: list[int]) -> None:
        _check(llada, kw, k, lengths)

    case()


@pytest.mark.parametrize(("rule", "cache", "temp"), pairwise_params(list(RULES), ["none", "prefix", "dual"], [0.0, 1.0]))
def test_ssd_lossless_dream(dream, rule: str, cache: str, temp: float) -> None:
    kw = dict(gen_length=GEN, block_length=BLOCK, cache=cache, temperature=temp, **RULES[rule])

    @FEW
    @given(k=WIDTHS, lengths=LENGTHS)
    def case(k: int, lengths: list[int]) -> None:
        _check(dream, kw, k, lengths)

    case()


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("rule", list(SDAR_RULES))
def test_ssd_lossless_sdar(sdar, rule: str, temp: float) -> None:
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=temp, **SDAR_RULES[rule])

    @FEW
    @given(k=WIDTHS, lengths=LENGTHS)
    def case(k: int, lengths: list[int]) -> None:
        _check(sdar, kw, k, lengths)

    case()


def test_ssd_accepts_on_random_weights(llada, sdar) -> None:
    """The lossless matrix is not vacuous: at T = 0, stepwise, SSD's drafts are accepted on the random models."""
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=0.0)
    assert _check(llada, {**kw, **RULES["stepwise"]}, 4, [4, 7, 2]) > 0
    assert _check(sdar, {**kw, **SDAR_RULES["stepwise"]}, 4, [4, 7, 2]) > 0


def _unchecked_child(self, wnode, state):  # noqa: ANN001, ANN202 - the mutant below
    """A broken walk: the first kept child of ``wnode`` is taken as the next state without comparing it with the
    state the baseline rule produced, so its logits drive the next step even when it is not that state."""
    row = self.row
    if row.session.block_finished(row.block(self.block), row.step, state):
        return None
    kids = [c for c in self.plan.children(wnode[0]) if c in self.row_of]
    return (kids[0], 0) if kids else None


def test_ssd_without_the_baseline_check_diverges(llada, monkeypatch) -> None:
    """What makes SSD lossless is the check, not the drafts: the same drafts used without comparing them with the
    baseline's next state change the output (so the equality tests above can fail), at T = 0 and at T > 0."""
    for temp in (0.0, 1.0):
        kw = dict(gen_length=GEN, block_length=BLOCK, steps=GEN, temperature=temp, seed=7)
        x = ragged_prompts([5])[0][None]
        graph = ssd_graph(llada, None, 4, **kw)
        base = generate(llada, x, **kw)
        checked = generate(llada, x, graph=graph, **kw)
        assert checked.tokens == base.tokens
        # some drafts were wrong: had they been used, the baseline's states would not have been reproduced
        assert checked.stats["accepted_total"] < checked.stats["drafts_evaluated"]
        with monkeypatch.context() as patch:
            patch.setattr(runtime._DraftWalk, "child_matching", _unchecked_child)
            broken = generate(llada, x, graph=graph, **kw)
        assert broken.tokens != base.tokens, f"an unchecked SSD still matched the baseline at T={temp}"


@pytest.fixture(scope="module")
def tiny_sdar_bf16():
    path = embedded_model_path("dllm")
    return load_model(path, dtype="bfloat16"), load_tokenizer(path)


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (0.8, 3)])
def test_ssd_on_shipped_tiny_sdar_bfloat16_is_bitwise_lossless(tiny_sdar_bf16, temperature: float, seed: int) -> None:
    """The shipped tiny-sdar in the dtype its weights ship in: SSD's tokens are the baseline's, bit for bit, for
    single prompts and a batch, it saves forwards, and it spends exactly FreeDave's forwards at the same width."""
    model, tok = tiny_sdar_bf16
    cfg = DecodeConfig(gen_length=32, block_length=32, steps=32, temperature=temperature, seed=seed)
    texts = ["def fibonacci(n):\n", "def is_palindrome(s: str) -> bool:\n"]
    prompts = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    for k in (2, 4, 6) if temperature == 0.0 else (4,):
        graph, chain = ssd_graph(model, cfg, k), freedave_graph(model, cfg, k)
        for x in prompts:
            base = generate(model, x[None], cfg)
            spec = generate(model, x[None], cfg, graph=graph)
            assert spec.tokens == base.tokens and torch.equal(spec.sequences, base.sequences)
            assert spec.nfe == generate(model, x[None], cfg, graph=chain).nfe
            if temperature == 0.0:
                assert spec.nfe < base.nfe  # end-of-text runs: drafts are accepted
        ids, am = left_pad(prompts)
        batch = generate(model, ids, cfg, attention_mask=am, graph=graph)
        assert batch.tokens == generate(model, ids, cfg, attention_mask=am).tokens


def test_bench_dllm_ssd_rows_and_generate_ssd(tiny_llada, tmp_path, capsys) -> None:
    """``spiffy bench dllm --freedave 2 --ssd 2,3``: SSD rows beside FreeDave's and Spiffy's, each Spiffy row against
    every rival of its width with intervals; ``spiffy generate --graph ssd:3`` prints the baseline's tokens."""
    from spiffy.cli.main import main
    from spiffy.selfspec.calibrate import calibrate

    model = load_model(tiny_llada, dtype="float64")
    cfg = DecodeConfig(gen_length=8, block_length=4)
    graph = calibrate(model, load_tokenizer(tiny_llada), ["def f(x):", "import os"], cfg, nodes=3, chat=False,
                      progress=False)
    graph.save(tmp_path / "g.json")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def add(a, b):"}\n{"id": "b", "prompt": "for i in range(3):"}\n')
    out = tmp_path / "bench"
    flags = ["--gen-length", "8", "--block-length", "4", "--dtype", "float64"]
    rc = main(["bench", "dllm", "--model", str(tiny_llada), "--graph", str(tmp_path / "g.json"), "--budgets", "1,2",
               "--freedave", "2", "--ssd", "2,3", "--dataset", str(prompts), *flags, "--no-chat", "--no-progress",
               "--no-plots", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["states_per_forward"]) for r in res["runs"]] == [
        ("spiffy", 2), ("spiffy", 3), ("freedave", 2), ("ssd", 2), ("ssd", 3)]
    runs = {(r["method"], r["states_per_forward"]): r for r in res["runs"]}
    assert all(r["identical_fraction"] == 1.0 for r in res["runs"])
    assert runs[("spiffy", 2)]["rivals"] == {"freedave": "freedave 2", "ssd": "ssd 2"}
    assert runs[("spiffy", 3)]["rivals"] == {"ssd": "ssd 3"} and runs[("spiffy", 3)]["rival"] is None
    assert runs[("ssd", 2)]["nfe_total"] == runs[("freedave", 2)]["nfe_total"]  # the same draft states
    per_prompt = res["per_prompt"]
    for width in (2, 3):
        r = runs[("spiffy", width)]
        ssd_nfe = sum(p["spiffy"][f"ssd:{width}"]["nfe"] for p in per_prompt)
        assert r["nfe_reduction_vs_ssd"] == pytest.approx(ssd_nfe / sum(p["spiffy"][str(width - 1)]["nfe"]
                                                                         for p in per_prompt))
        assert set(r["intervals"]) >= {"nfe_reduction_vs_ssd", "speedup_vs_ssd"}
    md = (out / "results.md").read_text()
    assert "| vs SSD at equal states (NFE; speedup) |" in md and "| ssd 2 | 1 |" in md and "| ssd 3 | 2 |" in md
    assert main(["bench", "dllm", "--model", str(tiny_llada), "--graph", str(tmp_path / "g.json"), "--ssd", "1",
                 "--dataset", str(prompts), *flags, "--no-chat", "--out", str(out)]) == 2  # ConfigError: K >= 2
    capsys.readouterr()
    tokens = []
    for extra in ([], ["--graph", "ssd:3"]):
        assert main(["generate", "--model", str(tiny_llada), "--prompt", "def f(x):", *flags, "--json",
                     "--no-progress", *extra]) == 0
        tokens.append(json.loads(capsys.readouterr().out)["tokens"])
    assert tokens[0] == tokens[1]
