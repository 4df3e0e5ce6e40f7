"""DFlash2 parity with z-lab's ``dflash`` package (PyPI 0.1.0), without the package at run time.

``scripts/dflash2_official_parity.py``, run in the package's own environment, wrote with the package's
``DFlash2DraftModel`` two checkpoints under ``tests/data/dflash2`` (``planted``: codebooks in the released spelling,
a selector planted so drafts are often accepted; ``random``: the package's ``save_pretrained`` spelling, every
optional DFlash field set to a non-default value: ``is_causal``, a sliding-window layer, ``input_embedding_scale``,
``output_multiplier``, ``final_logit_softcapping``), loaded a third one written by ``spiffy tiny dflash2`` strictly,
and recorded in ``expected.json`` what its generation loop (``dflash_generate``, greedy, float64, CPU) does on each:
every round's drafted block, acceptance length and the output tokens, plus one proposal sampled at ``T = 0.8``.

Here spiffy loads the same checkpoints strictly (the third one rebuilt by ``make_tiny`` and checked to be the same
tensors) and must reproduce, round for round: the drafts (the whole drafted block, the last rounds' shorter blocks
included), the acceptance lengths and the tokens; and the package's sampled proposal ``q`` rows over the
candidates, conditioned on the path the package drew.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spiffy.arspec import ARSpecConfig, DFlash2Drafter, SelectorDraft, SamplingConfig, as_drafter, speculative_generate
from spiffy.models import family_of, load_ar_drafter, load_target, make_tiny

DATA = Path(__file__).parent / "data" / "dflash2"
EXPECTED = json.loads((DATA / "expected.json").read_text())
#: how the ``spiffy_tiny`` case was written (``--spiffy-tiny-args`` of the script)
SPIFFY_TINY = dict(seed=7, num_layers=2, target_layer_ids=[0, 1], block_size=8, selector_top_k=6, selector_rank=8,
                   conv_kernel_size=3, conv_group_size=16)


def _digest(path: Path) -> str:
    """sha256 over every stored tensor (name, dtype, shape, bytes) in name order (the script's ``weights_digest``)."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


@pytest.fixture(scope="module")
def target():
    return load_target(DATA / EXPECTED["target"], torch.float64, "cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    out = {name: DATA / case["checkpoint"] for name, case in EXPECTED["cases"].items() if case["checkpoint"]}
    tiny = dict(SPIFFY_TINY)
    seed = tiny.pop("seed")
    out["spiffy_tiny"] = make_tiny("dflash2", tmp_path_factory.mktemp("dflash2") / "tiny", seed=seed,
                                   target=DATA / EXPECTED["target"], **tiny)
    return out


def test_the_fixture_comes_from_the_official_package(checkpoints):
    """Which package wrote it, and the checkpoints here are the ones it read (both codebook spellings)."""
    assert EXPECTED["official"]["package"] == "dflash" and EXPECTED["official"]["version"] == "0.1.0"
    assert set(EXPECTED["cases"]) == {"planted", "random", "spiffy_tiny"}
    for name, case in EXPECTED["cases"].items():
        assert _digest(checkpoints[name]) == case["weights_sha256"], name
        assert case["strict_load"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}, name
        assert family_of(checkpoints[name]) == "dflash2"
    spellings = {name: case["codebooks_with_weight_suffix"] for name, case in EXPECTED["cases"].items()}
    assert spellings == {"planted": False, "random": True, "spiffy_tiny": False}
    # the planted checkpoint makes acceptance vary, so "round for round" is a real check
    lengths = {a for row in EXPECTED["cases"]["planted"]["rows"] for a in row["acceptance_lengths"]}
    assert len(lengths) >= 5


class RecordingDrafter(DFlash2Drafter):
    """Keeps every round's proposal."""

    def __init__(self, model) -> None:  # noqa: ANN001
        super().__init__(model)
        self.proposals: list[SelectorDraft] = []

    def propose(self, root_token: int, root_position: int, depth: int):  # noqa: ANN201
        out = super().propose(root_token, root_position, depth)
        self.proposals.append(out)
        return out


def _sampled_q(draft: SelectorDraft, path: list[int], temperature: float) -> list[dict[int, float]]:
    """Per position, ``{candidate token: q}`` at ``temperature`` given the previous token of ``path``."""
    cands = draft.candidates.tolist()
    rows = [torch.softmax(draft.first.double() / temperature, -1)]
    for d in range(1, len(path)):
        rows.append(torch.softmax(draft.following[d - 1, cands[d - 1].index(path[d - 1])].double() / temperature, -1))
    return [dict(zip(cands[d], row.tolist())) for d, row in enumerate(rows)]


@pytest.mark.parametrize("case", sorted(EXPECTED["cases"]))
def test_drafts_and_acceptance_lengths_round_for_round(case, target, checkpoints):
    expected = EXPECTED["cases"][case]
    model = load_ar_drafter(checkpoints[case], dtype=torch.float64)
    assert type(as_drafter(model)) is DFlash2Drafter
    for row in expected["rows"]:
        drafter = RecordingDrafter(model)
        res = speculative_generate(target, drafter, row["prompt"],
                                   ARSpecConfig(method="dflash2", max_new_tokens=expected["max_new_tokens"]))
        assert res.tokens == row["tokens"], (case, row["prompt"])
        assert res.acceptance_lengths == row["acceptance_lengths"], (case, row["prompt"])
        drafts = [p.chain().tokens.tolist() for p in drafter.proposals]
        assert drafts == row["drafts"], (case, row["prompt"])
        assert res.rounds == len(drafts) and res.nodes_per_round == [len(d) for d in drafts]
        sampled = row["sampled"]
        first = drafter.proposals[0]
        assert [sorted(c) for c in first.candidates.tolist()] == [sorted(c) for c in sampled["candidates"]]
        ours_q = _sampled_q(first, sampled["path"], sampled["temperature"])
        for d, (cands, q) in enumerate(zip(sampled["candidates"], sampled["q"])):
            for tok, prob in zip(cands, q):
                assert ours_q[d][tok] == pytest.approx(prob, abs=2e-6), (case, d, tok)  # theirs is float32


def test_ddtree_over_the_official_checkpoint_equals_ar(target, checkpoints):
    """DDTree over the official DFlash2 checkpoint equals AR (coupled rule, T = 0 and T > 0 with a seed)."""
    model = load_ar_drafter(checkpoints["planted"], dtype=torch.float64)
    for row in EXPECTED["cases"]["planted"]["rows"][:3]:
        for temperature in (0.0, 0.9):
            sampling = SamplingConfig(temperature=temperature, seed=5)
            ar = speculative_generate(target, None, row["prompt"], ARSpecConfig(method="ar", max_new_tokens=32,
                                                                                sampling=sampling))
            tree = speculative_generate(target, as_drafter(model), row["prompt"],
                                        ARSpecConfig(method="ddtree-dflash2", budget=12, max_new_tokens=32,
                                                     sampling=sampling))
            assert tree.tokens == ar.tokens
            assert tree.rounds < ar.rounds  # the tree was accepted in places
