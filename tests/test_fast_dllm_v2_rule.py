"""Fast-dLLM v2's rule as one program over rows (spiffy.decoding.fast_dllm_v2_rule) against the official rule restated
row by row on the host (tests/reference_fast_dllm_v2.py).

The official-code fixtures of tests/test_fast_dllm_v2.py skip on a CPU of another kind than the one that recorded
them, so this oracle is what pins the rule everywhere: on random states (ragged rows, masks and stop ids anywhere in
the block, stop ids in the prompts too, stopped rows, every sub-block size), random logits (float32, float64,
bfloat16; peaked enough that several positions pass the threshold) and seeded draws, every step, head, block-end
test and stop equals the reference, and the generator is left in the same state (the same draws, row by row).
"""

from __future__ import annotations

import random

import pytest
import torch

from batch_cases import fast_dllm_v2, left_pad  # noqa: F401 - fixtures
from reference_fast_dllm_v2 import reference_head, reference_step, reference_stop_hit
from spiffy.decoding import make_session

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

VOCAB = 20  # the rule never reads the vocabulary size: small logits keep the distributions peaked


def _session(model, rng: random.Random, seed: int):
    lengths = [rng.choice([1, 3, 5, 8, 9, 13, 16]) for _ in range(rng.choice([1, 2, 3]))]
    g = torch.Generator().manual_seed(seed)
    ids, am = left_pad([torch.randint(5, 30, (n,), generator=g) for n in lengths])  # stop ids 7, 9 among them
    return make_session(model, ids, attention_mask=am, gen_length=16, block_length=8,
                        small_block_size=rng.choice([1, 2, 4, 8]), threshold=rng.choice([0.05, 0.3, 0.6, 0.9, 1.0]),
                        temperature=rng.choice([0.0, 0.0, 0.7, 1.0]), top_p=rng.choice([0.5, 0.9, 1.0]),
                        stop_token_ids=rng.choice([(), (7,), (7, 9)]), seed=seed)


def _random_block(session, block: int, rng: random.Random) -> torch.Tensor:
    """``session.x`` with the generated columns of ``block`` masked or holding tokens 5..12 (stop ids 7, 9 among
    them), half and half."""
    x = session.x.clone()
    s, e = session.block_bounds(block)
    for r, gen_start in enumerate(session.gen_starts):
        for col in range(max(s, gen_start), e):
            x[r, col] = session.mask_id if rng.random() < 0.5 else rng.randint(5, 12)
    return x


@pytest.mark.parametrize("chunk", range(4))
def test_rule_equals_the_row_by_row_reference(fast_dllm_v2, chunk: int) -> None:
    for seed in range(chunk * 60, (chunk + 1) * 60):
        rng = random.Random(seed)
        session = _session(fast_dllm_v2, rng, seed)
        g = torch.Generator().manual_seed(seed)
        dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
        for block in range(int(session.num_blocks) - 1):  # the last block holds only the final head
            session.begin_block_rule(block)
            b = int(session.x.shape[0])
            session.row_stopped = [rng.random() < 0.2 for _ in range(b)]
            session.stopped = all(session.row_stopped)
            stopped = list(session.row_stopped)
            x = _random_block(session, block, rng)
            s, e = session.block_bounds(block)
            where = (seed, block, dtype)
            # a denoising step: the same tokens, and the same draws (the generators end in the same state)
            logits = (torch.randn(b, e - s, VOCAB, generator=g, dtype=torch.float64) * rng.uniform(0.5, 4)).to(dtype)
            session.generator = torch.Generator().manual_seed(seed)
            out = session.transition(x, logits, session.step_info(block, 1))
            ref_gen = torch.Generator().manual_seed(seed)
            ref = x.clone()
            hits = [reference_stop_hit(x[r], s, e, session.gen_starts[r], session.mask_id, session.stop_ids)
                    for r in range(b)]
            for r in range(b):
                if not stopped[r] and not hits[r]:
                    ref[r] = reference_step(x[r], logits[r], s, e, session.mask_id, session.small_block,
                                            session.threshold, session.temperature, session.top_p, ref_gen)
            assert torch.equal(out, ref), where
            assert torch.equal(session.generator.get_state(), ref_gen.get_state()), where
            # the head: the commit's argmax where the row has one, is masked there and still generates
            head_logits = torch.randn(b, 1, VOCAB, generator=g, dtype=torch.float64).to(dtype)
            out = session.transition(x, head_logits, session.step_info(block, 0))
            for r in range(b):
                if not stopped[r] and session.heads[r][block]:
                    ref[r] = reference_head(x[r], head_logits[r, 0], s, session.mask_id)
                else:
                    ref[r] = x[r]
            assert torch.equal(out, ref), where
            # the block ends once every row still generating has no mask left in it or reached a stop
            has_mask = [bool((x[r, s:e] == session.mask_id).any()) for r in range(b)]
            finished = all(stopped[r] or not has_mask[r] or hits[r] for r in range(b))
            assert session.block_finished(block, 1, x) == finished, where
            session.x = x
            session.end_block(block)
            assert session.row_stopped == [a or h for a, h in zip(stopped, hits)], where
            assert session._live.tolist() == [not a for a in session.row_stopped], where  # its device mirror
            assert session.stopped == all(session.row_stopped), where
