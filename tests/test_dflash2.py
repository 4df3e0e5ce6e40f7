"""DFlash2 drafters: the checkpoint layout and strict loader, every config field honoured or refused, the pieces
(convolution, candidate selector) against direct formulas, the selector's chain / tree builders against brute force,
and every method over a DFlash2 drafter equal to AR (coupled rule, T = 0 and T > 0 seeded; batched rows equal alone).

Parity with z-lab's package itself is ``tests/test_dflash2_parity.py``; the rejection rule's distribution
``tests/test_dflash2_rejection.py``.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from spiffy.arspec import (
    ARSpecConfig,
    DFlash2Drafter,
    SamplingConfig,
    SelectorDraft,
    as_drafter,
    speculative_generate,
    speculative_generate_batch,
)
from spiffy.errors import CheckpointError, CheckpointKeyError, ConfigError
from spiffy.models import (
    DFlash2DraftModel,
    drafter_kind,
    family_of,
    load_ar_drafter,
    load_drafter,
    load_model,
    load_target,
    make_tiny,
    make_tiny_dflash2,
    make_tiny_target,
)
from spiffy.models.dflash2 import causal_group_convolve

torch.set_num_threads(1)

BLOCK = 6
TINY = dict(num_layers=2, target_layer_ids=[0, 1], block_size=BLOCK, selector_top_k=5, selector_rank=6,
            conv_kernel_size=3, conv_group_size=16)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("dflash2")
    target = make_tiny_target(base / "target", seed=2, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              vocab_size=48, weight_std=0.3, with_tokenizer=False)
    return target, make_tiny_dflash2(base / "drafter", target, seed=4, **TINY)


@pytest.fixture(scope="module")
def target(pair):
    return load_target(pair[0], torch.float64, "cpu")


@pytest.fixture(scope="module")
def drafter(pair):
    return load_ar_drafter(pair[1], dtype=torch.float64)


def _rewrite(src: Path, dst: Path, edit_state=None, edit_config=None) -> Path:  # noqa: ANN001
    """A single-file copy of ``src`` with its state and/or config edited."""
    dst.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    cfg = json.loads((src / "config.json").read_text())
    if edit_state is not None:
        state = edit_state(state)
    if edit_config is not None:
        edit_config(cfg)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ------------------------------------------------------------------------------------------------ checkpoints


def test_layout_keys_and_recognition(pair):
    _, path = pair
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} == {"conv_kernel_size": 3, "conv_group_size": 16,
                                                                        "selector_rank": 6, "selector_top_k": 5}
    keys = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.1.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight", "fc.weight"} <= keys
    assert not any(k.endswith("codebook.weight") for k in keys)  # the released spelling
    assert family_of(path) == "dflash2" and drafter_kind(path) == "dflash2"
    for model in (load_ar_drafter(path), load_model(path, dtype="float32")):
        assert type(model) is DFlash2DraftModel and family_of(model) == "dflash2"
    assert type(as_drafter(model)) is DFlash2Drafter


def test_tiny_is_deterministic_and_the_cli_writes_it(pair, tmp_path, capsys):
    target, path = pair
    again = make_tiny("dflash2", tmp_path / "again", seed=4, target=target, **TINY)
    for name in json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values():
        assert load_file(str(path / name)).keys() == load_file(str(again / name)).keys()
        for k, v in load_file(str(path / name)).items():
            assert torch.equal(v, load_file(str(again / name))[k])
    from spiffy.cli.main import main

    assert main(["tiny", "dflash2", str(tmp_path / "cli"), "--target", str(target), "--seed", "1", "--set",
                 "target_layer_ids=[0,1]"]) == 0
    assert family_of(tmp_path / "cli") == "dflash2"
    assert main(["tiny", "dflash2", str(tmp_path / "none")]) != 0
    assert "family dflash2 needs --target DIR" in capsys.readouterr().err


def test_both_codebook_spellings_load_strictly(pair, tmp_path, drafter):
    _, path = pair
    suffixed = _rewrite(path, tmp_path / "suffixed", edit_state=lambda s: {
        (k + ".weight" if k.endswith("codebook") else k): v for k, v in s.items()})
    other = load_ar_drafter(suffixed, dtype=torch.float64)
    for (k, v), (k2, v2) in zip(drafter.state_dict().items(), other.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    both = _rewrite(path, tmp_path / "both", edit_state=lambda s: {
        **s, "candidate_selector.successor_codebook.weight": s["candidate_selector.successor_codebook"].clone()})
    with pytest.raises(CheckpointKeyError, match="stored twice"):
        load_ar_drafter(both)
    extra = _rewrite(path, tmp_path / "extra", edit_state=lambda s: {**s, "candidate_selector.bias": torch.zeros(3)})
    with pytest.raises(CheckpointKeyError, match="candidate_selector.bias"):
        load_ar_drafter(extra)
    missing = _rewrite(path, tmp_path / "missing", edit_state=lambda s: {
        k: v for k, v in s.items() if not k.startswith("layers.0.mlp_conv")})
    with pytest.raises(CheckpointKeyError, match="layers.0.mlp_conv.base_kernel"):
        load_ar_drafter(missing)


def test_the_dflash_loader_names_dflash2(pair, tmp_path):
    """A DFlash2 checkpoint through the DFlash loader, or DFlash2 weights under a DFlash config: the fix says DFlash2."""
    _, path = pair
    with pytest.raises(CheckpointKeyError, match="fix: this is a DFlash2 drafter.*load_ar_drafter"):
        load_drafter(path)

    def strip(cfg: dict) -> None:
        cfg["architectures"] = ["DFlashDraftModel"]
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            del cfg["dflash_config"][k]

    stripped = _rewrite(path, tmp_path / "stripped", edit_config=strip)
    assert drafter_kind(stripped) == "dflash"
    with pytest.raises(CheckpointKeyError, match="fix: this is a DFlash2 drafter.*conv_kernel_size") as err:
        load_ar_drafter(stripped)
    assert len(err.value.unexpected) == 11  # 2 layers x 4 convolution tensors + the selector's 3


@pytest.mark.parametrize("field, value, match", [
    ("conv_group_size", 24, "dividing hidden_size"),
    ("selector_top_k", 49, "selector_top_k 49"),
    ("selector_rank", 0, "selector_rank 0"),
    ("conv_kernel_size", None, "lacks conv_kernel_size"),
    ("num_anchors", 4, "num_anchors, which no DFlash2 drafter reads"),
])
def test_bad_fields_are_refused_before_weights(pair, tmp_path, field, value, match):
    _, path = pair

    def edit(cfg: dict) -> None:
        if value is None:
            del cfg["dflash_config"][field]
        else:
            cfg["dflash_config"][field] = value

    bad = _rewrite(path, tmp_path / "bad", edit_state=lambda s: {}, edit_config=edit)  # no weights: config first
    with pytest.raises(ConfigError, match=match):
        load_ar_drafter(bad)


# ------------------------------------------------------------------------------------------ every field honoured


def _first_draft(drafter_model, target, prompt: list[int]) -> SelectorDraft:  # noqa: ANN001
    d = as_drafter(drafter_model)
    out: list[SelectorDraft] = []
    original = d.propose

    def keep(*args):  # noqa: ANN002, ANN202
        out.append(original(*args))
        return out[-1]

    d.propose = keep
    speculative_generate(target, d, prompt, ARSpecConfig(method="dflash2", max_new_tokens=3))
    return out[0]


@pytest.mark.parametrize("edit", [
    {"dflash_config": {"input_embedding_scale": 2.5}},
    {"dflash_config": {"output_multiplier": 0.3}},
    {"dflash_config": {"final_logit_softcapping": 0.5}},
    {"is_causal": True},
    {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True, "sliding_window": 2,
     "is_causal": False},
    {"layer_types": ["sliding_attention", "full_attention"]},  # a sliding layer with no window: causal by default
])
def test_every_optional_field_is_honoured(pair, tmp_path, target, drafter, edit):
    """Each field the official package reads, set to a non-default value, changes the draft's scores (the parity
    fixture checks the values against the package)."""
    _, path = pair

    def apply(cfg: dict) -> None:
        for k, v in edit.items():
            if k == "dflash_config":
                cfg["dflash_config"].update(v)
            else:
                cfg[k] = v

    edited = load_ar_drafter(_rewrite(path, tmp_path / "edited", edit_config=apply), dtype=torch.float64)
    base, other = _first_draft(drafter, target, [3, 1, 4, 1, 5]), _first_draft(edited, target, [3, 1, 4, 1, 5])
    assert not torch.allclose(base.following, other.following)


# ------------------------------------------------------------------------------------------------ the pieces


def test_convolution_is_causal_and_matches_its_formula():
    gen = torch.Generator().manual_seed(0)
    b, length, hidden, taps, group = 2, 5, 8, 3, 4
    x = torch.randn(b, length, hidden, generator=gen, dtype=torch.float64)
    dyn = torch.randn(b, length, taps, hidden // group, generator=gen, dtype=torch.float64)
    base = torch.randn(taps, hidden, generator=gen, dtype=torch.float64)
    y = causal_group_convolve(x, dyn, base, group)
    for t in range(length):
        for c in range(hidden):
            want = sum((base[o, c] + dyn[:, t, o, c // group]) * x[:, t - o, c] for o in range(taps) if t - o >= 0)
            assert torch.allclose(y[:, t, c], want, atol=1e-12)
    x2 = x.clone()
    x2[:, 3:] += 1.0  # later rows never reach earlier ones
    assert torch.equal(causal_group_convolve(x2, dyn, base, group)[:, :3], y[:, :3])


def test_selector_scores_match_the_pairwise_formula(drafter):
    gen = torch.Generator().manual_seed(1)
    depth, vocab = 4, int(drafter.config.vocab_size)
    hidden = torch.randn(depth, drafter.config.hidden_size, generator=gen, dtype=torch.float64)
    logits = torch.randn(depth, vocab, generator=gen, dtype=torch.float64)
    sel = drafter.candidate_selector
    cands, first, following = sel(hidden, logits, 7)
    assert cands.shape == (depth, 5) and torch.equal(cands, logits.topk(5, dim=-1).indices)
    proj = sel.hidden_projection(hidden)

    def score(d: int, prev: int, cand: int) -> torch.Tensor:
        return logits[d, cand] + (sel.predecessor_codebook[prev] * proj[d] * sel.successor_codebook[cand]).sum()

    for j, c in enumerate(cands[0].tolist()):
        assert torch.allclose(first[j], score(0, 7, c))
    for d in range(1, depth):
        for i, p in enumerate(cands[d - 1].tolist()):
            for j, c in enumerate(cands[d].tolist()):
                assert torch.allclose(following[d - 1, i, j], score(d, p, c))


def _random_draft(seed: int, depth: int, k: int, vocab: int = 20) -> SelectorDraft:
    gen = torch.Generator().manual_seed(seed)
    cands = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(depth)])
    first = torch.randn(k, generator=gen, dtype=torch.float64) * 2
    following = torch.randn(max(depth - 1, 0), k, k, generator=gen, dtype=torch.float64) * 2
    return SelectorDraft(cands, first, following, vocab)


def _path_logq(draft: SelectorDraft, path: tuple[int, ...], temperature: float) -> float:
    """log q of a path of candidate indices, written out from the definition."""
    t = temperature if temperature > 0 else 1.0
    total = float(torch.log_softmax(draft.first / t, -1)[path[0]])
    for d in range(1, len(path)):
        total += float(torch.log_softmax(draft.following[d - 1, path[d - 1]] / t, -1)[path[d]])
    return total


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), depth=st.integers(1, 4), k=st.integers(1, 4), budget=st.integers(0, 30),
       temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]))
def test_best_tree_is_the_top_prefixes_by_brute_force(seed, depth, k, budget, temperature):
    draft = _random_draft(seed, depth, k)
    tree = draft.best_tree(budget, temperature)
    every = {p: _path_logq(draft, p, temperature) for n in range(1, depth + 1)
             for p in itertools.product(range(k), repeat=n)}
    assert tree.num_nodes == min(budget, len(every))
    cands = draft.candidates.tolist()
    parents, tokens, depths = tree.parents.tolist(), tree.tokens.tolist(), tree.depths.tolist()
    chosen = []
    for i in range(tree.num_nodes):
        assert parents[i] < i and depths[i] == (1 if parents[i] < 0 else depths[parents[i]] + 1)
        path, node = [], i
        while node >= 0:
            path.append(cands[depths[node] - 1].index(tokens[node]))
            node = parents[node]
        chosen.append(tuple(reversed(path)))
        assert math.isclose(float(tree.scores[i]), every[chosen[-1]], abs_tol=1e-9)
    if chosen:  # the chosen prefixes are the most probable ones (ties may go either way at the border)
        worst = min(every[p] for p in chosen)
        assert all(every[p] <= worst + 1e-9 for p in every if p not in set(chosen))
        assert list(tree.scores) == sorted(tree.scores, reverse=True)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), depth=st.integers(1, 5), k=st.integers(1, 5))
def test_chain_is_the_greedy_walk(seed, depth, k):
    draft = _random_draft(seed, depth, k)
    index = int(draft.first.argmax())
    want = [int(draft.candidates[0, index])]
    for d in range(1, depth):
        index = int(draft.following[d - 1, index].argmax())
        want.append(int(draft.candidates[d, index]))
    assert draft.chain().tokens.tolist() == want


def test_sampled_drafts_record_their_proposals():
    draft = _random_draft(3, 4, 3)
    sampling = SamplingConfig(temperature=0.7, seed=2)
    tree = draft.sample_tree(5, sampling, 10)
    assert tree.samples is not None and sum(len(v) for v in tree.samples.values()) == 5 * 4
    assert draft.sample_tree(5, sampling, 10).tokens.tolist() == tree.tokens.tolist()  # keyed: reproducible
    cands = draft.candidates.tolist()
    depths, tokens = tree.depths.tolist(), tree.tokens.tolist()
    for node, draws in tree.samples.items():
        depth = 0 if node < 0 else depths[node]
        q = tree.proposal_below(node, depth)
        prev = None if node < 0 else cands[depth - 1].index(tokens[node])
        scores = draft.first if prev is None else draft.following[depth - 1, prev]
        want = torch.zeros(20, dtype=torch.float64)
        want[draft.candidates[depth]] = torch.softmax(scores / 0.7, -1)
        assert torch.allclose(q, want) and all(want[x] > 0 for x in draws)


# ------------------------------------------------------------------------------------------------- lossless

METHODS = ("dflash2", "ddtree-dflash2", "dflash", "ddtree", "specdiff")


@settings(max_examples=8, deadline=None)
@given(prompt=st.lists(st.integers(0, 46), min_size=1, max_size=7), temperature=st.sampled_from([0.0, 0.8]),
       seed=st.integers(0, 99), budget=st.integers(1, 14), method=st.sampled_from(METHODS))
def test_every_method_over_dflash2_equals_ar(target, drafter, prompt, temperature, seed, budget, method):
    """Coupled rule: token for token AR, at T = 0 and T > 0 with a seed, whatever the drafts."""
    sampling = SamplingConfig(temperature=temperature, seed=seed)
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=14, sampling=sampling))
    res = speculative_generate(target, as_drafter(drafter), prompt,
                               ARSpecConfig(method=method, budget=budget, drafts=3, max_new_tokens=14,
                                            sampling=sampling))
    assert res.tokens == ar.tokens, method


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_dflash2_rows_equal_alone(target, drafter, temperature):
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7], [40], [11, 12, 30, 8]]
    for method in ("dflash2", "ddtree-dflash2"):
        configs = [ARSpecConfig(method=method, budget=9, max_new_tokens=12,
                                sampling=SamplingConfig(temperature=temperature, seed=s)) for s in range(len(prompts))]
        batch = speculative_generate_batch(target, [as_drafter(drafter) for _ in prompts], prompts, configs)
        for p, cfg, row in zip(prompts, configs, batch):
            alone = speculative_generate(target, as_drafter(drafter), p, cfg)
            assert row.tokens == alone.tokens and row.acceptance_lengths == alone.acceptance_lengths, method


def test_cli_generate_with_a_dflash2_drafter(tiny_qwen3, tmp_path, capsys):
    """`spiffy generate --target T --drafter D2` for every method that drafts with it returns AR's tokens; the bench
    plans the DFlash2 methods for a DFlash2 --drafter."""
    from spiffy.bench.ar import plan_entries
    from spiffy.cli.main import main

    drafter_dir = make_tiny("dflash2", tmp_path / "d2", seed=1, target=tiny_qwen3, block_size=4)
    common = ["generate", "--target", str(tiny_qwen3), "--prompt", "def f(x):", "--max-new-tokens", "9", "--json",
              "--dtype", "float64", "--no-progress"]
    runs = {}
    for method in ("ar", "dflash2", "ddtree-dflash2"):
        extra = [] if method == "ar" else ["--drafter", str(drafter_dir)]
        if method == "ddtree-dflash2":  # only a tree method reads a tree budget (the command refuses it otherwise)
            extra += ["--tree-budget", "6"]
        assert main(common + extra + ["--method", method]) == 0
        runs[method] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["dflash2"]["tokens"] == runs["ddtree-dflash2"]["tokens"] == runs["ar"]["tokens"]
    names = [e.name for e in plan_entries([4], have_dflash=False, have_dflash2=True)]
    assert names == ["ar", "dflash2", "ddtree-dflash2@4"]


def test_device_map_placement_drafts_as_the_plain_load(pair, target, drafter, tmp_path):
    """A DFlash2 drafter placed with a device_map (its layers and selector offloaded to disk) drafts the same; the
    save_pretrained spelling of the codebooks is refused there with the fix."""
    pytest.importorskip("accelerate")
    _, path = pair
    placement = {"fc": "disk", "hidden_norm": "cpu", "layers.0": "disk", "layers.1": "cpu", "norm": "disk",
                 "rotary_emb": "cpu", "candidate_selector": "disk"}
    placed = load_ar_drafter(path, dtype=torch.float64, device_map=placement, offload_folder=tmp_path / "off")
    assert "disk" in placed.hf_device_map.values()
    for method in ("dflash2", "ddtree-dflash2"):
        cfg = ARSpecConfig(method=method, budget=8, max_new_tokens=12)
        ref = speculative_generate(target, as_drafter(drafter), [3, 1, 4, 1], cfg)
        got = speculative_generate(target, as_drafter(placed), [3, 1, 4, 1], cfg)
        assert got.tokens == ref.tokens and got.acceptance_lengths == ref.acceptance_lengths
    suffixed = _rewrite(path, tmp_path / "suffixed", edit_state=lambda s: {
        (k + ".weight" if k.endswith("codebook") else k): v for k, v in s.items()})
    with pytest.raises(CheckpointError, match="without device_map"):
        load_ar_drafter(suffixed, device_map=placement, offload_folder=tmp_path / "off2")


_SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3, "use_sliding_window": True}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("edits", [{"is_causal": True}, _SLIDING, {**_SLIDING, "is_causal": False}],
                         ids=["causal", "sliding", "sliding-bidirectional"])
def test_batched_masked_dflash2_rows_equal_alone(pair, target, tmp_path, temperature, edits):
    """``is_causal`` and sliding-window drafters share one forward too (masks over positions: each row's cached keys
    sit after its padding in the stacked cache, and the forward is told their positions)."""
    _, path = pair
    causal = load_ar_drafter(_rewrite(path, tmp_path / "masked", edit_config=lambda c: c.update(edits)),
                             dtype=torch.float64)
    assert as_drafter(causal).batch_key() is not None
    if "layer_types" in edits:
        assert [layer.window for layer in causal.layer_attention] == [3, None]
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7], [40]]
    configs = [ARSpecConfig(method="ddtree-dflash2", budget=7, max_new_tokens=12,
                            sampling=SamplingConfig(temperature=temperature, seed=s)) for s in range(len(prompts))]
    batch = speculative_generate_batch(target, [as_drafter(causal) for _ in prompts], prompts, configs)
    for p, cfg, row in zip(prompts, configs, batch):
        alone = speculative_generate(target, as_drafter(causal), p, cfg)
        assert row.tokens == alone.tokens and row.acceptance_lengths == alone.acceptance_lengths
