"""Train a dLLM drafter (SDAR layout) for a frozen Qwen3 target: DEER's D2A stages and SpecDiff-2's streak
distillation (``spiffy train-drafter --recipe d2a-stage1|d2a-stage2|streak``).

Layout (the one :class:`spiffy.arspec.DLLMDrafter` drafts with): a sequence the target generated is fed once as
clean rows with causal attention (the committed prefix), followed by ``N`` blocks. A block anchored at position
``a`` is ``[x_a, MASK ...]`` at positions ``a, a + 1, ...``; it sees the clean rows ``< a`` and itself
(bidirectionally), never another block. Slot ``k`` predicts ``x_{a+k}``: from its own row (unshifted, SDAR's
convention) or, for a shifted drafter, from row ``k - 1`` (Dream's convention, kept by a drafter initialised from
the AR target: its root row then starts out as the target's own next-token prediction).

Recipes (re-implemented from the papers' descriptions):

* ``d2a-stage1`` (DEER, continuation distillation): the target's continuation after a random truncation point is
  denoised: each block slot ``k >= 1`` is masked with probability ``t ~ U(0, 1]`` (one ``t`` per block); the loss is
  the cross entropy on masked slots scaled by ``1 / (t L)`` (``L = B - 1``): the masked-diffusion ELBO of the
  continuation given the clean prefix.
* ``d2a-stage2`` (DEER, scribe refinement): only the last ``R ~ U(1, R_max)`` tokens of a truncated answer are
  masked, i.e. the block is ``[x_a, MASK x R]`` (all masked, as at drafting time) and masked slot ``i = 1..R`` has
  weight ``alpha^(R - i)`` (normalised), so ``alpha > 1`` stresses the first drafted positions, whose rejection
  ends an accepted run. The paper reports ``alpha = 1.05`` diverging; the default here is 1.01.
* ``streak`` (SpecDiff-2, streak distillation): maximise the expected accepted streak
  ``sum_j prod_{i <= j} beta_i`` with ``beta_i = sum_v min(p_i(v), q_i(v))``, the probability that speculative
  sampling accepts the drafter's position-``i`` marginal ``q_i`` against the target's ``p_i`` (teacher-forced on
  the target's own continuation). A small cross-entropy term (``--streak-ce``) keeps early training stable.

Data: corpus windows (Python standard library, :mod:`spiffy.train.corpus`) continued by the target itself
(:func:`spiffy.train.drafter.target_continue`). Initialisation: ``--init DIR`` (a dLLM checkpoint sharing the
target's vocabulary, e.g. an SDAR model adapted from the target) or ``--init target`` (an SDAR model holding the
target's own weights: same Qwen3 layout). Resumable (``--resume``), progress bar, ``MODEL_CARD.md`` with the
held-out acceptance (``tau`` of DEER decoding with the target, greedy, on held-out prompts).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F

from spiffy.arspec import ARSpecConfig, DLLMDrafter, speculative_generate
from spiffy.arspec.methods import DEER
from spiffy.errors import CheckpointError, ConfigError
from spiffy.models.ar_drafters import check_dllm_compatible, load_ar_drafter
from spiffy.models.loading import load_model, save_checkpoint
from spiffy.models.sdar import SDARConfig, SDARForCausalLM
from spiffy.train import common
from spiffy.train.arguments import RECIPES
from spiffy.train.arguments import add_d2a_arguments as add_arguments
from spiffy.torch_utils import model_dtype
from spiffy.train.drafter import corpus_streams, sample_anchors, start_run, target_continue

__all__ = ["RECIPES", "add_arguments", "dllm_block_inputs", "recipe_loss", "sdar_from_target", "train"]



def sdar_from_target(target: torch.nn.Module, mask_token_id: int, block_size: int, shifted: bool = True,
                     num_layers: int | None = None) -> SDARForCausalLM:
    """An SDAR model holding a copy of the Qwen3 ``target``'s weights (the parameter names are the same), in the
    target's dtype; ``shifted`` (default) keeps the AR reading (row ``i - 1`` predicts token ``i``);
    ``num_layers`` keeps only the first layers (with the embedding, final norm and head): a cheaper drafter."""
    t = target.config
    depth = int(t.num_hidden_layers) if num_layers is None else int(num_layers)
    if not 1 <= depth <= int(t.num_hidden_layers):
        raise ConfigError(f"--init-layers must be in 1..{t.num_hidden_layers}, got {num_layers}")
    rope = getattr(t, "rope_parameters", None) or {}
    cfg = SDARConfig(
        vocab_size=int(t.vocab_size), hidden_size=int(t.hidden_size), intermediate_size=int(t.intermediate_size),
        num_hidden_layers=depth, num_attention_heads=int(t.num_attention_heads),
        num_key_value_heads=int(t.num_key_value_heads),
        head_dim=int(getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads),
        max_position_embeddings=int(t.max_position_embeddings), rms_norm_eps=float(t.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", getattr(t, "rope_theta", 1e6))),
        tie_word_embeddings=bool(getattr(t, "tie_word_embeddings", False)),
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id,
        max_window_layers=depth, mask_token_id=int(mask_token_id),
    )
    cfg.drafter_config = {"kind": "dllm", "block_size": int(block_size), "mask_token_id": int(mask_token_id),
                          "layout": "root", "shifted": bool(shifted)}
    model = SDARForCausalLM(cfg).to(model_dtype(target) or torch.float32)
    state = {k: v.detach().clone() for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < depth}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the tied head is the embedding
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise CheckpointError(f"cannot copy the target into SDAR: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    return model


def dllm_block_inputs(seqs: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int) -> dict[str, torch.Tensor]:
    """Inputs of one training forward: clean rows (causal) + ``N`` blocks per sequence.

    Args: ``seqs [B, S]``, ``anchors [B, N]`` (each ``anchor + block <= S``).
    Returns: ``ids [B, S + N*block]`` (blocks fully masked after slot 0), ``positions`` (same shape), ``mask
    [B, 1, S + N*block, S + N*block]`` bool (True = visible), ``labels [B, N, block]``.
    """
    b, s = seqs.shape
    n = anchors.shape[1]
    idx = anchors[:, :, None] + torch.arange(block)  # [B, N, block]
    labels = torch.gather(seqs[:, None, :].expand(b, n, s), 2, idx)
    blocks = torch.full((b, n, block), mask_id, dtype=torch.long)
    blocks[:, :, 0] = labels[:, :, 0]
    ids = torch.cat([seqs, blocks.reshape(b, n * block)], dim=1)
    positions = torch.cat([torch.arange(s).expand(b, s), idx.reshape(b, n * block)], dim=1)
    total = s + n * block
    mask = torch.zeros(b, total, total, dtype=torch.bool)
    mask[:, :s, :s] = torch.tril(torch.ones(s, s, dtype=torch.bool))
    q_anchor = anchors.repeat_interleave(block, dim=1)  # [B, N*block]
    mask[:, s:, :s] = torch.arange(s)[None, None, :] < q_anchor[:, :, None]
    q_blk = torch.arange(n * block) // block
    mask[:, s:, s:] = (q_blk[:, None] == q_blk[None, :])[None]
    return {"ids": ids, "positions": positions, "mask": mask[:, None], "labels": labels}


def _slot_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor], s: int, n: int, block: int,
                 shifted: bool = False) -> torch.Tensor:
    """``[B, N, block, V]``: the logits predicting each block slot (slot 0 of a shifted drafter: zeros, unused)."""
    out = model(inputs["ids"], attention_mask=inputs["mask"], position_ids=inputs["positions"])
    logits = out.logits[:, s:].float()
    logits = logits.view(logits.shape[0], n, block, -1)
    if shifted:
        logits = torch.cat([torch.zeros_like(logits[:, :, :1]), logits[:, :, :-1]], dim=2)
    return logits


def recipe_loss(recipe: str, model: torch.nn.Module, seqs: torch.Tensor, anchors: torch.Tensor, block: int,
                mask_id: int, gen: torch.Generator, *, alpha: float = 1.01, target_logits: torch.Tensor | None = None,
                streak_ce: float = 0.1, shifted: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one batch under ``recipe`` (see the module docstring) and a few statistics.

    ``target_logits [B, S, V]`` (the target's logits on ``seqs``) is needed by ``streak``.
    """
    b, s = seqs.shape
    n = anchors.shape[1]
    inputs = dllm_block_inputs(seqs, anchors, block, mask_id)
    labels = inputs["labels"]
    stats: dict[str, float] = {}
    if recipe == "d2a-stage1":
        t = torch.rand(b, n, 1, generator=gen).clamp_min(1e-3)
        masked = torch.rand(b, n, block, generator=gen) < t
        masked[:, :, 0] = False
        noisy = torch.where(masked, torch.full_like(labels, mask_id), labels)
        inputs["ids"][:, s:] = noisy.reshape(b, n * block)
        logits = _slot_logits(model, inputs, s, n, block, shifted)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(b, n, block)
        loss = (ce * masked / (t * (block - 1))).sum() / (b * n)
    elif recipe == "d2a-stage2":
        logits = _slot_logits(model, inputs, s, n, block, shifted)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(b, n, block)
        r = block - 1
        w = torch.tensor([0.0] + [alpha ** (r - i) for i in range(1, r + 1)])
        loss = (ce * (w / w.sum())).sum() / (b * n)
    elif recipe == "streak":
        if target_logits is None:
            raise ConfigError("the streak recipe needs the target's logits")
        logits = _slot_logits(model, inputs, s, n, block, shifted)
        q = torch.softmax(logits[:, :, 1:], dim=-1)
        rows = (anchors[:, :, None] + torch.arange(block - 1)).clamp(max=s - 1)  # row p-1 predicts p
        p = torch.softmax(torch.gather(target_logits.float(), 1, rows.reshape(b, -1, 1).expand(-1, -1, q.shape[-1])),
                          dim=-1).view_as(q)
        beta = torch.minimum(p, q).sum(-1)  # [B, N, block-1]
        streak = torch.cumprod(beta, dim=-1).sum(-1)  # expected accepted drafted tokens per block
        ce = F.cross_entropy(logits[:, :, 1:].reshape(-1, logits.shape[-1]), labels[:, :, 1:].reshape(-1))
        loss = -streak.mean() / (block - 1) + streak_ce * ce
        stats["expected_streak"] = float(streak.detach().mean())
    else:
        raise ConfigError(f"unknown recipe {recipe!r}; fix: use one of {', '.join(RECIPES)}")
    with torch.no_grad():
        correct = logits.argmax(-1) == labels
        stats["tau_teacher_forced"] = float(torch.cumprod(correct[:, :, 1:].int(), -1).sum(-1).float().mean() + 1)
    return loss, stats


def _init_model(args: argparse.Namespace, target: torch.nn.Module, mask_id: int) -> torch.nn.Module:
    if args.init == "target":
        return sdar_from_target(target, mask_id, args.block_size, num_layers=args.init_layers)
    model = load_ar_drafter(args.init, dtype=torch.float32)
    if not isinstance(model, SDARForCausalLM) and args.init != "target":
        raise ConfigError(f"--init {args.init} is not a dLLM checkpoint of the SDAR layout; fix: pass an SDAR "
                          "checkpoint (e.g. tiny-sdar) or --init target")
    check_dllm_compatible(model, target)
    shifted = bool((getattr(model.config, "drafter_config", None) or {}).get("shifted", False))
    model.config.drafter_config = {"kind": "dllm", "block_size": int(args.block_size), "layout": "root",
                                   "mask_token_id": int(getattr(model.config, "mask_token_id", None) or mask_id),
                                   "shifted": shifted}
    return model


def _batch(args: argparse.Namespace, target: torch.nn.Module, stream: common.TokenStream, step: int, salt: int,
           greedy_frac: float) -> torch.Tensor:
    gen = common.step_generator(args.seed, step, salt)
    prompts = common.sample_windows(stream, args.batch_size, args.prompt_len, gen)
    greedy = torch.rand(args.batch_size, generator=gen) < greedy_frac
    return target_continue(target, prompts, args.seq_len, greedy, gen, args.temperature)


def _block_for_step(args: argparse.Namespace, gen: torch.Generator) -> int:
    """Stage II draws ``R ~ U(1, R_max)`` masked tokens per step; the others use ``--block-size``."""
    if args.recipe != "d2a-stage2":
        return int(args.block_size)
    r_max = max(1, min(int(args.max_masked), args.seq_len - args.prompt_len - 1))
    return 1 + int(torch.randint(1, r_max + 1, (1,), generator=gen))


@torch.no_grad()
def heldout_acceptance(target: torch.nn.Module, model: torch.nn.Module, prompts: list[list[int]], block: int,
                       max_new_tokens: int) -> dict[str, Any]:
    """DEER decoding (greedy, coupled) of held-out prompts with the target: mean tau and per-prompt taus."""
    model.eval()
    drafter = DLLMDrafter(model, block_size=block)
    taus = []
    for ids in prompts:
        res = speculative_generate(target, drafter, ids, ARSpecConfig(method=DEER.name, max_new_tokens=max_new_tokens))
        taus.append(round(float(res.tau), 3))
    return {"tau": sum(taus) / max(1, len(taus)), "tau_per_prompt": taus, "prompts": len(taus),
            "max_new_tokens": max_new_tokens}


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train a dLLM drafter with ``args.recipe`` (see :func:`add_arguments`); returns the metrics dict."""
    if args.recipe not in RECIPES:
        raise ConfigError(f"unknown recipe {args.recipe!r}; fix: use one of {', '.join(RECIPES)}")
    if args.init is None:
        raise ConfigError("dLLM drafter recipes need --init DIR (a dLLM checkpoint) or --init target")
    out, target, tok, mask_id = start_run(args)
    model = _init_model(args, target, mask_id)
    mask_id = int(model.config.drafter_config["mask_token_id"])
    shifted = bool(model.config.drafter_config.get("shifted", False))
    model.train()
    train_s, held_s = corpus_streams(args, tok, out)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    step, extra = common.maybe_resume(args, out, model, opt, {"wall_s": 0.0})
    loop = common.TrainLoop(args, out, model, opt, step, extra, f"dllm drafter {args.recipe}", refresh_postfix=False)
    while loop.running():
        lr = loop.set_lr()
        seqs = _batch(args, target, train_s, loop.step, 0, args.greedy_frac)
        gen = common.step_generator(args.seed, loop.step, 1)
        block = _block_for_step(args, gen)
        anchors = sample_anchors(seqs.shape[0], args.prompt_len, args.seq_len - block, args.num_anchors, gen)
        t_logits = None
        if args.recipe == "streak":
            with torch.no_grad():
                t_logits = target(input_ids=seqs).logits
        loss, stats = recipe_loss(args.recipe, model, seqs, anchors, block, mask_id, gen, alpha=args.alpha,
                                  target_logits=t_logits, streak_ce=args.streak_ce, shifted=shifted)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        lv = loop.end_step(loss, lr)
        if loop.should_log():
            loop.log({"step": loop.step, "loss": lv, "ema_loss": loop.ema, "lr": lr, "block": block, **stats,
                      "wall_s": extra["wall_s"]})
        loop.maybe_checkpoint()
    loop.finish()
    held_prompts = [row.tolist() for row in common.eval_windows(held_s, args.prompt_len, args.eval_prompts)]
    ev = heldout_acceptance(target, model, held_prompts, args.block_size, args.eval_new_tokens)
    final = out / "model"
    save_checkpoint(model.to(getattr(torch, args.save_dtype)).eval(), final, min_shards=1, tokenizer=tok)
    load_model(final, dtype="float32")  # the saved directory loads through the library loader
    n_params = sum(p.numel() for p in model.parameters())
    metrics = {
        "model": "dllm-drafter", "recipe": args.recipe, "init": str(args.init), "init_layers": args.init_layers, "target": str(args.target),
        "steps": loop.step, "planned_steps": args.steps, "finished": loop.finished,
        "wall_s_total": round(float(extra["wall_s"]), 1), "invocations": extra.get("invocations", []),
        "params": n_params, "heldout_tau_deer_greedy": round(ev["tau"], 3), "heldout": ev,
        "config": {"block_size": args.block_size, "mask_token_id": mask_id, "shifted": shifted},
        "train": {"batch_size": args.batch_size, "seq_len": args.seq_len, "prompt_len": args.prompt_len,
                  "num_anchors": args.num_anchors, "alpha": args.alpha, "max_masked": args.max_masked,
                  "streak_ce": args.streak_ce, "greedy_frac": args.greedy_frac, "lr": args.lr, "seed": args.seed},
        "save_dtype": args.save_dtype, "torch": torch.__version__,
    }
    body = (f"SDAR-layout dLLM drafter ({n_params / 1e6:.2f}M parameters) for the frozen target `{args.target}`, "
            f"recipe `{args.recipe}` from `{args.init}`, {loop.step} steps ({metrics['wall_s_total'] / 60:.1f} min, "
            f"{args.threads} CPU thread(s)) on continuations generated by the target from Python standard-library "
            f"prompts. Held-out acceptance (DEER chain, greedy, block {args.block_size}, {ev['prompts']} prompts x "
            f"{ev['max_new_tokens']} tokens): tau {ev['tau']:.2f} (tokens per target forward, bonus included).")
    common.write_cards(final, out, f"dLLM drafter ({args.recipe})", metrics, body)
    print(json.dumps({k: v for k, v in metrics.items() if k != "invocations"}, indent=2))
    return metrics
