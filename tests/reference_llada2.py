"""Test oracle: a plain re-statement of LLaDA2.0's official ``LLaDA2MoeModelLM.generate`` (inclusionAI
``modeling_llada2_moe.py``), written from its documented behaviour without any of the decoder's machinery.

* ``steps = min(steps, gen_length // minimal_topk)``; the state is ``prompt + masks`` over
  ``ceil((P + gen_length) / B)`` whole blocks of ``B`` aligned at position 0;
* decoding starts at block ``P // B`` (an unaligned prompt shares that block); each block runs at most ``steps``
  iterations, stopping early when it has no mask: a forward on the whole window ``x[:, :block_end]`` under the
  block-causal mask (no K/V cache), sampling of every row of the block (``temperature == 0``: argmax of the
  softmax; else ``logits / T`` when ``T != 1``, top-k, top-p keeping the crossing token, softmax, one multinomial
  draw per row), then every masked row whose probability is ``> threshold`` when at least the step's count of
  ``get_num_transfer_tokens(B, steps)`` are, else the ``min(count, masked)`` most confident;
* after a block, stop when the EOS id occurs in ``x[P:block_end]``; the answer is ``x[P:P + gen_length]`` cut after
  its first EOS (inclusive).

The library's additions: an explicit ``generator`` (the official code draws from the global RNG). Returns the list
of answer tokens and the number of model calls.
"""

from __future__ import annotations

import torch


def _schedule(block_length: int, steps: int) -> list[int]:
    base, rem = divmod(block_length, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator):
    """``logits [L, V]`` -> (tokens ``[L]``, their probabilities ``[L]``)."""
    if temperature == 0.0:
        probs = torch.softmax(logits, dim=-1)
        tok = probs.argmax(dim=-1)
        return tok, probs.gather(-1, tok[:, None])[:, 0]
    z = logits / temperature if temperature != 1.0 else logits
    if top_k > 0:
        kth = torch.topk(z, top_k).values[..., -1:]
        z = torch.where(z < kth, torch.full_like(z, float("-inf")), z)
    if top_p < 1.0:
        vals, order = torch.sort(z, descending=True)
        cum = torch.cumsum(torch.softmax(vals, dim=-1), dim=-1)
        drop = cum > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(z, dim=-1)
    tok = torch.multinomial(probs, 1, generator=generator)
    return tok[:, 0], probs.gather(-1, tok)[:, 0]


@torch.no_grad()
def reference_generate(
    model,  # noqa: ANN001
    prompt: list[int],
    *,
    gen_length: int,
    block_length: int = 32,
    steps: int = 32,
    threshold: float = 0.95,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    minimal_topk: int = 1,
    eos_id: int | None,
    mask_id: int,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    steps = min(steps, gen_length // minimal_topk)
    p = len(prompt)
    num_blocks = -(-(p + gen_length) // block_length)
    total = num_blocks * block_length
    blk = torch.arange(total) // block_length
    visible = blk[None, :] <= blk[:, None]
    x = torch.full((1, total), mask_id, dtype=torch.long)
    x[0, :p] = torch.tensor(prompt)
    schedule = _schedule(block_length, steps)
    calls = 0
    for b in range(p // block_length, num_blocks):
        end = (b + 1) * block_length
        for step in range(steps):
            masked = x[0, end - block_length : end] == mask_id
            if not bool(masked.any()):
                break
            out = model(x[:, :end], attention_mask=visible[None, None, :end, :end], position_ids=torch.arange(end)[None])
            calls += 1
            tok, prob = _sample(out.logits[0, end - block_length : end], temperature, top_k, top_p, generator)
            conf = torch.where(masked, prob, torch.full_like(prob, float("-inf")))
            high = conf > threshold
            if int(high.sum()) >= schedule[step]:
                take = high
            else:
                take = torch.zeros_like(masked)
                take[torch.topk(conf, min(schedule[step], int(masked.sum()))).indices] = True
            x[0, end - block_length : end] = torch.where(take, tok, x[0, end - block_length : end])
        if eos_id is not None and bool((x[0, p:end] == eos_id).any()):
            break
    answer = x[0, p : p + gen_length].tolist()
    if eos_id is not None and eos_id in answer:
        answer = answer[: answer.index(eos_id) + 1]
    return answer, calls
