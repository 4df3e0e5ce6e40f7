"""The MoE dLLM families' experts run grouped on the static path (spiffy.models.moe_dispatch): no host read, so a CUDA
graph can hold an MoE forward, and bit for bit what the per-expert (official) grouping computes.

On a CPU ``torch._grouped_mm`` computes each expert's group as the matrix product of exactly those rows, so the
grouped path must equal the per-expert one bitwise in float32 and bfloat16 (float64, which ``torch._grouped_mm``
does not take, stays per expert): at the block, at the static forward against the eager one, and in generated
tokens (LLaDA-MoE, SDAR-MoE, LLaDA2.0).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_cases import static_forward_pairs
from spiffy.api import generate
from spiffy.bench.syncs import SyncCounter
from spiffy.decoding import make_session
from spiffy.models.loading import load_model
from spiffy.models.moe_dispatch import (capture_unsupported, grouped_experts, grouped_unsupported, run_experts,
                                        stack_experts, sum_by_expert)
from spiffy.selfspec.freedave import freedave_graph

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

FAMILIES = ("llada_moe", "sdar_moe", "llada2")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
GEN, BLOCK = 16, 8


@pytest.fixture(scope="module")
def moe_models(request):
    """``{(family, dtype name): model}``: the tiny MoE checkpoints in float32 and bfloat16, experts stacked."""
    out = {}
    for family in FAMILIES:
        path = request.getfixturevalue(f"tiny_{family}")
        for name, dtype in DTYPES.items():
            model = load_model(path, dtype=dtype)
            stack_experts(model)
            out[family, name] = model
    return out


def _blocks(model):
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.ModuleList)]


def _kw(cache: str) -> dict:
    return dict(gen_length=GEN, block_length=BLOCK, steps=GEN // 2, cache=cache, temperature=0.0, seed=0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(FAMILIES), dtype=st.sampled_from(sorted(DTYPES)), tokens=st.integers(1, 40),
       seed=st.integers(0, 10_000))
def test_grouped_blocks_equal_per_expert(moe_models, family: str, dtype: str, tokens: int, seed: int) -> None:
    """Every MoE block's output, grouped == per expert, bit for bit, for random token counts (1 token: mostly
    one-row groups; 40: every expert several rows) and inputs; the pair outputs too."""
    model = moe_models[family, dtype]
    g = torch.Generator().manual_seed(seed)
    for block in _blocks(model):
        hidden = block.experts[0].gate_proj.weight.shape[1]
        x = (torch.randn(1, tokens, hidden, generator=g) * 2).to(DTYPES[dtype])
        with torch.no_grad():
            per_expert = block(x)
            with grouped_experts():
                grouped = block(x)
        assert torch.equal(per_expert, grouped), (family, dtype, tokens)


def test_pair_outputs_keep_each_familys_row_order(moe_models) -> None:
    """run_experts' two orders give every (token, slot) its own expert's output (checked against each expert called
    on its token alone, within rounding) in both modes, and an unknown order is refused."""
    model = moe_models["llada2", "f32"]
    block = _blocks(model)[0]
    h = torch.randn(9, block.experts[0].gate_proj.weight.shape[1], generator=torch.Generator().manual_seed(1))
    chosen = torch.stack([torch.randperm(len(block.experts), generator=torch.Generator().manual_seed(i))[:2]
                          for i in range(9)])
    act = block.experts[0].act_fn
    with torch.no_grad():
        alone = torch.stack([torch.stack([block.experts[int(e)](h[t : t + 1])[0] for e in chosen[t]])
                             for t in range(9)])
        for order in ("slot", "token"):
            for grouped in (False, True):
                with grouped_experts(grouped):
                    pairs = run_experts(h, chosen, block.experts, act, order)
                assert pairs.shape == (9, 2, h.shape[1])
                torch.testing.assert_close(pairs, alone, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pair_order"):
        run_experts(h, chosen, block.experts, act, "expert")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_by_expert_is_the_official_index_add(dtype: torch.dtype) -> None:
    """Each token's contributions added in increasing expert index, one rounding per addition: the bits of the
    official per-expert ``index_add_`` loop (bfloat16 makes any other order visible)."""
    g = torch.Generator().manual_seed(0)
    n, k, experts, hidden = 50, 4, 16, 24
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    contributions = (torch.randn(n, k, hidden, generator=g) * 100).to(dtype)
    official = torch.zeros(n, hidden, dtype=dtype)
    for e in range(experts):
        token, slot = torch.where(chosen == e)
        official.index_add_(0, token, contributions[token, slot])
    assert torch.equal(sum_by_expert(contributions, chosen), official)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_static_forward_equals_eager_on_moe(moe_models, family: str, dtype: str) -> None:
    """The static forward (grouped experts) over 3 states equals the eager one (per expert) bit for bit, and Spiffy
    on FreeDave's chain decodes the same tokens with compile=True as without."""
    model = moe_models[family, dtype]
    prompt = torch.randint(5, 250, (5,), generator=torch.Generator().manual_seed(3))
    for block, (a, b) in enumerate(static_forward_pairs(model, prompt, _kw("prefix"), seed=4)):
        assert torch.equal(a, b), (family, dtype, block)
    kw = _kw("prefix")
    graph = freedave_graph(model, make_session(model, prompt[None], **kw).config, 3)
    runs = [generate(model, prompt[None], graph=graph, budget=len(graph), compile=c, **kw) for c in (False, True)]
    assert runs[0].tokens == runs[1].tokens and runs[0].nfe == runs[1].nfe


@pytest.mark.parametrize("family", FAMILIES)
def test_static_moe_forward_makes_no_host_sync(moe_models, family: str) -> None:
    """A built bucket's MoE forward asks the host for nothing (a CUDA graph can hold it); the eager forward reads
    the chosen experts (the per-expert grouping), which is what the counter would see if grouping were off."""
    model = moe_models[family, "f32"]
    counts = {}
    for mode in ("eager", "static"):
        s = make_session(model, torch.tensor([[5, 6, 7, 8]]), **_kw("prefix"))
        if mode == "static":
            s.use_static()
        s.begin_block(0)
        states = s.x.repeat(3, 1)
        s.forward_states(states)  # builds the bucket
        with SyncCounter() as counter:
            s.forward_states(states)
        counts[mode] = {k: v for k, v in counter.counts.items() if k != "to_cpu"}
    assert counts["static"] == {}, counts
    assert counts["eager"].get("tolist", 0) >= 1, counts


def test_stacking_keeps_names_values_and_restacks_replaced_weights(tiny_sdar_moe) -> None:
    """Stacking re-points each expert's weights into one tensor per projection: same parameter names and values,
    one storage; a weight replaced afterwards (a new load) is stacked again before the next grouped call."""
    model = load_model(tiny_sdar_moe, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stack_experts(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    experts = _blocks(model)[0].experts
    storages = {e.gate_proj.weight.untyped_storage().data_ptr() for e in experts}
    assert len(storages) == 1
    experts[2].gate_proj.weight = torch.nn.Parameter(experts[2].gate_proj.weight.detach() * 2)
    h = torch.randn(6, experts[0].gate_proj.weight.shape[1])
    chosen = torch.tensor([[2, 0]] * 6)
    with grouped_experts():
        grouped = run_experts(h, chosen, experts, torch.nn.functional.silu, "slot")
    assert torch.equal(grouped, run_experts(h, chosen, experts, torch.nn.functional.silu, "slot"))
    assert len({e.gate_proj.weight.untyped_storage().data_ptr() for e in experts}) == 1


def test_what_cannot_run_grouped_is_named(tiny_llada_moe) -> None:
    """float64 (not taken by torch._grouped_mm) and quantized projections run per expert; the reason names them."""
    f64 = load_model(tiny_llada_moe, dtype=torch.float64)
    assert "float64" in capture_unsupported(f64)
    bf16 = load_model(tiny_llada_moe, dtype=torch.bfloat16)
    assert capture_unsupported(bf16) is None
    experts = _blocks(bf16)[0].experts
    experts[1].up_proj = torch.nn.Identity()
    assert "up_proj" in grouped_unsupported(experts)
