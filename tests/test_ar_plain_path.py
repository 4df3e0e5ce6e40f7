"""Plain AR without tree machinery: a round that drafts nothing (method ``ar``, a zero budget, a last token) runs
one ``[B, 1]`` forward of the roots (:func:`spiffy.arspec.stages.decode_inputs`) instead of building, compiling and
walking empty trees, with the very same forward inputs, so the same hidden states bit for bit and the same tokens.

Float32 and bfloat16 with SDPA (where a missing mask and an all-zero mask round differently, so the mask values are
what these tests pin down), ragged batches (left padding, holes), greedy and sampled, both acceptance rules.
"""

from __future__ import annotations

import pytest
import torch

import spiffy.arspec.batch as batch_module
from spiffy.arspec import ARSpecConfig, SamplingConfig
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.stages import (RoundBuffers, TargetRunner, commit, commit_roots, compile_round, decode_inputs,
                                  prefill, prefill_inputs, verify)
from spiffy.arspec.tree import empty_tree
from spiffy.models import load_target, make_tiny_target

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("ar_plain") / "target", seed=5, num_layers=2, with_tokenizer=False)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(7,), (3, 9, 5)])
def test_decode_inputs_equal_the_compiled_empty_trees(target_dir, dtype, lengths):
    """Same ids, positions and mask as compile_round on empty trees, so the same hidden states bit for bit, round
    after round (the commit of the root alone equals commit's)."""
    target = load_target(target_dir, dtype, "cpu")
    prompts = _prompts(len(lengths), lengths)
    runners = [TargetRunner.for_target(target) for _ in range(2)]
    states = []
    with torch.inference_mode():
        for runner in runners:
            ids, pos, mask, valid, _pads = prefill_inputs(prompts, runner.device, runner.dtype)
            first = prefill(runner, ids, pos, mask)
            states.append([valid, first.argmax(dim=-1).tolist()])
        for step in range(4):
            roots = [(tok, len(p) + step) for tok, p in zip(states[0][1], prompts)]
            fast = decode_inputs(runners[0], roots, states[0][0])
            tree, _rows = compile_round([empty_tree()] * len(prompts), roots, states[1][0], runners[1].dtype,
                                        RoundBuffers.allocate(len(prompts), 1))
            assert torch.equal(fast.input_ids, tree.input_ids) and torch.equal(fast.position_ids, tree.position_ids)
            assert torch.equal(fast.attention_mask, tree.attention_mask)
            hidden = [verify(runners[0], fast), verify(runners[1], tree)]
            assert torch.equal(hidden[0], hidden[1])
            context = runners[1].context_len - 1
            states[0][0] = commit_roots(runners[0], states[0][0])
            states[1][0] = commit(runners[1], states[1][0], context, [[0]] * len(prompts))
            assert torch.equal(states[0][0], states[1][0])
            tokens = runners[0].lm_head(hidden[0][:, 0]).argmax(dim=-1).tolist()
            states[0][1] = states[1][1] = tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampling,accept", [((0.0, 0), "coupled"), ((0.9, 20), "coupled"), ((0.9, 0), "rejection")])
def test_plain_ar_equals_the_tree_path(target_dir, monkeypatch, dtype, sampling, accept):
    """Plain AR through the decode path gives the tokens the tree stages give (the decode path switched off), for
    a batch of ragged prompts and each prompt alone, and never calls the tree stages."""
    target = load_target(target_dir, dtype, "cpu")
    prompts = _prompts(7, (4, 11, 2))
    temperature, top_k = sampling
    config = ARSpecConfig(method="ar", max_new_tokens=12, accept=accept,
                          sampling=SamplingConfig(temperature=temperature, top_k=top_k, seed=9))

    def run() -> list[list[int]]:
        return [r.tokens for r in speculative_generate_batch(target, None, prompts, config)] + \
            [speculative_generate_batch(target, None, [p], config)[0].tokens for p in prompts]

    def refuse(*args, **kwargs):
        raise AssertionError("a plain AR round reached the tree stages")

    with monkeypatch.context() as m:
        for name in ("draft", "build_trees", "compile_round", "commit"):
            m.setattr(batch_module, name, refuse)
        fast = run()
    monkeypatch.setattr(batch_module, "_plain_round", lambda depths: False)
    assert fast == run()
    assert all(len(tokens) == 12 for tokens in fast)
