"""spiffy.arspec interfaces: a drafter that is not DFlash, a pluggable acceptance rule, the configuration object,
and the registry of methods."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import spiffy
from spiffy.arspec import (
    Acceptance,
    ARSpecConfig,
    ContextUpdate,
    CoupledRule,
    Drafter,
    SamplingConfig,
    TargetLogits,
    METHODS,
    ddtree_generate,
    get_method,
    make_rule,
    speculative_generate,
)
from spiffy.errors import ConfigError
from spiffy.models import load_target, make_tiny_target

torch.set_num_threads(1)

BLOCK = 6


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_target(tmp_path_factory.mktemp("arspec") / "target", seed=5, num_layers=2, with_tokenizer=False)
    return load_target(path, torch.float64, "cpu")


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 250, (5,), generator=torch.Generator().manual_seed(2)).tolist()


class TokenDrafter:
    """A drafter conditioned on committed tokens only (the shape of a standalone dLLM drafter): it predicts a known
    continuation, wrong at every ``wrong_every``-th position, and records the context it was given."""

    def __init__(self, continuation: list[int], n_prompt: int, vocab: int, wrong_every: int = 0) -> None:
        self.block_size = BLOCK
        self.continuation = continuation
        self.n_prompt = n_prompt
        self.vocab = vocab
        self.wrong_every = wrong_every
        self.context: list[int] = []
        self.attached = False

    def check(self, target) -> None:  # noqa: ANN001
        assert target.config.vocab_size == self.vocab

    def attach(self, target) -> None:  # noqa: ANN001
        self.context, self.attached = [], True

    def propose(self, root_token: int, root_position: int, depth: int) -> torch.Tensor:
        assert root_position == len(self.context), "the root sits right after the committed context"
        logits = torch.full((depth, self.vocab), -20.0, dtype=torch.float64)
        for d in range(1, depth + 1):
            i = root_position + d - self.n_prompt
            tok = self.continuation[i] if 0 <= i < len(self.continuation) else 0
            if self.wrong_every and (root_position + d) % self.wrong_every == 0:
                logits[d - 1, (tok + 1) % self.vocab] = 0.0  # the wrong token first, the true one second
                logits[d - 1, tok] = -1.0
            else:
                logits[d - 1, tok] = 0.0
        return logits

    def commit(self, update: ContextUpdate) -> None:
        assert update.start == len(self.context) and len(update.tokens) == len(update.target_rows)
        self.context.extend(int(t) for t in update.tokens)

    def detach(self) -> None:
        self.attached = False


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_token_conditioned_drafter_is_lossless(target, prompt, method, temperature):
    sampling = SamplingConfig(temperature=temperature, seed=3)
    n = 21
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=n + BLOCK, sampling=sampling))
    vocab = target.config.vocab_size
    for wrong_every in (0, 4):
        drafter = TokenDrafter(ar.tokens, len(prompt), vocab, wrong_every)
        assert isinstance(drafter, Drafter)
        cfg = ARSpecConfig(method=method, budget=12, max_new_tokens=n, sampling=sampling)
        res = speculative_generate(target, drafter, prompt, cfg)
        assert res.tokens == ar.tokens[:n], (method, wrong_every)
        assert not drafter.attached  # detached at the end
        # the drafter was told exactly the committed context: the prompt and every token but the pending bonus
        assert drafter.context == prompt + res.tokens[: len(drafter.context) - len(prompt)]
        # ... which is every token the target's cache holds: all but the last round's bonus, or all of them when the
        # last round's drafts reach the last position and are all accepted (its bonus falls beyond max_new_tokens)
        assert len(drafter.context) - len(prompt) - sum(res.acceptance_lengths) in (0, 1)
        if wrong_every == 0:
            assert res.tau > 1.0


def test_acceptance_rule_is_pluggable_and_target_logits_are_lazy(target, prompt):
    sampling = SamplingConfig(temperature=1.0, seed=1)
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=30, sampling=sampling))
    seen: list[tuple[int, int, int]] = []

    class Recording:
        def __init__(self) -> None:
            self.inner = CoupledRule(sampling)

        def accept(self, tree, target_logits: TargetLogits, draft_logits, root_position: int) -> Acceptance:
            out = self.inner.accept(tree, target_logits, draft_logits, root_position)
            seen.append((tree.num_nodes, len(out.accepted), target_logits.rows_computed))
            return out

    drafter = TokenDrafter(ar.tokens, len(prompt), target.config.vocab_size, wrong_every=3)
    cfg = ARSpecConfig(method="ddtree", budget=16, max_new_tokens=24, sampling=sampling)
    res = speculative_generate(target, drafter, prompt, cfg, rule=Recording())
    assert res.tokens == ar.tokens[:24]
    assert len(seen) == res.rounds
    # the head runs on the visited rows only: the root and each accepted node
    assert all(rows == accepted + 1 for _nodes, accepted, rows in seen)
    assert any(nodes > accepted + 1 for nodes, accepted, _rows in seen)


def test_chain_length_and_tree_budget_are_separate(target, prompt):
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=20))
    drafter = TokenDrafter(ar.tokens, len(prompt), target.config.vocab_size)
    short = speculative_generate(target, drafter, prompt, ARSpecConfig(method="dflash", chain_length=2, budget=0, max_new_tokens=14))
    assert short.tokens == ar.tokens[:14]
    assert max(short.nodes_per_round) == 2 and short.budget == 2
    whole = speculative_generate(target, drafter, prompt, ARSpecConfig(method="dflash", max_new_tokens=14))
    assert whole.budget == BLOCK - 1 and max(whole.nodes_per_round) == BLOCK - 1
    none = speculative_generate(target, drafter, prompt, ARSpecConfig(method="dflash", chain_length=0, max_new_tokens=8))
    assert none.tokens == ar.tokens[:8] and set(none.nodes_per_round) == {0}


def test_config_validation():
    for kwargs, word in [
        (dict(method="beam"), "method"),
        (dict(budget=-1), "budget"),
        (dict(chain_length=-2), "chain_length"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(block_size=0), "block_size"),
    ]:
        with pytest.raises(ConfigError, match=word):
            ARSpecConfig(**kwargs)
    with pytest.raises(ConfigError, match="temperature"):
        ARSpecConfig(sampling=SamplingConfig(temperature=-1.0))
    assert ARSpecConfig(stop_token_ids=7).stop_token_ids == (7,)
    assert ARSpecConfig(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert not ARSpecConfig(method="ddtree", budget=0).uses_drafter
    assert ARSpecConfig(method="dflash").uses_drafter and not ARSpecConfig(method="ar").uses_drafter


def test_ddtree_generate_accepts_any_drafter(target, prompt):
    ar = ddtree_generate(target, None, prompt, method="ar", max_new_tokens=12)
    drafter = TokenDrafter(ar.tokens, len(prompt), target.config.vocab_size)
    assert ddtree_generate(target, drafter, prompt, method="ddtree", budget=8, max_new_tokens=12).tokens == ar.tokens


def test_the_old_ar_package_is_gone():
    """spiffy.ar (a shim no release shipped) is deleted: its names live in spiffy.arspec and spiffy.models."""
    assert not (Path(spiffy.__file__).parent / "ar").exists()
    assert spiffy.ddtree_generate is ddtree_generate


def _literal_names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {n for elt in node.elts for n in _literal_names(elt)}
    return set()


def test_method_names_are_compared_in_the_registry_only():
    """No module but spiffy/arspec/methods.py compares a method with a name literal (``cfg.method == "ddtree"``,
    ``method in ("deer", "specdiff")``): the others ask the method objects."""
    root = Path(spiffy.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "arspec" / "methods.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if not any("method" in ast.unparse(side) for side in sides):
                continue
            if any(_literal_names(side) & set(METHODS) for side in sides):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_registry_builds_every_method_and_rule():
    """Every registry entry builds a config and a rule; a bad name is a ConfigError naming the choices."""
    for name in METHODS:
        spec = get_method(name)
        assert spec.name == name and spec.help and spec.label and spec.shape in ("none", "chain", "tree")
        cfg = ARSpecConfig(method=name)
        assert cfg.spec is spec and cfg.uses_drafter == spec.needs_drafter
        for accept in spec.accepts:
            assert make_rule(ARSpecConfig(method=name, accept=accept)) is not None
    assert ARSpecConfig(method=get_method("dflash")).method == "dflash"
    with pytest.raises(ConfigError, match="ddtree"):
        get_method("beam")
    with pytest.raises(ConfigError, match="coupled"):
        ARSpecConfig(accept="maybe")
