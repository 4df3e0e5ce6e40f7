"""Every AR target architecture, through transformers' own classes (float64, tiny random checkpoints written by
``make_tiny(arch, ...)``, the embedded tokenizer's vocabulary): tree-node logits equal the same path decoded alone;
spiffy's AR equals ``model.generate(do_sample=False)``; every method equals AR under the coupled rule (T = 0 and a
seeded T > 0) with random real drafters (DFlash made by ``make_tiny_dflash``, a dLLM by ``make_tiny_dllm_drafter``)
and with oracle drafters that accept runs through side branches; batched rows equal the prompts alone. MoE routing is
per token. The hybrids (Qwen3.5, Qwen3-Next: Gated-DeltaNet layers) pass the same tests through
:class:`~spiffy.models.recurrent.RecurrentMixers` (branch by branch verification, state advanced over the accepted
path), and a plain tree forward is shown to be wrong on them. Architectures that cannot be verified exactly (sliding
windows, unknown layer kinds) are refused with a typed one-line error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from oracle_drafter import OracleDrafter

from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, speculative_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.methods import METHODS
from spiffy.arspec.stages import (
    RoundBuffers,
    TargetRunner,
    compile_round,
    prefill,
    prefill_inputs,
    tree_columns,
    verify,
)
from spiffy.arspec.tree import DraftTree, build_ddtree
from spiffy.errors import ConfigError, UnknownModelTypeError, UnsupportedTargetError
from spiffy.models import load_drafter, load_model, load_target, make_tiny_dflash
from spiffy.models.ar_drafters import load_ar_drafter, make_tiny_dllm_drafter
from spiffy.models.recurrent import RecurrentMixers, branches
from spiffy.models.target import check_target_config, target_families
from spiffy.models.tiny import make_tiny

torch.set_num_threads(1)

#: every registered AR target architecture
ARCHS = tuple(spec.name for spec in target_families().values())
BLOCK = 5


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    """``(name, target [float64], target dir, DFlash drafter dir, dLLM drafter dir)`` of one architecture."""
    name = request.param
    root = tmp_path_factory.mktemp(f"arch_{name}")
    target_dir = make_tiny(name, root / "target", seed=1, num_hidden_layers=3)
    dflash_dir = make_tiny_dflash(root / "dflash", target_dir, seed=2, block_size=BLOCK)
    dllm_dir = make_tiny_dllm_drafter(root / "dllm", target_dir, seed=3, block_size=BLOCK)
    return name, load_target(target_dir, torch.float64, "cpu"), target_dir, dflash_dir, dllm_dir


def _oracle(continuation: list[int], n_prompt: int, vocab: int, wrong_every: int = 0) -> OracleDrafter:
    """Confident drafts of the AR continuation, wrong every ``wrong_every``-th position with the true token second
    (so DDTree accepts through side branches and the chain stops)."""
    return OracleDrafter(continuation, n_prompt, vocab, BLOCK, wrong_every, floor=-6.0, top=3.0, second=2.0)


def _prompts(vocab: int, lengths=(6, 3, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(5, vocab - 8, (n,), generator=g).tolist() for n in lengths]


def _config(method: str, n: int, temperature: float, seed: int = 3) -> ARSpecConfig:
    return ARSpecConfig(method=method, budget=10, drafts=3, max_new_tokens=n,
                        sampling=SamplingConfig(temperature=temperature, top_k=40 if temperature else 0, seed=seed))


def test_tree_node_logits_equal_the_path_decoded_alone(arch):
    """One verification forward over two ragged rows' DDTree trees on top of the prefilled cache: every node's logits
    equal a cache-free forward of the prompt + its root-to-node path (float64)."""
    _, target, *_ = arch
    vocab = int(target.config.vocab_size)
    prompts = _prompts(vocab, (7, 4))
    runner = TargetRunner.for_target(target)
    # transformers' Gated-DeltaNet kernels compute in float32 whatever the model's dtype, and a state carried across
    # forwards rounds differently from one pass over the whole sequence: float32 rounding, far below the 1e-3 a
    # sibling leaking into the state gives (test_a_plain_tree_forward_is_wrong_on_hybrids)
    tol = 1e-10 if runner.recurrent is None else 1e-5
    ids, positions, mask, valid, _ = prefill_inputs(prompts, runner.device, runner.dtype)
    first = prefill(runner, ids, positions, mask, valid)
    roots = [(int(first[b].argmax()), len(p)) for b, p in enumerate(prompts)]
    g = torch.Generator().manual_seed(7)
    trees = [build_ddtree(torch.log_softmax(3 * torch.randn(4, vocab, generator=g, dtype=torch.float64), -1), budget)
             for budget in (12, 7)]
    compiled, widths = compile_round(trees, roots, valid, runner.dtype, RoundBuffers.allocate(2, 13))
    with torch.no_grad():
        logits = runner.lm_head(verify(runner, compiled, tree_columns(trees)))
        for b, (tree, (root, _)) in enumerate(zip(trees, roots)):
            tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            paths: list[list[int]] = []
            for tok, par in zip(tokens, parents):
                paths.append((paths[par] if par >= 0 else [root]) + [tok])
            for row, path in enumerate([[root]] + paths):
                alone = target(torch.tensor([prompts[b] + path])).logits[0, -1]
                torch.testing.assert_close(logits[b, row], alone, rtol=0, atol=tol)
            assert widths[b] == 1 + len(tokens)


def test_ar_equals_transformers_generate(arch):
    _, target, *_ = arch
    stops = target.generation_config.eos_token_id
    stops = [stops] if isinstance(stops, int) else list(stops or [])
    for prompt in _prompts(int(target.config.vocab_size)):
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
        ours = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=16,
                                                                      stop_token_ids=tuple(stops)))
        assert ours.tokens == ref


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])  # T > 0: slow tier
def test_every_method_equals_ar_with_real_drafters(arch, temperature):
    """DFlash drafters (target features through forward hooks on this architecture's layers) and dLLM drafters."""
    _, target, _, dflash_dir, dllm_dir = arch
    prompt = _prompts(int(target.config.vocab_size))[0]
    ar = speculative_generate(target, None, prompt, _config("ar", 14, temperature))
    for kind, path in (("dflash", dflash_dir), ("dllm", dllm_dir)):
        for method in METHODS:
            drafter = as_drafter(load_ar_drafter(path, dtype=torch.float64))
            res = speculative_generate(target, drafter, prompt, _config(method, 14, temperature))
            assert res.tokens == ar.tokens, (kind, method)


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_every_method_equals_ar_when_drafts_are_accepted(arch, temperature):
    """Oracle drafts: long accepted runs (and with wrong drafts, acceptance through DDTree's side branches, so kept
    K/V rows are not a prefix of the verified window)."""
    _, target, *_ = arch
    vocab = int(target.config.vocab_size)
    prompt = _prompts(vocab)[2]
    n = 20
    ar = speculative_generate(target, None, prompt, _config("ar", n + BLOCK, temperature))
    for wrong_every in (0, 3):
        for method in METHODS:
            res = speculative_generate(target, _oracle(ar.tokens, len(prompt), vocab, wrong_every), prompt,
                                       _config(method, n, temperature))
            assert res.tokens == ar.tokens[:n], (method, wrong_every)
            if wrong_every == 0 and method != "ar":
                assert res.tau > 2.0, (method, res.tau)


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])  # T = 0: slow tier
def test_batched_rows_equal_prompts_alone(arch, temperature):
    _, target, _, dflash_dir, _ = arch
    vocab = int(target.config.vocab_size)
    prompts = _prompts(vocab)
    for method in ("ar", "ddtree", "dflash"):
        cfgs = [_config(method, 12, temperature, seed=s) for s in (3, 4, 5)]
        alone = [speculative_generate(target, as_drafter(load_drafter(dflash_dir, dtype=torch.float64)), p, c)
                 for p, c in zip(prompts, cfgs)]
        drafters = [as_drafter(load_drafter(dflash_dir, dtype=torch.float64)) for _ in prompts]
        batch = speculative_generate_batch(target, drafters, prompts, cfgs)
        assert [r.tokens for r in batch] == [r.tokens for r in alone], method
    # oracle rows accepting different amounts (side branches), leaving at different rounds
    ars = [speculative_generate(target, None, p, _config("ar", 20, temperature, seed=s)).tokens
           for p, s in zip(prompts, (3, 4, 5))]
    cfgs = [_config("ddtree", n, temperature, seed=s) for n, s in zip((15, 9, 12), (3, 4, 5))]
    oracles = [_oracle(a, len(p), vocab, w) for a, p, w in zip(ars, prompts, (0, 3, 4))]
    batch = speculative_generate_batch(target, oracles, prompts, cfgs)
    assert [r.tokens for r in batch] == [a[: c.max_new_tokens] for a, c in zip(ars, cfgs)]


def test_moe_routes_each_token_on_its_own(tmp_path):
    """qwen3_moe: no capacity limit or batch-level balancing at inference; a token's experts and its layer output
    are the same alone and among other rows and tokens (float64)."""
    target = load_target(make_tiny("qwen3_moe", tmp_path / "moe", seed=2), torch.float64, "cpu")
    for name in ("capacity_factor", "expert_capacity", "router_jitter_noise"):
        assert not getattr(target.config, name, None), name
    block = target.model.layers[0].mlp
    x = torch.randn(3, 5, target.config.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        together = block(x)
        _, _, experts_together = block.gate(x.reshape(-1, x.shape[-1]))
        for b in range(3):
            for t in range(5):
                alone = block(x[b : b + 1, t : t + 1])
                torch.testing.assert_close(alone[0, 0], together[b, t], rtol=0, atol=1e-12)
                _, _, experts_alone = block.gate(x[b, t : t + 1])
                assert experts_alone[0].tolist() == experts_together[b * 5 + t].tolist()
    assert len({tuple(sorted(e)) for e in experts_together.tolist()}) > 1  # tokens do route differently


# --------------------------------------------------------------------------------------------- refused targets


def test_a_plain_tree_forward_is_wrong_on_hybrids(tmp_path):
    """Why hybrids need :class:`~spiffy.models.recurrent.RecurrentMixers`: in a plain forward a linear-attention
    layer runs the tree rows as one sequence, so a sibling leaks into the recurrent state (the attention layer is
    masked) and the node is off by far more than float32 rounding; spiffy's verification of the same tree
    (branch by branch) gives the path decoded alone (``test_tree_node_logits_equal_the_path_decoded_alone``)."""
    model = load_target(make_tiny("qwen3_5", tmp_path / "hybrid", seed=0), torch.float64, "cpu")
    prompt, root, a, b = [5, 17, 42, 8], 9, 11, 12
    neg = torch.finfo(torch.float64).min
    mask = torch.triu(torch.full((7, 7), neg, dtype=torch.float64), 1)
    mask[6, 5] = neg  # node b (row 6) is a sibling of node a (row 5): it must not see it
    with torch.no_grad():
        tree = model(torch.tensor([prompt + [root, a, b]]), attention_mask=mask.view(1, 1, 7, 7),
                     position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 5]])).logits[0, -1]
        alone = model(torch.tensor([prompt + [root, b]])).logits[0, -1]
        runner = TargetRunner.for_target(model)
        ids, positions, pmask, valid, _ = prefill_inputs([prompt], runner.device, runner.dtype)
        prefill(runner, ids, positions, pmask, valid)
        tree2 = DraftTree(torch.tensor([a, b]), torch.tensor([-1, -1]), torch.tensor([1, 1]), torch.zeros(2))
        compiled, _ = compile_round([tree2], [(root, len(prompt))], valid, runner.dtype, RoundBuffers.allocate(1, 3))
        ours = runner.lm_head(verify(runner, compiled, tree_columns([tree2])))[0, 2]
    assert not torch.allclose(tree, alone, atol=1e-3)
    torch.testing.assert_close(ours, alone, rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match="tree_columns"):  # a hybrid's verification cannot run without its tree
        verify(runner, compiled)
    with pytest.raises(UnsupportedTargetError, match="layer 0 .*conv_states"):  # a cache keeping the state otherwise
        RecurrentMixers(model, SimpleNamespace(layers=[object()] * 3))


@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=0, max_size=12))
@settings(max_examples=60, deadline=None)
def test_branches_cover_every_node_once_per_leaf(seeds):
    """Random trees (node ``i``'s parent any earlier column): every branch runs from the root along parent links to
    a leaf, each leaf ends exactly one branch, and every column lies on some branch."""
    parents = [-1] + [s % (c + 1) for c, s in enumerate(seeds)]
    paths = branches(parents)
    leaves = [c for c in range(len(parents)) if c not in parents[1:]]
    assert [p[-1] for p in paths] == leaves
    for path in paths:
        assert path[0] == 0 and all(parents[x] == y for y, x in zip(path, path[1:]))
    assert set().union(*map(set, paths)) == set(range(len(parents)))


def test_a_multimodal_qwen3_5_checkpoint_is_a_target(tmp_path):
    """Qwen3.5 is published as ``Qwen3_5ForConditionalGeneration`` (a vision tower, the text model under
    ``model.language_model``): ``load_target`` verifies its text model (transformers' ``Qwen3_5ForCausalLM`` maps
    the keys and skips the tower), and spiffy's AR and DDTree equal the multimodal model's own greedy decoding."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=2, eos_token_id=299)
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    full.save_pretrained(tmp_path / "mm")
    target = load_target(tmp_path / "mm", torch.float32, "cpu")
    assert type(target).__name__ == "Qwen3_5ForCausalLM"
    prompt = [5, 17, 42, 8, 99, 23]
    ref = full.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    for method in ("ar", "ddtree", "dflash"):  # oracle drafts, wrong every third position: side branches accepted
        res = speculative_generate(target, _oracle(ref, len(prompt), 300, 3), prompt,
                                   ARSpecConfig(method=method, budget=8, max_new_tokens=12))
        assert res.tokens == ref, method


def test_an_offloaded_hybrid_equals_the_plain_load(tmp_path):
    """Qwen3.5 with its linear-attention layers offloaded to disk (accelerate's hooks wrap those modules' forward):
    the branch-by-branch calls keep the hooks, and DDTree with oracle drafts through side branches equals the plain
    load's AR."""
    path = make_tiny("qwen3_5", tmp_path / "hybrid", seed=1, num_hidden_layers=3)
    plain = load_target(path, torch.float32, "cpu")
    placed = load_target(path, torch.float32, device_map={
        "model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.layers.2": "disk",
        "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}, offload_folder=tmp_path / "off")
    assert "forward" in placed.model.layers[0].linear_attn.__dict__  # accelerate's hook
    prompt = _prompts(int(plain.config.vocab_size))[0]
    ar = speculative_generate(plain, None, prompt, _config("ar", 14, 0.0)).tokens
    res = speculative_generate(placed, _oracle(ar, len(prompt), int(plain.config.vocab_size), 3), prompt,
                               _config("ddtree", 14, 0.0))
    assert res.tokens == ar
    assert "forward" in placed.model.layers[0].linear_attn.__dict__  # given back after every planned forward


def test_unrunnable_layer_kinds_are_refused():
    with pytest.raises(UnsupportedTargetError, match="'x' model with 1 of 2 layers of kind 'mamba'"):
        check_target_config({"model_type": "x", "layer_types": ["mamba", "full_attention"]})


@pytest.mark.parametrize("model_type, fields", [
    ("gemma3_text", {}),
    ("gpt_oss", {}),
    ("mistral", {"sliding_window": 4096}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1, "num_hidden_layers": 2}),
])
def test_sliding_layers_are_refused(model_type, fields):
    config = AutoConfig.for_model(model_type, **fields)
    with pytest.raises(UnsupportedTargetError, match=f"'{model_type}'") as err:
        check_target_config(config)
    assert "\n" not in str(err.value)
    assert "sliding" in str(err.value)


def test_real_qwen3_5_is_a_target_and_unknown_architectures_are_refused(tmp_path):
    from spiffy.models.target import target_spec

    qwen35 = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 4,
                              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}}
    assert target_spec(qwen35).name == "qwen3_5"
    with pytest.raises(UnknownModelTypeError, match="'gpt2'.*supported model types: 'qwen3', 'qwen3_moe'"):
        target_spec({"model_type": "gpt2", "n_layer": 2})
    assert target_spec({"model_type": "llama", "num_hidden_layers": 2}).name == "llama"


def test_target_families_are_the_proved_ones():
    assert set(ARCHS) == {"qwen3", "qwen3_moe", "qwen2", "llama", "mistral", "qwen3_5", "qwen3_next"}


def test_target_checkpoints_load_with_strict_keys(tmp_path):
    """A per-expert MoE checkpoint (the published layout, which transformers fuses in memory) missing one expert's
    weight, or carrying a stray one, is refused by name (transformers alone would initialise it at random)."""
    from safetensors.torch import load_file, save_file

    from spiffy.errors import CheckpointError, CheckpointKeyError

    path = make_tiny("qwen3_moe", tmp_path / "moe", seed=0)
    shards = sorted(path.glob("model-*.safetensors"))
    tensors = {f: load_file(f) for f in shards}
    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert any(gone in t for t in tensors.values())  # stored per expert, as published
    for f, t in tensors.items():
        if gone in t:
            save_file({k: v for k, v in t.items() if k != gone}, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="cannot load the weights.*Error: .*gate_up_proj") as err:
        load_target(path, torch.float64, "cpu")
    assert "\n" not in str(err.value)
    for f, t in tensors.items():  # every expert back, plus a stray tensor
        extra = {"model.layers.0.extra.weight": torch.zeros(2)} if f == shards[0] else {}
        save_file({**t, **extra}, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointKeyError, match="model.layers.0.extra.weight"):
        load_model(path, dtype=torch.float64)
