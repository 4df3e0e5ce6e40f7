"""A speculative path that leaves its baseline on one prompt is proven a near tie by the one rule of
:mod:`spiffy.bench.fidelity`, or refused with the reason (issue 38, item 1; :mod:`spiffy.bench.spec_fidelity`).

On a CPU single-prompt Spiffy / FreeDave / SSD equal the dLLM baseline bit for bit and the tiny AR pairs rarely
diverge, so each test breaks the verification forward on purpose, in the place a GPU's row-count-dependent kernels
would: the forward over ``1 + D`` states (dLLM) or over a tree of draft rows (AR) returns logits that differ from the
one-state / one-row forward's

* by rounding (every top-2 pair within 2 ulps of each other swapped by lifting the second 1 ulp above the first):
  the outputs diverge at a near tie and the proof accepts it (Spiffy, FreeDave, SSD on LLaDA; Spiffy on SDAR;
  DFlash, DDTree, DEER, SpecDiff-2);
* by more than rounding (one token's logit lifted by half the row's largest magnitude, 64 ulps in bfloat16; or the
  logits of another state served for the real one): the proof refuses, naming the logit deviation;
* or the speculative run draws other coins (another seed): the proof refuses (other generator state; AR's rule
  replayed on the speculative logits does not give the speculative token).

``spiffy bench`` runs the proof on every output that differs and exits 1 on an unproven one.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest
import torch

from spiffy.arspec import ARSpecConfig, DFlashDrafter, SamplingConfig, as_drafter
from spiffy.arspec import batch as ar_batch
from spiffy.arspec.rules import TargetLogits
from spiffy.bench import batch_fidelity, spec_fidelity
from spiffy.bench.fidelity import DEVIATION_ULPS, NearTieProof, divergence_entry
from spiffy.bench.report import markdown_report
from spiffy.bench.spec_fidelity import prove_ar_divergence, prove_dllm_divergence
from spiffy.cli.main import main
from spiffy.decoding import DecodeConfig
from spiffy.errors import ConfigError
from spiffy.models import (
    load_ar_drafter,
    load_drafter,
    load_target,
    make_tiny_dflash,
    make_tiny_dllm_drafter,
    make_tiny_target,
)
from spiffy.models.loading import load_model
from spiffy.selfspec import runtime
from spiffy.selfspec.oracle import random_graph
from spiffy.selfspec.rivals import rival_graph

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

Change = Callable[[torch.Tensor], torch.Tensor]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """``[...]`` the spacing of ``x``'s dtype at each ``|x|`` (float64)."""
    info = torch.finfo(x.dtype)
    mag = x.abs().double().clamp_min(info.tiny)
    return info.eps * torch.exp2(torch.floor(torch.log2(mag)))


def rounding_flip(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits whose top-2 pairs within 2 ulps of each other swap order (the second lifted 1 ulp above
    the first): a change of at most 3 ulps, what another reduction order can do at a near tie."""
    top = logits.double().topk(2, dim=-1)
    first, second = top.values[..., 0], top.values[..., 1]
    ulp = _ulp(logits.topk(1, dim=-1).values[..., 0])
    near = first - second <= 2 * ulp
    out = logits.double().clone()
    out.scatter_(-1, top.indices[..., 1:2], torch.where(near, first + ulp, second).unsqueeze(-1))
    return out.to(logits.dtype)


def beyond_rounding(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits with token 7 lifted by half of each row's largest magnitude (64 ulps in bfloat16)."""
    out = logits.clone()
    out[..., 7] += 0.5 * logits.abs().amax(dim=-1)
    return out


def token_seven_wins(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits where token 7 tops every row by 1 (a logic error no prompt can miss)."""
    out = logits.clone()
    out[..., 7] = logits.amax(dim=-1) + 1.0
    return out


def another_state(logits: torch.Tensor) -> torch.Tensor:
    """``[N, W, V]`` verification logits rolled by one state: each state gets the logits of the next one."""
    return logits.roll(1, dims=0)


def _break_dllm_verification(monkeypatch: pytest.MonkeyPatch, change: Change) -> None:
    """Spiffy's verification forward (every path with drafts: Spiffy, FreeDave, SSD) applies ``change`` to its
    ``[1 + D, W, V]`` logits whenever it verifies drafts; a forward over the real state alone stays exact."""
    real = runtime.forward_rows

    def forward_rows(fwd, requests):  # noqa: ANN001, ANN202
        return [out if out.shape[0] == 1 else change(out) for out in real(fwd, requests)]

    monkeypatch.setattr(runtime, "forward_rows", forward_rows)


def _break_ar_verification(monkeypatch: pytest.MonkeyPatch, change: Change) -> None:
    """The target's logits of a verification forward over a tree of draft rows get ``change``; a one-row forward
    (plain AR's rounds) stays exact."""

    class Changed(TargetLogits):
        def logits(self, node: int) -> torch.Tensor:
            out = super().logits(node)
            return change(out) if self.hidden.shape[0] > 1 else out

    monkeypatch.setattr(ar_batch, "TargetLogits", Changed)


# ---------------------------------------------------------------------------------------------------------- dLLM
_BF16: dict[str, torch.nn.Module] = {}


def _bf16(request: pytest.FixtureRequest, family: str) -> torch.nn.Module:
    if family not in _BF16:
        _BF16[family] = load_model(request.getfixturevalue(f"tiny_{family}"), dtype=torch.bfloat16)
    return _BF16[family]


CFG = DecodeConfig(gen_length=8, block_length=4, steps=8, cache="prefix")
SPIFFY_GRAPH = random_graph(levels=2, nodes=6, seed=1, i_max=4, j_max=3)
#: prompt seeds a test searches for one that diverges under its change (found on the first on this CPU)
SEEDS = range(12)


def _prompt(seed: int) -> list[int]:
    return torch.randint(5, 250, (6,), generator=torch.Generator().manual_seed(seed)).tolist()


def _graph(model: torch.nn.Module, path: str, config: DecodeConfig = CFG):  # noqa: ANN202
    return SPIFFY_GRAPH if path == "spiffy" else rival_graph(model, config, path, 3)


def _first_dllm_proof(model: torch.nn.Module, path: str, config: DecodeConfig = CFG) -> NearTieProof:
    """The proof of the first prompt (of :data:`SEEDS`) whose ``path`` output leaves the baseline."""
    graph = _graph(model, path, config)
    for seed in SEEDS:
        proof = prove_dllm_divergence(model, _prompt(seed), config, graph=graph, budget=2,
                                      compared=f"{path} vs baseline")
        if proof is not None:
            return proof
    pytest.fail(f"{path} never left the baseline under the broken verification forward ({len(SEEDS)} prompts)")


@pytest.mark.parametrize("path", ["spiffy", "freedave", "ssd"])
def test_a_rounding_flip_in_the_verification_forward_is_a_proven_near_tie(request, monkeypatch, path) -> None:
    model = _bf16(request, "llada")
    assert prove_dllm_divergence(model, _prompt(0), CFG, graph=_graph(model, path), budget=2) is None  # bitwise
    _break_dllm_verification(monkeypatch, rounding_flip)
    proof = _first_dllm_proof(model, path)
    assert proof.same_state and proof.replay and proof.near_tie, proof
    assert proof.deviation_ulps is not None and 0 < proof.deviation_ulps <= 3
    assert proof.gap is not None and proof.bound is not None and proof.gap <= proof.bound
    assert proof.row is None and proof.compared == f"{path} vs baseline" and proof.reason == ""


def test_a_rounding_flip_in_sdars_verification_forward_is_a_proven_near_tie(request, monkeypatch) -> None:
    _break_dllm_verification(monkeypatch, rounding_flip)
    proof = _first_dllm_proof(_bf16(request, "sdar"), "spiffy", DecodeConfig(gen_length=8, block_length=4, steps=8))
    assert proof.same_state and proof.replay and proof.near_tie, proof


@pytest.mark.parametrize("path", ["spiffy", "freedave", "ssd"])
def test_a_verification_forward_off_by_more_than_rounding_is_no_near_tie(request, monkeypatch, path) -> None:
    _break_dllm_verification(monkeypatch, beyond_rounding)
    proof = _first_dllm_proof(_bf16(request, "llada"), path)
    assert proof.same_state and proof.replay  # the rule itself is the baseline's: only the logits are wrong
    assert proof.deviation_ulps > DEVIATION_ULPS and not proof.near_tie
    assert "ulps" in proof.reason and proof.to_dict()["reason"] == proof.reason


def test_verification_logits_of_another_state_are_no_near_tie(request, monkeypatch) -> None:
    _break_dllm_verification(monkeypatch, another_state)
    proof = _first_dllm_proof(_bf16(request, "llada"), "spiffy")
    assert proof.deviation_ulps > DEVIATION_ULPS and not proof.near_tie, proof


def test_a_speculative_run_with_other_coins_is_no_near_tie(request, monkeypatch) -> None:
    """Spiffy's session draws from another seed than the baseline's (temperature 1): the first differing
    transition starts from another generator state."""
    real = batch_fidelity.spiffy_single

    def reseeded(session, *args, **kwargs):  # noqa: ANN001, ANN202
        session.generator.manual_seed(99)
        return real(session, *args, **kwargs)

    monkeypatch.setattr(batch_fidelity, "spiffy_single", reseeded)
    proof = _first_dllm_proof(_bf16(request, "llada"), "spiffy", CFG.replace(temperature=1.0, cache="dual"))
    assert not proof.same_state and not proof.near_tie and "different states" in proof.reason, proof


# ------------------------------------------------------------------------------------------------------------ AR
@pytest.fixture(scope="module")
def ar_target(tmp_path_factory) -> Path:  # noqa: ANN001
    return make_tiny_target(tmp_path_factory.mktemp("spec_near_tie_ar") / "target", seed=3, num_layers=3,
                            with_tokenizer=False)


@pytest.fixture(scope="module")
def ar_pair(ar_target: Path):  # noqa: ANN201
    d = make_tiny_dflash(ar_target.parent / "drafter", ar_target, seed=4, num_layers=2, block_size=8)
    return load_target(ar_target, torch.bfloat16, "cpu"), load_drafter(d, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def dllm_drafter(ar_target: Path):  # noqa: ANN201
    """A tiny dLLM drafter of the AR pair's target (DEER, SpecDiff-2)."""
    path = make_tiny_dllm_drafter(ar_target.parent / "dllm", ar_target, seed=1, block_size=8)
    return load_ar_drafter(path, dtype=torch.bfloat16)


def _first_ar_proof(ar_pair, config: ARSpecConfig, drafter=None) -> NearTieProof:  # noqa: ANN001
    target, dflash = ar_pair
    for seed in SEEDS:
        prompt = torch.randint(0, 250, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        wrapped = DFlashDrafter(dflash) if drafter is None else as_drafter(drafter)
        proof = prove_ar_divergence(target, wrapped, prompt, config)
        if proof is not None:
            return proof
    pytest.fail(f"{config.method} never left AR under the broken verification forward ({len(SEEDS)} prompts)")


def _ar_config(method: str, temperature: float = 0.0, accept: str = "coupled") -> ARSpecConfig:
    return ARSpecConfig(method=method, budget=8, accept=accept, max_new_tokens=24,
                        sampling=SamplingConfig(temperature=temperature, seed=1))


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_a_rounding_flip_in_the_tree_forward_is_a_proven_near_tie(ar_pair, monkeypatch, method) -> None:
    _break_ar_verification(monkeypatch, rounding_flip)
    proof = _first_ar_proof(ar_pair, _ar_config(method))
    assert proof.kind == "greedy" and proof.same_state and proof.replay and proof.near_tie, proof
    assert proof.position > 0 and proof.step >= 0 and proof.compared == f"{method} vs ar"
    # the planted flip moves at most 3 ulps; the tree and AR forwards may round apart by a few more on some CPUs
    assert proof.gap is not None and proof.gap <= proof.bound and proof.deviation_ulps <= DEVIATION_ULPS


@pytest.mark.parametrize("method", ["deer", "specdiff"])
def test_a_rounding_flip_under_a_dllm_drafter_is_a_proven_near_tie(ar_pair, dllm_drafter, monkeypatch,
                                                                    method) -> None:
    _break_ar_verification(monkeypatch, rounding_flip)
    proof = _first_ar_proof(ar_pair, replace(_ar_config(method), drafts=2), dllm_drafter)
    assert proof.kind == "greedy" and proof.same_state and proof.replay and proof.near_tie, proof


def test_a_tree_forward_off_by_more_than_rounding_is_no_near_tie(ar_pair, monkeypatch) -> None:
    _break_ar_verification(monkeypatch, beyond_rounding)
    proof = _first_ar_proof(ar_pair, _ar_config("ddtree"))
    assert proof.same_state and proof.replay and proof.deviation_ulps > DEVIATION_ULPS and not proof.near_tie, proof


def test_a_tree_run_with_other_coins_is_no_near_tie(ar_pair, monkeypatch) -> None:
    """The speculative run's coupled rule draws with another seed than AR's (temperature 0.7): AR's rule replayed on
    its logits does not give its token."""
    real = spec_fidelity.speculative_generate

    def reseeded(target, drafter, prompt, config, rule):  # noqa: ANN001, ANN202
        if config.method != "ar":
            rule.inner = spec_fidelity.make_rule(replace(config, sampling=replace(config.sampling, seed=5)))
        return real(target, drafter, prompt, config, rule=rule)

    monkeypatch.setattr(spec_fidelity, "speculative_generate", reseeded)
    proof = _first_ar_proof(ar_pair, _ar_config("dflash", temperature=0.7))
    assert proof.kind == "sampled" and proof.same_state and not proof.replay and not proof.near_tie, proof
    assert "replayed" in proof.reason


def test_outputs_the_proof_cannot_reproduce_are_unproven(ar_pair) -> None:
    """A 'speculative output' that no run produced (a token the target ranks last) is not explained by rounding:
    the proof's recording re-run does not reproduce it, and the report records it unproven."""
    target, drafter = ar_pair
    prompt, cfg = [5, 17, 99, 3], _ar_config("ddtree")
    ar = spec_fidelity.speculative_generate(target, None, prompt, spec_fidelity.plain_ar(cfg)).tokens
    wrong = list(ar[:3]) + [int(target(torch.tensor([prompt + ar[:3]])).logits[0, -1].argmin())] + list(ar[4:])
    assert prove_ar_divergence(target, DFlashDrafter(drafter), prompt, cfg, outputs=(ar, ar)) is None
    assert prove_ar_divergence(target, DFlashDrafter(drafter), prompt, cfg, outputs=(ar, wrong)) is None
    entry = divergence_entry(None)
    assert entry["near_tie"] is False and "did not reproduce" in entry["reason"]


def test_no_token_proof_for_the_rejection_rule_at_positive_temperature(ar_pair) -> None:
    target, drafter = ar_pair
    with pytest.raises(ConfigError, match="in distribution only"):
        prove_ar_divergence(target, DFlashDrafter(drafter), [5, 6, 7], _ar_config("dflash", 0.7, "rejection"))


# --------------------------------------------------------------------------------------------------------- bench
def test_bench_ar_exits_1_on_an_unproven_divergence(tiny_qwen3: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    drafter = make_tiny_dflash(tmp_path / "drafter", tiny_qwen3, seed=1, block_size=4)
    _break_ar_verification(monkeypatch, token_seven_wins)
    out = tmp_path / "out"
    rc = main(["bench", "ar", "--target", str(tiny_qwen3), "--drafter", str(drafter), "--dataset", "gsm8k",
               "--max-prompts", "1", "--budgets", "4", "--methods", "ddtree", "--max-new-tokens", "8", "--warmup",
               "0", "--no-progress", "--dtype", "bfloat16", "--no-plots", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "NOT proven near ties" in err and "ddtree@4 prompt" in err and "ulps" in err, err
    res = json.loads((out / "results.json").read_text())
    mism = next(m for m in res["methods"] if m["name"] == "ddtree@4")["mismatches"]
    assert mism and not mism[0]["near_tie"] and mism[0]["deviation_ulps"] > DEVIATION_ULPS and mism[0]["reason"]
    assert res["all_divergences_near_ties"] is False
    assert "NOT a near tie (a bug)" in (out / "results.md").read_text()


def test_bench_dllm_exits_1_on_an_unproven_divergence(tiny_llada: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """Every verification forward with drafts (the graph's rows and FreeDave's) breaks beyond rounding: exit 1,
    naming the rows and why."""
    model = load_model(tiny_llada, dtype=torch.float32)
    graph = tmp_path / "graph.json"
    rival_graph(model, CFG, "freedave", 3).save(graph)
    args = ["bench", "dllm", "--model", str(tiny_llada), "--graph", str(graph), "--budgets", "2", "--freedave",
            "3", "--ssd", "none", "--also-threshold", "none", "--dataset", "gsm8k", "--max-prompts", "2",
            "--gen-length", "8", "--block-length", "4", "--steps", "8", "--cache", "prefix", "--dtype", "bfloat16",
            "--no-chat", "--warmup", "0", "--no-progress", "--no-plots"]
    _break_dllm_verification(monkeypatch, token_seven_wins)
    rc = main(args + ["--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert rc == 1 and "NOT proven near ties" in err and "freedave 3 prompt" in err, err
    res = json.loads((tmp_path / "bad" / "results.json").read_text())
    assert not res["all_divergences_near_ties"] and "replayed" in res["near_tie_rule"]
    assert all(m["reason"] for r in res["runs"] for m in r["mismatches"])
    assert "NOT a near tie (a bug)" in markdown_report(res)
