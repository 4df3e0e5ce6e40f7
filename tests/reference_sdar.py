"""Test oracle: a plain re-statement of SDAR's official ``block_diffusion_generate`` (JetAstra/SDAR generate.py).

Written from the documented behaviour, without any of the decoder's machinery (no sessions, no fused commits,
no cache cropping, no broadcasting). Semantics restated:

* the sequence is ``prompt + masks`` padded up to a whole number of blocks:
  ``num_blocks = ceil((P + gen_length) / B)``, ``T = num_blocks * B``; blocks are aligned to absolute positions,
  so an unaligned prompt shares its last block with the first generated positions;
* the ``P // B`` whole prompt blocks are prefilled in one forward with ``store_kv=True``;
* every later block runs ``denoising_steps + 1`` iterations: when no mask is left, one commit forward
  (``store_kv=True``) and the block ends; otherwise a denoising forward on the block rows (``store_kv=False``),
  sampling (``logits / T`` when ``T != 1``, top-k, top-p, softmax, one multinomial draw for every row of the block)
  and a transfer rule with the per-step count ``get_num_transfer_tokens(B, denoising_steps)``;
* strategies ``sequential`` / ``low_confidence_static`` / ``low_confidence_dynamic`` (strict ``> threshold``,
  falling back to top-k of the schedule's count) and ``entropy_bounded`` (JetEngine's rule: masked positions by
  ascending entropy of the sampling distribution, the longest prefix whose cumulative entropy stays below
  ``eb_threshold``; here at least the schedule's count, so the block finishes within ``denoising_steps``);
* after each block, stop when any ``stopping_criteria_idx`` occurs in ``x[:, P:]``.

Additions the official script lacks (the library defines them the same way): ``temperature == 0`` is greedy
(argmax; confidences from ``softmax`` of the top-k/top-p filtered logits at temperature 1), an explicit
``generator``, ``use_cache=False`` (every forward recomputes rows ``[0, block_end)`` under the block-causal mask
instead of reading K/V), a block left with masks after its ``denoising_steps`` steps (only when a sampled token is
the mask id itself, which keeps its row masked; the official loop then fails with an IndexError on the schedule)
keeps the mask ids and is committed as it is, and
``clamp_transfer`` (True: a step never transfers more positions than are still masked;
False: the official ``torch.topk`` over the whole block, which may also pick already-decoded positions).

Returns the final ``x`` ``[1, T]`` and the number of model calls made.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _logits_of(out) -> torch.Tensor:  # noqa: ANN001
    return out.logits if hasattr(out, "logits") else out[0]


def _block_causal(num_blocks: int, block_length: int, device) -> torch.Tensor:  # noqa: ANN001
    """``[T, T]`` bool: row i sees column j iff block(j) <= block(i)."""
    blk = torch.arange(num_blocks * block_length, device=device) // block_length
    return blk[None, :] <= blk[:, None]


def _filter_logits(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(z, min(top_k, z.shape[-1])).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        vals, order = torch.sort(z, descending=True)
        cum = torch.cumsum(torch.softmax(vals, dim=-1), dim=-1)
        drop_sorted = torch.zeros_like(cum, dtype=torch.bool)
        drop_sorted[..., 1:] = cum[..., :-1] > top_p  # keep the first token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator):  # noqa: ANN001
    """logits ``[1, L, V]`` -> tokens ``[1, L]``, their probabilities ``[1, L]`` and the distribution ``[1, L, V]``."""
    shape = logits.shape[:-1]
    z = logits.reshape(-1, logits.shape[-1])
    if temperature == 0:
        probs = torch.softmax(_filter_logits(z, top_k, top_p), dim=-1)
        tok = torch.argmax(z, dim=-1, keepdim=True)
    else:
        if temperature != 1.0:
            z = z / temperature
        probs = torch.softmax(_filter_logits(z, top_k, top_p), dim=-1)
        tok = torch.multinomial(probs, 1, generator=generator)
    p = torch.gather(probs, -1, tok)
    return tok.view(shape), p.view(shape), probs.view(*shape, -1)


def _schedule(block_length: int, steps: int) -> list[int]:
    return [block_length // steps + (1 if i < block_length % steps else 0) for i in range(steps)]


@torch.no_grad()
def reference_block_diffusion_generate(
    model,  # noqa: ANN001
    prompt,  # noqa: ANN001 - dict with "input_ids" or a [1, P] tensor
    mask_id: int,
    gen_length: int = 128,
    block_length: int = 8,
    denoising_steps: int = 8,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    remasking_strategy: str = "low_confidence_dynamic",
    confidence_threshold: float = 0.85,
    eb_threshold: float = 0.35,
    stopping_criteria_idx=None,  # noqa: ANN001
    *,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    clamp_transfer: bool = True,
) -> tuple[torch.Tensor, int]:
    """Oracle decode. ``x``: ``[1, ceil((P + gen_length) / B) * B]``; second value: model calls made."""
    from spiffy.models.cache import KVCache

    model.eval()
    input_ids = prompt["input_ids"] if isinstance(prompt, dict) else prompt
    device = input_ids.device
    P = int(input_ids.shape[1])
    B = int(block_length)
    nb = math.ceil((P + gen_length) / B)
    T = nb * B
    full_mask = _block_causal(nb, B, device)
    pos = torch.arange(T, device=device)[None, :]
    x = torch.full((1, T), mask_id, dtype=torch.long, device=device)
    x[:, :P] = input_ids
    first_block = P // B
    calls = 0
    cache = KVCache(model.config.num_hidden_layers) if use_cache else None

    def run(q0: int, q1: int, rows: torch.Tensor, store: bool) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if use_cache:
            k0 = cache.get_seq_length()  # type: ignore[union-attr]
            mask = full_mask[q0:q1, :q1][None, None]
            assert k0 == q0, "oracle cache out of step"
            out = model(rows, attention_mask=mask, position_ids=pos[:, q0:q1], past_key_values=cache,
                        use_cache=True, store_kv=store)
            return _logits_of(out)
        # no cache: recompute every row up to q1 under the block-causal mask, keep the query rows
        seq = torch.cat([x[:, :q0], rows], dim=1)
        out = model(seq, attention_mask=full_mask[:q1, :q1][None, None], position_ids=pos[:, :q1])
        return _logits_of(out)[:, q0:q1]

    if first_block > 0 and use_cache:
        run(0, first_block * B, x[:, : first_block * B], True)
    elif first_block > 0:
        calls += 1  # the prefill call the cached reference makes

    sched = _schedule(B, denoising_steps)
    for blk in range(first_block, nb):
        s, e = blk * B, (blk + 1) * B
        cur = x[:, s:e].clone()
        for step in range(denoising_steps + 1):  # the reference's loop
            masked = cur == mask_id
            if not bool(masked.any()) or step == denoising_steps:  # the latter: see the note on sampled mask ids
                if use_cache:
                    run(s, e, cur, True)
                else:
                    calls += 1  # the commit call the cached reference makes
                break
            logits = run(s, e, cur, False)
            x0, x0_p, probs = _sample(logits, temperature, top_k, top_p, generator)
            k = sched[step]
            transfer = torch.zeros_like(masked)
            for r in range(cur.shape[0]):
                m = masked[r]
                n = int(m.sum())
                kk = min(k, n) if clamp_transfer else k
                if remasking_strategy == "sequential":
                    first = int(m.nonzero()[0, 0])
                    if clamp_transfer:
                        transfer[r, m.nonzero()[:kk, 0]] = True
                    else:
                        transfer[r, first : first + k] = True
                elif remasking_strategy in ("low_confidence_static", "low_confidence_dynamic"):
                    conf = torch.where(m, x0_p[r], -torch.inf)
                    if remasking_strategy == "low_confidence_dynamic":
                        high = conf > confidence_threshold
                        if int(high.sum()) >= kk:
                            transfer[r] = high
                            continue
                    transfer[r, torch.topk(conf, kk).indices] = True
                elif remasking_strategy == "entropy_bounded":
                    pr = probs[r].clamp_min(1e-12)
                    ent = torch.where(m, -(pr * pr.log()).sum(-1), torch.inf)
                    vals, order = torch.sort(ent, stable=True)
                    csum = torch.cumsum(vals, dim=0)
                    c = int(torch.searchsorted(csum, csum.new_tensor([eb_threshold]), right=False)[0])
                    c = min(max(c, min(k, n), 1), n)
                    transfer[r, order[:c]] = True
                else:
                    raise ValueError(f"unknown remasking strategy {remasking_strategy!r}")
            cur[transfer] = x0[transfer]
        x[:, s:e] = cur
        if stopping_criteria_idx is not None and any(bool((x[:, P:] == t).any()) for t in stopping_criteria_idx):
            break
    return x, calls
