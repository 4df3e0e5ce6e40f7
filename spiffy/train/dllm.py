"""Train the tiny LLaDA-architecture masked-diffusion LM (``spiffy.models.llada.LLaDAModelLM``) on the stdlib corpus.

Objective (LLaDA pretraining, re-implemented): for a clean window ``x0 [B, L]`` draw ``t ~ U(0, 1)`` per row, mask
each token independently with probability ``p = (1 - eps) * t + eps`` (mask id from the tokenizer), and minimise
the cross entropy of the model's prediction at every *masked* position (position ``i`` predicts token ``i``), each
term weighted ``1 / p``, summed and divided by ``B * L``. A fraction ``--prompt-frac`` of rows are
prompt-conditioned (SFT style): a random prefix of the window stays clean and only the rest can be masked, with the
row's loss divided by its response length, so completing a given code prefix works.

Resumable (``--resume``), time-boxed (``--max-minutes``); writes the checkpoint with
:func:`spiffy.models.loading.save_checkpoint` (config with ``auto_map``, safetensors, tokenizer) into
``OUT/model`` plus ``metrics.json`` and ``MODEL_CARD.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spiffy.errors import MissingTokenError
from spiffy.models.llada import LLaDAConfig, LLaDAModelLM
from spiffy.models.loading import load_model, save_checkpoint
from spiffy.torch_utils import resolve_dtype
from spiffy.train import common
from spiffy.train.ar import prepare_data


def build_llada_config(tok: Any, hidden: int = 256, layers: int = 4, heads: int = 4, mlp: int = 768, context: int = 512,
                 tie: bool = True, rope_theta: float = 10000.0):
    """A small ``LLaDAConfig`` whose special ids come from ``tok``."""
    mask = tok.convert_tokens_to_ids("<|mdm_mask|>")
    if mask is None or mask == tok.unk_token_id:
        raise MissingTokenError("tokenizer has no <|mdm_mask|>; fix: build it with tokenizer_train --family llada")
    v = len(tok)
    return LLaDAConfig(
        d_model=hidden, n_heads=heads, n_kv_heads=heads, n_layers=layers, mlp_ratio=max(1, mlp // hidden),
        mlp_hidden_size=mlp, vocab_size=v, embedding_size=v, max_sequence_length=context, rope_theta=rope_theta,
        rms_norm_eps=1e-5, weight_tying=tie, include_bias=False, mask_token_id=int(mask),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        init_device=None, precision=None, init_std=0.02,
    )


def noise_batch(x0: torch.Tensor, mask_id: int, gen: torch.Generator, eps: float = 1e-3,
                prompt_frac: float = 0.0, weighting: str = "elbo") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward-noise a batch.

    Args: ``x0 [B, L]`` clean ids.
    Returns: ``xt [B, L]`` (masked ids), ``masked [B, L]`` bool, ``weight [B, L]`` per-token loss weight
    (``1 / (p * L)`` for pretraining rows, ``1 / (p * response_len)`` for prompt-conditioned rows, 0 if unmasked;
    with ``weighting="mean"`` every masked token weighs ``B / #masked``).
    """
    b, length = x0.shape
    t = torch.rand(b, generator=gen)
    p = (1 - eps) * t + eps
    u = torch.rand(b, length, generator=gen)
    masked = u < p[:, None]
    is_prompt_row = torch.rand(b, generator=gen) < prompt_frac
    plen = torch.randint(1, max(2, length // 2), (b,), generator=gen)
    plen = torch.where(is_prompt_row, plen, torch.zeros_like(plen))
    in_prompt = torch.arange(length)[None, :] < plen[:, None]
    masked &= ~in_prompt
    denom = (length - plen).clamp(min=1).float()
    if weighting == "mean":
        # every masked token counts the same: weights sum to B over the batch (lower variance than 1/p)
        weight = masked.float() * (b / masked.sum().clamp(min=1).float())
    else:
        weight = masked.float() / (p[:, None] * denom[:, None])
    xt = torch.where(masked, torch.full_like(x0, mask_id), x0)
    return xt, masked, weight


def diffusion_loss(model: torch.nn.Module, x0: torch.Tensor, mask_id: int, gen: torch.Generator, eps: float,
                   prompt_frac: float, weighting: str = "elbo") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LLaDA loss on ``x0 [B, L]``: returns (loss, #correct masked predictions, #masked)."""
    xt, masked, weight = noise_batch(x0, mask_id, gen, eps, prompt_frac, weighting)
    logits = model(input_ids=xt).logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x0.reshape(-1), reduction="none").view_as(weight)
    loss = (ce * weight).sum() / x0.shape[0]
    with torch.no_grad():
        correct = ((logits.argmax(-1) == x0) & masked).sum()
    return loss, correct, masked.sum()


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, mask_id: int, ratios: tuple[float, ...] = (0.15, 0.5, 0.9),
             batch: int = 8, seed: int = 1234) -> dict[str, Any]:
    """Held-out masked-token accuracy and CE at fixed mask ratios (fixed seed): ``{ratio: {acc, ce}}``."""
    model.eval()
    out: dict[str, Any] = {}
    for r in ratios:
        g = torch.Generator().manual_seed(seed)
        ok, n, ce_sum = 0, 0, 0.0
        for i in range(0, windows.size(0), batch):
            x0 = windows[i:i + batch]
            m = torch.rand(x0.shape, generator=g) < r
            xt = torch.where(m, torch.full_like(x0, mask_id), x0)
            logits = model(input_ids=xt).logits.float()
            ce = F.cross_entropy(logits[m], x0[m], reduction="sum")
            ok += int((logits.argmax(-1)[m] == x0[m]).sum())
            n += int(m.sum())
            ce_sum += float(ce)
        out[f"mask_{r}"] = {"accuracy": round(ok / max(1, n), 4), "ce": round(ce_sum / max(1, n), 4), "tokens": n}
    model.train()
    return out


@torch.no_grad()
def sample_llada_completion(model: torch.nn.Module, tok: Any, prompt: str, gen_length: int = 48, block: int = 16) -> str:
    """Greedy semi-autoregressive LLaDA decoding (one token per step, low-confidence remasking) of ``prompt``."""
    model.eval()
    mask_id = int(model.config.mask_token_id)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids + [mask_id] * gen_length])
    p = len(ids)
    for start in range(p, p + gen_length, block):
        for _ in range(block):
            logits = model(input_ids=x).logits[0].float()
            conf, pred = torch.softmax(logits, -1).max(-1)
            region = torch.zeros_like(conf, dtype=torch.bool)
            region[start:start + block] = x[0, start:start + block] == mask_id
            if not region.any():
                break
            conf = torch.where(region, conf, torch.full_like(conf, -1.0))
            j = int(conf.argmax())
            x[0, j] = pred[j]
    model.train()
    new = x[0, p:].tolist()
    eos = tok.eos_token_id
    if eos in new:
        new = new[:new.index(eos)]
    return tok.decode(new)


SAMPLE_PROMPTS = common.SAMPLE_PROMPTS


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run masked-diffusion training as configured by ``args``; returns the metrics dict."""
    common.set_threads(args.threads)
    common.seed_everything(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok, train_s, held_s, info = prepare_data(args.corpus, out, args.vocab_size, "llada", args.max_files, args.tokenizer,
                                              heldout_percent=args.heldout_percent)
    cfg = build_llada_config(tok, args.hidden, args.layers, args.heads, args.mlp, max(args.context, args.max_positions),
                       not args.untied)
    torch.manual_seed(args.seed)
    model = LLaDAModelLM(cfg)
    model.train()
    mask_id = int(cfg.mask_token_id)
    opt = common.adamw_decay_groups(model, args.lr, args.weight_decay)
    step, extra = common.maybe_resume(args, out, model, opt, {"wall_s": 0.0, "tokens": 0})
    n_params = sum(p.numel() for p in model.parameters())
    held_w = common.eval_windows(held_s, args.context, args.eval_windows)
    loop = common.TrainLoop(args, out, model, opt, step, extra, "llada", refresh_postfix=False)
    while loop.running():
        lr = loop.set_lr()
        gen = common.step_generator(args.seed, loop.step)
        x0 = common.sample_windows(train_s, args.batch_size, args.context, gen)
        loss, correct, n = diffusion_loss(model, x0, mask_id, gen, args.eps, args.prompt_frac, args.weighting)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loop.end_step(loss, lr, x0.numel())
        step = loop.step
        if loop.should_log():
            loop.log({"step": step, "loss": lv, "ema_loss": loop.ema, "lr": lr,
                      "masked_acc": int(correct) / max(1, int(n)), "wall_s": extra["wall_s"]})
        loop.maybe_checkpoint()
        if args.eval_every and step % args.eval_every == 0:
            ev = evaluate(model, held_w, mask_id)
            loop.log({"step": step, "heldout": ev})
            print(f"\nstep {step} heldout {ev}", flush=True)
    loop.finish()
    step = loop.step
    ev = evaluate(model, held_w, mask_id)
    samples = {p: sample_llada_completion(model, tok, p, args.sample_tokens) for p in SAMPLE_PROMPTS}
    metrics = {
        "model": "tiny-llada", "steps": step, "planned_steps": args.steps, "finished": loop.finished,
        "wall_s_total": round(float(extra["wall_s"]), 1), "invocations": extra.get("invocations", []), "train_tokens_seen": int(extra["tokens"]),
        "heldout_masked": ev, "params": n_params,
        "config": {"d_model": args.hidden, "n_layers": args.layers, "n_heads": args.heads, "mlp": args.mlp,
                   "context": args.context, "vocab": len(tok), "weight_tying": not args.untied},
        "train": {"batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup, "seed": args.seed,
                  "schedule": args.schedule, "max_minutes": args.max_minutes,
                  "eps": args.eps, "prompt_frac": args.prompt_frac, "weighting": args.weighting, "weight_decay": args.weight_decay},
        "corpus": {"python": info.python_version, "files_train": info.n_files_train,
                   "files_heldout": info.n_files_heldout, "train_tokens": len(train_s), "heldout_tokens": len(held_s)},
        "save_dtype": args.save_dtype, "samples_greedy": samples, "torch": torch.__version__,
    }
    body = (f"LLaDA-architecture masked-diffusion LM (spiffy.models.llada.LLaDAModelLM, bidirectional), "
            f"{n_params/1e6:.2f}M parameters, trained from scratch with the LLaDA objective (+{args.prompt_frac:.0%} "
            f"prompt-conditioned rows) for {step} steps ({metrics['wall_s_total']/60:.1f} min, 1 CPU thread) on the "
            f"Python {info.python_version} standard library's .py sources, byte-level BPE vocab {len(tok)}. "
            f"Weights stored in {args.save_dtype}. Reproduce with `scripts/train_tiny_llada.sh`.")
    final = out / "model"
    export = LLaDAModelLM(cfg)
    export.load_state_dict(model.state_dict())
    export = export.to(resolve_dtype(args.save_dtype)).eval()
    export.config.torch_dtype = args.save_dtype
    gen_cfg = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
               "mask_token_id": mask_id}
    save_checkpoint(export, final, tokenizer=tok, generation_config=gen_cfg)
    load_model(final, dtype="float32")  # check it loads through the library loader
    metrics["size_mb"] = round(common.file_size_mb(final), 2)
    common.write_cards(final, out, "tiny-llada (spiffy demo dLLM)", metrics, body)
    print(json.dumps({k: v for k, v in metrics.items() if k != "samples_greedy"}, indent=2))
    for p, s in samples.items():
        print(f"--- {p!r} ->\n{p}{s}")
    return metrics


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train spiffy's tiny LLaDA-architecture dLLM on the stdlib corpus.")
    p.add_argument("--out", required=True, help="run dir (train_state.pt, logs; final model in OUT/model)")
    common.add_corpus_arguments(p)
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer dir instead of training OUT/tokenizer")
    p.add_argument("--hidden", type=int, default=256, help="d_model")
    p.add_argument("--layers", type=int, default=4, help="n_layers")
    p.add_argument("--heads", type=int, default=4, help="n_heads (= n_kv_heads)")
    p.add_argument("--mlp", type=int, default=768, help="mlp_hidden_size")
    p.add_argument("--untied", action="store_true", help="separate output head (ff_out) instead of weight tying")
    p.add_argument("--context", type=int, default=256, help="training window length (tokens)")
    p.add_argument("--max-positions", type=int, default=512, help="config max_sequence_length")
    common.add_optim_arguments(p, steps=600)
    p.add_argument("--eps", type=float, default=1e-3, help="minimum mask probability")
    p.add_argument("--weighting", choices=["elbo", "mean"], default="elbo",
                   help="masked-token CE weights: LLaDA's 1/t ELBO weights, or a plain mean over masked tokens")
    p.add_argument("--prompt-frac", type=float, default=0.3, help="fraction of prompt-conditioned (SFT-like) rows")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    common.add_run_arguments(p, max_minutes=40.0, ckpt_every=50)
    common.add_eval_arguments(p)
    common.add_output_arguments(p)
    p.add_argument("--sample-tokens", type=int, default=48, help="tokens per sample completion in the report")
    return p


def main(argv: list[str] | None = None) -> int:
    train(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
