"""Train a DFlash block-diffusion drafter on a frozen AR target (any target architecture) (library feature; ``spiffy train-drafter``).

Recipe (after the DFlash paper / its public training code, re-implemented):

* **Data**: sequences the *target itself* produced: a window of ``prompt_len`` corpus tokens continued by the
  target to ``seq_len`` tokens (per row greedy with probability ``greedy_frac``, else sampled at temperature 1),
  so the drafter learns to predict what the target will say. ``--data corpus`` trains on raw corpus windows instead.
* **Features**: outputs of the target's decoder layers ``target_layer_ids`` (forward hooks), concatenated.
* **Blocks**: ``num_anchors`` random anchor positions per sequence (in the generated part). A block is
  ``[token at anchor, MASK x (B-1)]`` at positions ``anchor .. anchor+B-1``; it sees the context features of the
  positions strictly before the anchor (at inference the bonus token's own features do not exist yet) and its own
  block bidirectionally, never other blocks. Slot ``k`` predicts the token at ``anchor + k`` (same position).
* **Loss**: cross entropy over slots ``1..B-1`` (slot 0 is given), weighted by ``exp(-(k-1)/gamma)`` (early slots
  matter most: a rejection ends the accepted run), normalised by the weight sum. The target (embeddings and
  ``lm_head`` included) is frozen; only the drafter trains.
* **Held-out metric**: greedy acceptance length ``tau`` (accepted draft tokens + 1 bonus, chain drafting) on
  held-out greedy target continuations, and per-slot accuracy.

Output: a real drafter checkpoint directory (``config.json`` with ``dflash_config`` + safetensors) loadable with
:func:`spiffy.models.dflash.load_drafter`, plus ``metrics.json`` and ``MODEL_CARD.md``. Resumable (``--resume``),
time-boxed (``--max-minutes``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from spiffy.errors import CheckpointError, ConfigError, DrafterMismatchError, MissingTokenError
from spiffy.models.ar_checkpoints import MASK_TOKEN_NAMES, dflash_config_for_target, save_drafter
from spiffy.models.cache import HF_CACHE_NAME, hf_cache
from spiffy.models.dflash import DFlashDraftModel, TargetFeatureHooks, load_drafter
from spiffy.models.loading import load_model, load_tokenizer, read_config_dict
from spiffy.models.target import target_spec
from spiffy.train import common
from spiffy.train.arguments import add_drafter_arguments as add_arguments
from spiffy.train.corpus import build_corpus, load_split


def load_frozen_target(path: str | Path, dtype: torch.dtype | str = "float32"):
    """Load an AR target checkpoint dir (any target architecture, :func:`spiffy.models.target.target_spec`) through
    spiffy's loader (frozen, eval mode) and its tokenizer (or None)."""

    root = Path(path)
    target_spec(read_config_dict(root), f"--target {root}")  # an AR target architecture, or a typed refusal
    model = load_model(root, dtype=dtype)
    model.eval().requires_grad_(False)
    tok = load_tokenizer(root) if (root / "tokenizer.json").is_file() else None
    return model, tok


def mask_token_of(tokenizer: Any, vocab_size: int, explicit: int | None = None) -> int:
    """The DFlash mask id: ``explicit``, else the tokenizer's first token of
    :data:`spiffy.models.ar_checkpoints.MASK_TOKEN_NAMES` (``<|MASK|>``, ..., Llama 3's first reserved token), else
    its mask token."""

    if explicit is not None:
        mid = int(explicit)
    else:
        mid = None
        if tokenizer is not None:
            for name in (*MASK_TOKEN_NAMES, getattr(tokenizer, "mask_token", None)):
                if name:
                    tid = tokenizer.convert_tokens_to_ids(name)
                    if tid is not None and tid != tokenizer.unk_token_id:
                        mid = int(tid)
                        break
        if mid is None:
            raise MissingTokenError("the target tokenizer has no <|MASK|> token; fix: pass --mask-token-id "
                                    "(an id the target never emits) or add <|MASK|> to the tokenizer")
    if not 0 <= mid < vocab_size:
        raise DrafterMismatchError(f"mask id {mid} outside the target vocabulary ({vocab_size}); fix: pick a valid id")
    return mid


def build_drafter_config(target_config: Any, num_layers: int, block_size: int, target_layer_ids: Sequence[int] | None,
                         mask_token_id: int, intermediate: int | None = None):
    """A ``Qwen3Config`` for a drafter sized to the target (any target architecture) + DFlash extras
    (:func:`spiffy.models.ar_checkpoints.dflash_config_for_target`); DrafterMismatchError for layer ids outside it."""
    n_target = int(target_config.num_hidden_layers)
    bad = [int(i) for i in target_layer_ids or () if not 0 <= int(i) < n_target]
    if bad:
        raise DrafterMismatchError(f"target layer ids {bad} outside the target's {n_target} layers; "
                                   f"fix: pass --target-layer-ids within 0..{n_target - 1}")
    return dflash_config_for_target(target_config, num_layers, block_size, target_layer_ids, mask_token_id, intermediate)


@torch.no_grad()
def target_continue(target: torch.nn.Module, prompts: torch.Tensor, total_len: int, greedy: torch.Tensor,
                    gen: torch.Generator, temperature: float = 1.0) -> torch.Tensor:
    """Continue ``prompts`` ``[B, P]`` with the target to ``[B, total_len]`` (KV cache). Rows with ``greedy[b]``
    take the argmax, others sample from ``softmax(logits / temperature)`` with ``gen``."""

    seq = prompts
    cache = DynamicCache(config=target.config)
    out = target(input_ids=seq, use_cache=True, **hf_cache(cache))
    for _ in range(total_len - prompts.shape[1]):
        logits = out.logits[:, -1].float()
        arg = logits.argmax(-1)
        probs = torch.softmax(logits / max(temperature, 1e-6), dim=-1)
        smp = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        nxt = torch.where(greedy, arg, smp)[:, None]
        seq = torch.cat([seq, nxt], dim=1)
        out = target(input_ids=nxt, use_cache=True, **hf_cache(getattr(out, HF_CACHE_NAME)))
    return seq


def sample_anchors(batch: int, lo: int, hi: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct sorted anchor positions per row, uniform in ``[lo, hi]``: int64 ``[batch, n]``."""
    span = hi - lo + 1
    if span <= 0:
        raise ConfigError(f"no room for anchors in [{lo}, {hi}]; fix: raise --seq-len or lower --prompt-len/--block-size")
    n = min(n, span)
    scores = torch.rand(batch, span, generator=gen)
    return scores.argsort(dim=1)[:, :n].sort(dim=1).values + lo


def block_inputs(seqs: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int):
    """Block token ids, position ids, visibility mask and labels for parallel training blocks.

    Args: ``seqs [B, S]`` token ids, ``anchors [B, N]``.
    Returns: ``noise_ids [B, N*block]`` (anchor token then masks), ``positions [B, S + N*block]``,
    ``mask [B, 1, N*block, S + N*block]`` bool (True = visible), ``labels [B, N, block]`` (token at anchor+k,
    clamped), ``valid [B, N, block]`` (anchor+k inside the sequence).
    """
    b, s = seqs.shape
    n = anchors.shape[1]
    offs = torch.arange(block)
    idx = anchors[:, :, None] + offs  # [B, N, block]
    valid = idx < s
    labels = torch.gather(seqs[:, None, :].expand(b, n, s), 2, idx.clamp(max=s - 1))
    noise = torch.full((b, n, block), mask_id, dtype=torch.long)
    noise[:, :, 0] = labels[:, :, 0]
    positions = torch.cat([torch.arange(s).expand(b, s), idx.reshape(b, n * block)], dim=1)
    q_anchor = anchors.repeat_interleave(block, dim=1)  # [B, N*block]
    ctx_vis = torch.arange(s)[None, None, :] < q_anchor[:, :, None]  # strictly before the anchor
    q_blk = torch.arange(n * block) // block
    blk_vis = (q_blk[:, None] == q_blk[None, :]).expand(b, -1, -1)
    mask = torch.cat([ctx_vis, blk_vis], dim=2)[:, None]
    return noise.reshape(b, n * block), positions, mask, labels, valid


def slot_weights(block: int, gamma: float) -> torch.Tensor:
    """Loss weight per block slot ``[block]``: 0 for slot 0, ``exp(-(k-1)/gamma)`` for ``k >= 1`` (gamma <= 0: 1)."""
    k = torch.arange(block, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma) if gamma > 0 else torch.ones(block)
    w[0] = 0.0
    return w


def drafter_loss(drafter: torch.nn.Module, target: torch.nn.Module, hooks: Any, seqs: torch.Tensor,
                 anchors: torch.Tensor, gamma: float):
    """Weighted block CE of the drafter on ``seqs [B, S]`` at ``anchors [B, N]``.

    Returns ``(loss, logits [B, N, block, V], labels [B, N, block], valid [B, N, block])``.
    """
    block, mask_id = drafter.block_size, drafter.mask_token_id
    with torch.no_grad():
        target(input_ids=seqs)
        feats = hooks.features()
        noise, pos, mask, labels, valid = block_inputs(seqs, anchors, block, mask_id)
        emb = target.get_input_embeddings()(noise)
    hidden = drafter(feats, emb, pos, None, store_context=False, attention_mask=mask)
    b, n = anchors.shape
    logits = drafter.compute_logits(hidden, target.get_output_embeddings())
    if logits.dtype != torch.float64:
        logits = logits.float()
    logits = logits.view(b, n, block, -1)
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none").view(b, n, block)
    w = slot_weights(block, gamma)[None, None, :] * valid.float()
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    return loss, logits, labels, valid


@torch.no_grad()
def acceptance_stats(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> dict[str, Any]:
    """Chain (greedy) acceptance on teacher-forced blocks: ``tau`` = 1 + leading run of correct slots 1..B-1,
    macro-averaged over blocks; per-slot accuracy."""
    correct = (logits.argmax(-1) == labels) & valid  # [B, N, block]
    run = torch.cumprod(correct[:, :, 1:].int(), dim=-1).sum(-1)  # accepted drafted tokens
    per_slot = correct[:, :, 1:].float().sum((0, 1)) / valid[:, :, 1:].float().sum((0, 1)).clamp(min=1)
    return {"tau": float(run.float().mean() + 1), "per_slot_acc": [round(float(x), 4) for x in per_slot],
            "blocks": int(run.numel())}


def _batch(args: argparse.Namespace, target: torch.nn.Module, stream: common.TokenStream, step: int,
           salt: int, greedy_frac: float, batch_size: int) -> tuple[torch.Tensor, int]:
    """Training/eval sequences ``[B, seq_len]`` for ``step`` and the first position where anchors may start."""
    gen = common.step_generator(args.seed, step, salt)
    if args.data == "corpus":
        return common.sample_windows(stream, batch_size, args.seq_len, gen), 1
    prompts = common.sample_windows(stream, batch_size, args.prompt_len, gen)
    greedy = torch.rand(batch_size, generator=gen) < greedy_frac
    return target_continue(target, prompts, args.seq_len, greedy, gen, args.temperature), args.prompt_len


def start_run(args: argparse.Namespace) -> tuple[Path, torch.nn.Module, Any, int]:
    """Threads, seeds, the run directory, the frozen target with its tokenizer, and the mask id:
    ``(out, target, tokenizer, mask_id)``."""
    common.set_threads(args.threads)
    common.seed_everything(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, tok = load_frozen_target(args.target)
    if tok is None:
        raise CheckpointError(f"no tokenizer in {args.target!r}; fix: save the tokenizer next to the target weights")
    return out, target, tok, mask_token_of(tok, int(target.config.vocab_size), args.mask_token_id)


def corpus_streams(args: argparse.Namespace, tok: Any, out: Path) -> tuple[common.TokenStream, common.TokenStream]:
    """The train and held-out token streams of the prompt corpus (``--corpus``, built if missing), cached in
    ``OUT/data``."""

    info = build_corpus(args.corpus, max_files=args.max_files, heldout_percent=args.heldout_percent)
    if info.n_docs_heldout == 0:
        raise ConfigError("the corpus has no held-out documents; fix: use more files or a larger --heldout-percent")
    eos = tok.eos_token_id
    train_s = common.encode_documents(tok, load_split(info.out_dir, "train"), eos, out / "data" / "train_ids.npy")
    held_s = common.encode_documents(tok, load_split(info.out_dir, "heldout"), eos, out / "data" / "heldout_ids.npy")
    return train_s, held_s


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train a drafter as configured by ``args`` (see :func:`add_arguments`); returns the metrics dict."""

    out, target, tok, mask_id = start_run(args)
    cfg = build_drafter_config(target.config, args.num_layers, args.block_size, args.target_layer_ids, mask_id,
                               args.intermediate)
    torch.manual_seed(args.seed)
    drafter = DFlashDraftModel(cfg)
    with torch.no_grad():
        # small final-norm gain at the start: the block rows begin as (mostly) the MASK embedding, which the tied
        # lm_head would map to a confident "<|MASK|>" (loss ~35); a small gain starts near uniform (loss ~ln V)
        drafter.norm.weight.fill_(args.init_norm_gain)
    drafter.train()
    train_s, held_s = corpus_streams(args, tok, out)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    step, extra = common.maybe_resume(args, out, drafter, opt, {"wall_s": 0.0})
    hooks = TargetFeatureHooks(target, drafter.target_layer_ids)
    loop = common.TrainLoop(args, out, drafter, opt, step, extra, "drafter", refresh_postfix=False)
    while loop.running():
        lr = loop.set_lr()
        seqs, lo = _batch(args, target, train_s, loop.step, 0, args.greedy_frac, args.batch_size)
        gen = common.step_generator(args.seed, loop.step, 1)
        anchors = sample_anchors(seqs.shape[0], lo, args.seq_len - args.block_size, args.num_anchors, gen)
        loss, logits, labels, valid = drafter_loss(drafter, target, hooks, seqs, anchors, args.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        lv = loop.end_step(loss, lr)
        if loop.should_log():
            st = acceptance_stats(logits, labels, valid)
            loop.log({"step": loop.step, "loss": lv, "ema_loss": loop.ema, "lr": lr, "tau": st["tau"],
                      "wall_s": extra["wall_s"]})
        loop.maybe_checkpoint()
    loop.finish()
    step = loop.step
    ev = evaluate(args, drafter, target, hooks, held_s)
    hooks.remove()
    final = out / "model"
    save_drafter(drafter.to(getattr(torch, args.save_dtype)).eval(), final, num_shards=1)
    # check: the saved dir loads through the library loader
    load_drafter(final, dtype="float32")
    n_params = sum(p.numel() for p in drafter.parameters())
    metrics = {
        "model": "tiny-dflash-drafter", "target": str(args.target), "steps": step, "planned_steps": args.steps,
        "finished": loop.finished, "wall_s_total": round(float(extra["wall_s"]), 1), "invocations": extra.get("invocations", []), "params": n_params,
        "heldout_loss": round(ev["loss"], 4), "heldout_tau_greedy": round(ev["tau"], 3),
        "heldout_per_slot_acc": ev["per_slot_acc"], "heldout_blocks": ev["blocks"],
        "config": {"num_layers": args.num_layers, "block_size": drafter.block_size,
                   "target_layer_ids": drafter.target_layer_ids, "mask_token_id": drafter.mask_token_id},
        "train": {"data": args.data, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "prompt_len": args.prompt_len, "num_anchors": args.num_anchors, "gamma": args.gamma,
                  "greedy_frac": args.greedy_frac, "lr": args.lr, "seed": args.seed, "schedule": args.schedule,
                  "max_minutes": args.max_minutes},
        "save_dtype": args.save_dtype, "size_mb": round(common.file_size_mb(final), 2), "torch": torch.__version__,
    }
    body = (f"DFlash drafter ({args.num_layers} layers, block {drafter.block_size}, {n_params/1e6:.2f}M parameters, "
            f"no embedding/head: borrows the target's) trained for {step} steps ({metrics['wall_s_total']/60:.1f} min, "
            f"1 CPU thread) on continuations generated by its frozen target `{args.target}` from Python "
            f"standard-library source prompts; features from target layers {drafter.target_layer_ids}. "
            f"Held-out greedy acceptance length tau (incl. bonus) {ev['tau']:.2f}. Reproduce with "
            f"`scripts/train_tiny_drafter.sh`.")
    common.write_cards(final, out, "tiny DFlash drafter (spiffy demo)", metrics, body)
    print(json.dumps(metrics, indent=2))
    return metrics


@torch.no_grad()
def evaluate(args: argparse.Namespace, drafter: torch.nn.Module, target: torch.nn.Module, hooks: Any,
             held: common.TokenStream) -> dict[str, Any]:
    """Held-out loss, greedy tau and per-slot accuracy on greedy target continuations of held-out prompts."""
    drafter.eval()
    tot = {"loss": 0.0, "n": 0}
    logits_all, labels_all, valid_all = [], [], []
    for i in range(args.eval_batches):
        seqs, lo = _batch(args, target, held, 10_000_000 + i, 2, 1.0, args.batch_size)
        gen = common.step_generator(args.seed, 10_000_000 + i, 3)
        anchors = sample_anchors(seqs.shape[0], lo, args.seq_len - args.block_size, args.num_anchors, gen)
        loss, logits, labels, valid = drafter_loss(drafter, target, hooks, seqs, anchors, args.gamma)
        tot["loss"] += float(loss)
        tot["n"] += 1
        logits_all.append(logits.argmax(-1, keepdim=True))
        labels_all.append(labels)
        valid_all.append(valid)
    drafter.train()
    # acceptance_stats takes logits; pass one-hot-free argmax via a trick: compare indices directly
    pred = torch.cat(logits_all).squeeze(-1)
    labels = torch.cat(labels_all)
    valid = torch.cat(valid_all)
    correct = (pred == labels) & valid
    run = torch.cumprod(correct[:, :, 1:].int(), dim=-1).sum(-1)
    per_slot = correct[:, :, 1:].float().sum((0, 1)) / valid[:, :, 1:].float().sum((0, 1)).clamp(min=1)
    return {"loss": tot["loss"] / max(1, tot["n"]), "tau": float(run.float().mean() + 1),
            "per_slot_acc": [round(float(x), 4) for x in per_slot], "blocks": int(run.numel())}


def main(argv: list[str] | None = None) -> int:
    p = add_arguments(argparse.ArgumentParser(description="Train a DFlash drafter on a frozen AR target."))
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
