"""Test oracle: a plain re-statement of ML-GSAI/LLaDA's ``generate()`` semantics (no cache, global RNG).

Written from the documented behaviour of the official script (not copied): blocks, ``steps`` split evenly over
blocks, the per-step schedule ``floor(M / steps)`` (+1 for the first ``M mod steps`` steps), float64 Gumbel
perturbation ``exp(logits) / (-log u) ** T`` drawn with ``torch.rand_like`` (nothing drawn at ``T = 0``),
``low_confidence`` (softmax of the logits in their own dtype) or ``random`` (``torch.rand((B, L))``) confidence,
``-inf`` beyond the block and on decoded rows, ``torch.topk`` per row, CFG ``un + (cfg + 1) * (cond - un)`` with
the prompt masked in the unconditional copy, ``logits_eos_inf`` and ``confidence_eos_eot_inf`` (including the
official chained assignment: EoT logit to ``-inf`` before the softmax, and at ``T = 0`` the EOS logit as well,
because the "noisy" logits are the logits themselves). Special ids are parameters instead of constants; CFG also
works without an attention mask (the official script fails there). Every random draw uses the global RNG, so
``torch.manual_seed(K)`` before the call fixes the result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gumbel_perturb(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature == 0:
        return logits
    lg = logits.to(torch.float64)
    u = torch.rand_like(lg, dtype=torch.float64)
    return lg.exp() / (-torch.log(u)) ** temperature


def schedule(block_masked: torch.Tensor, steps: int) -> torch.Tensor:
    m = block_masked.sum(dim=1, keepdim=True)
    counts = torch.zeros(m.size(0), steps, dtype=torch.int64, device=block_masked.device) + m // steps
    rem = m % steps
    for b in range(m.size(0)):
        counts[b, : int(rem[b])] += 1
    return counts


@torch.no_grad()
def reference_generate(
    model,
    prompt: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    steps: int = 128,
    gen_length: int = 128,
    block_length: int = 128,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    mask_id: int = 0,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    eos_id: int | None = None,
    eot_id: int | None = None,
    trace: list | None = None,
) -> tuple[torch.Tensor, int]:
    """Returns ``(x [B, P + gen_length], number of model calls)``; ``trace`` (a list) receives ``x`` after every
    step."""
    bsz, plen = prompt.shape
    x = torch.full((bsz, plen + gen_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :plen] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat(
            [attention_mask, torch.ones((bsz, gen_length), dtype=attention_mask.dtype, device=prompt.device)], dim=-1
        )
    prompt_index = x != mask_id
    assert gen_length % block_length == 0
    n_blocks = gen_length // block_length
    assert steps % n_blocks == 0
    per_block = steps // n_blocks
    calls = 0
    for blk in range(n_blocks):
        lo = plen + blk * block_length
        hi = lo + block_length
        counts = schedule(x[:, lo:hi] == mask_id, per_block)
        for i in range(per_block):
            masked = x == mask_id
            if cfg_scale > 0:
                uncond = x.clone()
                uncond[prompt_index] = mask_id
                am = None if attention_mask is None else torch.cat([attention_mask, attention_mask], dim=0)
                both = model(torch.cat([x, uncond], dim=0), attention_mask=am).logits
                cond_l, un_l = torch.chunk(both, 2, dim=0)
                logits = un_l + (cfg_scale + 1) * (cond_l - un_l)
            else:
                logits = model(x, attention_mask=attention_mask).logits
            calls += 1
            if logits_eos_inf:
                logits[:, :, eos_id] = -torch.inf
            noisy = gumbel_perturb(logits, temperature)
            x0 = torch.argmax(noisy, dim=-1)
            if confidence_eos_eot_inf:
                # the official line `noisy[:, :, EOS] = logits[:, :, EOT] = -inf`
                noisy[:, :, eos_id] = -torch.inf
                logits[:, :, eot_id] = -torch.inf
            if remasking == "low_confidence":
                p = F.softmax(logits, dim=-1)
                x0_p = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
            elif remasking == "random":
                x0_p = torch.rand((x0.shape[0], x0.shape[1]), device=x0.device)
            else:
                raise NotImplementedError(remasking)
            x0_p[:, hi:] = -torch.inf
            x0 = torch.where(masked, x0, x)
            conf = torch.where(masked, x0_p, torch.tensor(-torch.inf, dtype=x0_p.dtype, device=x0_p.device))
            pick = torch.zeros_like(x0, dtype=torch.bool)
            for b in range(conf.shape[0]):
                _, idx = torch.topk(conf[b], k=int(counts[b, i]))
                pick[b, idx] = True
            x[pick] = x0[pick]
            if trace is not None:
                trace.append(x.clone())
    return x, calls
