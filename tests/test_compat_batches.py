"""The familiar wrappers reproduce the official generators on seeded, left-padded batches at T > 0 (issue 29,
item 5).

ML-GSAI/LLaDA ``generate`` and Dream's ``diffusion_generate`` draw each step's noise for the whole batch from one
generator (the global one): LLaDA ``torch.rand_like(logits)`` over ``[B, L, V]`` (and ``torch.rand((B, L))`` for
``random`` remasking), Dream ``torch.rand`` over the batch's masked positions (``origin``) and one categorical draw
per masked position of the flattened batch. The oracles (``reference_llada.reference_generate``,
``test_decoding_dream.dream_reference``) restate that order; ``llada_generate`` / ``dream_diffusion_generate`` on a
batch must give their tokens after ``torch.manual_seed(K)`` and with ``seed=K``. :func:`spiffy.generate` keeps one
generator per row (row ``r`` equals prompt ``r`` alone), which is another stream: the tests check that it differs,
so a wrapper falling back to it fails here. With a graph on a batch, a rule that draws random numbers cannot follow
the shared generator (rows accept drafts at different steps) and is refused; a rule without draws runs batched
Spiffy and equals the official output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_f64
from reference_llada import reference_generate
from test_decoding_dream import dream_reference

from spiffy.api import generate
from spiffy.compat import dream_diffusion_generate, llada_generate
from spiffy.errors import ConfigError
from spiffy.models.loading import load_tokenizer
from spiffy.selfspec.oracle import random_graph

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

SEED = 5


def _padded(model, tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    pad = model.config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    am = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, am


@pytest.fixture(scope="module")
def llada(tiny_llada: Path):
    model = load_f64(tiny_llada, cached=True)
    return model, *_padded(model, load_tokenizer(tiny_llada), ["x = 1", "def add(a, b):\n    return"])


@pytest.fixture(scope="module")
def dream(tiny_dream: Path):
    model = load_f64(tiny_dream, cached=True)
    return model, *_padded(model, load_tokenizer(tiny_dream), ["x = 2", "import os\nprint("])


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_llada_wrapper_reproduces_the_official_batch(llada, remasking: str) -> None:
    model, ids, am = llada
    kw = dict(steps=8, gen_length=8, block_length=4, temperature=0.7, remasking=remasking)
    torch.manual_seed(SEED)
    ref, _ = reference_generate(model, ids, attention_mask=am, mask_id=model.config.mask_token_id, **kw)
    torch.manual_seed(SEED)
    assert torch.equal(llada_generate(model, ids, attention_mask=am, **kw), ref)
    assert torch.equal(llada_generate(model, ids, attention_mask=am, seed=SEED, **kw), ref)
    # per-row generators (spiffy.generate) are another stream: the comparison above can fail
    rows = generate(model, ids, attention_mask=am, seeds=[SEED, SEED], **kw)
    assert not torch.equal(rows.sequences, ref)


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "entropy"])
def test_dream_wrapper_reproduces_the_official_batch(dream, alg: str) -> None:
    model, ids, am = dream
    kw = dict(steps=8, alg=alg, temperature=0.9, top_p=0.95)
    torch.manual_seed(SEED)
    ref = dream_reference(model, ids, model.config.mask_token_id, gen_length=8, attention_mask=am, **kw)
    torch.manual_seed(SEED)
    out = dream_diffusion_generate(model, ids, attention_mask=am, max_new_tokens=8, **kw)
    assert torch.equal(out, ref)
    again = dream_diffusion_generate(model, ids, attention_mask=am, max_new_tokens=8, seed=SEED, **kw)
    assert torch.equal(again, ref)
    history = dream_diffusion_generate(model, ids, attention_mask=am, max_new_tokens=8, seed=SEED,
                                       output_history=True, return_dict_in_generate=True, **kw)
    assert torch.equal(history.sequences, ref) and len(history.history) == 8
    assert history.history[-1].shape == ref.shape


def test_a_graph_on_a_batch_with_random_draws_is_refused(llada, dream) -> None:
    graph = random_graph(levels=2, nodes=4, seed=0, i_max=4, j_max=2)
    model, ids, am = llada
    with pytest.raises(ConfigError, match="one generator.*fix"):
        llada_generate(model, ids, attention_mask=am, steps=8, gen_length=8, block_length=4, temperature=0.7,
                       graph=graph)
    with pytest.raises(ConfigError, match="one generator"):
        llada_generate(model, ids, attention_mask=am, steps=8, gen_length=8, block_length=4, remasking="random",
                       graph=graph)
    model, ids, am = dream
    with pytest.raises(ConfigError, match="one generator"):
        dream_diffusion_generate(model, ids, attention_mask=am, max_new_tokens=8, steps=8, alg="origin", graph=graph)


def test_a_graph_on_a_batch_without_draws_equals_the_official_batch(llada) -> None:
    model, ids, am = llada
    kw = dict(steps=8, gen_length=8, block_length=4)
    ref, calls = reference_generate(model, ids, attention_mask=am, mask_id=model.config.mask_token_id, **kw)
    res = llada_generate(model, ids, attention_mask=am, graph=random_graph(levels=2, nodes=4, seed=0, i_max=4,
                                                                            j_max=2), budget=2, return_result=True,
                         **kw)
    assert torch.equal(res.sequences, ref)
