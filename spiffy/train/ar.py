"""Train the tiny Qwen3 causal-LM target (transformers' native ``Qwen3ForCausalLM``) on the stdlib corpus.

Resumable (``--resume`` restores weights, optimizer and step from ``OUT/train_state.pt``; batches are keyed by
``(seed, step)``, so a resumed run follows the uninterrupted one), time-boxed (``--max-minutes``), and writes
``save_pretrained`` safetensors + tokenizer + ``metrics.json`` + ``MODEL_CARD.md`` into ``OUT``.

Example::

    python -m spiffy.train.ar --out runs/tiny-qwen3 --steps 1200 --max-minutes 40
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from spiffy.errors import ConfigError
from spiffy.io import replace_dir
from spiffy.torch_utils import resolve_dtype
from spiffy.train import common
from spiffy.train.corpus import build_corpus, load_split
from spiffy.train.tokenizer_train import save_tokenizer, train_tokenizer


def build_qwen3_config(vocab_size: int, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 768, context: int = 512, eos_id: int = 0, pad_id: int = 0,
                 rope_theta: float = 10000.0):
    """A small ``Qwen3Config`` (tied embeddings, q/k norms, GQA)."""
    if hidden % heads:
        raise ConfigError(f"hidden {hidden} not divisible by heads {heads}; fix: choose heads dividing hidden")
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=hidden // heads, intermediate_size=intermediate,
        max_position_embeddings=context, tie_word_embeddings=True, rope_theta=rope_theta, rms_norm_eps=1e-6,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id, use_cache=True, attention_dropout=0.0,
    )


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token loss on ``ids`` ``[B, L]``: returns (mean CE, #correct argmax, #predicted tokens)."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    tgt = ids[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))
    correct = (logits.argmax(-1) == tgt).sum()
    return loss, correct, torch.tensor(tgt.numel())


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch: int = 8) -> dict[str, float]:
    """Held-out next-token loss / accuracy over ``windows`` ``[N, L]``."""
    model.eval()
    tot_loss, tot_correct, tot_n = 0.0, 0, 0
    for i in range(0, windows.size(0), batch):
        loss, correct, n = lm_loss(model, windows[i:i + batch])
        tot_loss += float(loss) * int(n)
        tot_correct += int(correct)
        tot_n += int(n)
    model.train()
    return {"loss": tot_loss / max(1, tot_n), "accuracy": tot_correct / max(1, tot_n), "tokens": tot_n}


@torch.no_grad()
def greedy_complete(model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 48) -> str:
    """Greedy continuation of ``prompt`` (plain loop, no cache), decoded text of the new tokens only."""
    model.eval()
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    eos = tokenizer.eos_token_id
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model(input_ids=ids).logits[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    model.train()
    return tokenizer.decode(out)


SAMPLE_PROMPTS = common.SAMPLE_PROMPTS
write_card = common.write_card  # re-exported (dllm and drafter import it from here)


def init_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Start ``model`` from the weights of a saved checkpoint of the same shape (a fresh optimizer and schedule), e.g.
    to train a shipped model further after its run directory is gone."""
    source = Qwen3ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    try:
        model.load_state_dict(source.state_dict(), strict=True)
    except RuntimeError as exc:
        raise ConfigError(f"--init-from {str(path)!r} does not match the configured model ({str(exc).splitlines()[0]}); "
                          "fix: pass the --hidden/--layers/--heads/--kv-heads/--intermediate it was trained with") from exc


def prepare_data(corpus_dir: str | None, out: Path, vocab_size: int, family: str, max_files: int | None = None,
                 tokenizer_dir: str | None = None, heldout_percent: int = 5):
    """Build/reuse the corpus, train/reuse the tokenizer (``OUT/tokenizer``) and token streams; returns
    ``(tokenizer, train_stream, heldout_stream, corpus_info)``."""
    info = build_corpus(corpus_dir, max_files=max_files, heldout_percent=heldout_percent)
    if info.n_docs_heldout == 0 or info.n_docs_train == 0:
        raise ConfigError(f"corpus {info.out_dir!r} has an empty split ({info.n_docs_train} train, "
                          f"{info.n_docs_heldout} held-out docs); fix: use more files or a larger --heldout-percent")
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else out / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
    else:
        tok = train_tokenizer(load_split(info.out_dir, "train"), family, tok_dir, vocab_size)
    eos = tok.eos_token_id
    train = common.encode_documents(tok, load_split(info.out_dir, "train"), eos, out / "data" / "train_ids.npy")
    held = common.encode_documents(tok, load_split(info.out_dir, "heldout"), eos, out / "data" / "heldout_ids.npy")
    return tok, train, held, info


def export(model: torch.nn.Module, tok: Any, out: Path, dtype: str) -> Path:
    """``save_pretrained`` the model (cast to ``dtype``) + tokenizer into ``OUT/model`` (atomic dir swap)."""
    final = out / "model"
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".model."))
    clone = type(model)(model.config)
    clone.load_state_dict(model.state_dict())
    clone = clone.to(resolve_dtype(dtype))
    clone.config.dtype = dtype
    clone.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tok, tmp)
    replace_dir(tmp, final)
    return final


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run AR training as configured by ``args`` (see :func:`build_parser`); returns the metrics dict."""
    common.set_threads(args.threads)
    common.seed_everything(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok, train_s, held_s, info = prepare_data(args.corpus, out, args.vocab_size, "qwen3", args.max_files, args.tokenizer,
                                              heldout_percent=args.heldout_percent)
    cfg = build_qwen3_config(len(tok), args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate,
                       max(args.context, args.max_positions), tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    model.train()
    opt = common.adamw_decay_groups(model, args.lr, args.weight_decay)
    step, extra = common.maybe_resume(args, out, model, opt, {"wall_s": 0.0, "tokens": 0})
    if args.init_from and step == 0:  # a resumed run keeps its own weights
        init_weights(model, args.init_from)
    n_params = sum(p.numel() for p in model.parameters())
    held_w = common.eval_windows(held_s, args.context, args.eval_windows)
    loop = common.TrainLoop(args, out, model, opt, step, extra, "qwen3")
    while loop.running():
        lr = loop.set_lr()
        batch = common.sample_windows(train_s, args.batch_size, args.context, common.step_generator(args.seed, loop.step))
        loss, correct, n = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loop.end_step(loss, lr, batch.numel())
        step = loop.step
        if loop.should_log():
            loop.log({"step": step, "loss": lv, "ema_loss": loop.ema, "lr": lr,
                      "acc": int(correct) / int(n), "wall_s": extra["wall_s"]})
        loop.maybe_checkpoint()
        if args.eval_every and step % args.eval_every == 0:
            ev = evaluate(model, held_w)
            loop.log({"step": step, "heldout": ev})
            print(f"\nstep {step} heldout loss {ev['loss']:.4f} acc {ev['accuracy']:.4f}", flush=True)
    loop.finish()
    step = loop.step
    ev = evaluate(model, held_w)
    samples = {p: greedy_complete(model, tok, p, args.sample_tokens) for p in SAMPLE_PROMPTS}
    final = export(model, tok, out, args.save_dtype)
    metrics = {
        "model": args.name, "steps": step, "planned_steps": args.steps, "finished": loop.finished,
        "wall_s_total": round(float(extra["wall_s"]), 1), "invocations": extra.get("invocations", []), "train_tokens_seen": int(extra["tokens"]),
        "heldout_loss": round(ev["loss"], 4), "heldout_accuracy": round(ev["accuracy"], 4),
        "heldout_tokens": ev["tokens"], "params": n_params, "config": {
            "hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
            "intermediate": args.intermediate, "context": args.context, "vocab": len(tok)},
        "train": {"batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup, "seed": args.seed,
                  "schedule": args.schedule, "max_minutes": args.max_minutes,
                  "weight_decay": args.weight_decay, "threads": args.threads},
        "corpus": {"python": info.python_version, "files_train": info.n_files_train,
                   "files_heldout": info.n_files_heldout, "chars_train": info.chars_train,
                   "train_tokens": len(train_s), "heldout_tokens": len(held_s)},
        "save_dtype": args.save_dtype, "size_mb": round(common.file_size_mb(final), 2),
        "samples_greedy": samples, "torch": torch.__version__,
    }
    body = (f"Qwen3ForCausalLM (transformers native), {n_params/1e6:.2f}M parameters, trained from scratch for {step} "
            f"steps ({metrics['wall_s_total']/60:.1f} min, 1 CPU thread) on the Python {info.python_version} standard "
            f"library's .py sources ({info.n_files_train} train files, {info.n_files_heldout} held out by path hash), "
            f"byte-level BPE vocab {len(tok)}. Weights stored in {args.save_dtype}. Reproduce with "
            f"`scripts/train_{args.name.replace('-', '_')}.sh`.")
    common.write_cards(final, out, f"{args.name} (spiffy {args.role})", metrics, body)
    print(json.dumps({k: v for k, v in metrics.items() if k != "samples_greedy"}, indent=2))
    for p, s in samples.items():
        print(f"--- {p!r} ->\n{p}{s}")
    return metrics


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train spiffy's tiny Qwen3 target on the stdlib corpus.")
    p.add_argument("--out", required=True, help="run dir (train_state.pt, logs; final model in OUT/model)")
    p.add_argument("--name", default="tiny-qwen3", help="the model's name in metrics.json and its card (the card "
                   "names scripts/train_NAME.sh, with - as _, as the way to reproduce it)")
    p.add_argument("--role", default="demo target", help="what the model is for, in its card's title")
    common.add_corpus_arguments(p)
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer dir instead of training OUT/tokenizer")
    p.add_argument("--init-from", default=None, metavar="DIR", help="start from this saved model's weights (same "
                   "shape; fresh optimizer and schedule), e.g. a shipped model to train further")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--intermediate", type=int, default=768, help="MLP intermediate size")
    p.add_argument("--context", type=int, default=256, help="training window length (tokens)")
    p.add_argument("--max-positions", type=int, default=512, help="config max_position_embeddings")
    common.add_optim_arguments(p, steps=1000)
    p.add_argument("--seed", type=int, default=0, help="random seed (init and batch order)")
    common.add_run_arguments(p, max_minutes=40.0, ckpt_every=50)
    common.add_eval_arguments(p, eval_windows=64)
    common.add_output_arguments(p)
    p.add_argument("--sample-tokens", type=int, default=48, help="tokens per sample completion in the report")
    return p


def main(argv: list[str] | None = None) -> int:
    train(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
