"""Adapt the embedded tiny Qwen3 (AR) into an SDAR block-diffusion LM (``spiffy.models.sdar.SDARForCausalLM``).

SDAR's layout is Qwen3's (q_norm/k_norm included), so the AR weights copy key for key; the tokenizer (with
``<|MASK|>``) is the target's, so the result can also draft for that target.

Objective (block diffusion, SDAR / BD3-LM style, re-implemented): a clean window ``x0 [B, L]`` is cut into blocks of
``block`` tokens; every block draws its own mask ratio ``p = (1 - eps) * t + eps``, ``t ~ U(0, 1)``, and masks each
of its tokens with probability ``p``. One forward runs on ``[x_t ; x0]`` (``2L`` rows, position ids ``0..L-1``
twice) under :func:`training_mask`: a noisy row of block ``b`` sees the noisy rows of its own block
(bidirectionally) and the clean rows of blocks ``< b``; clean rows are block-causal among clean rows. That is
exactly what the decoder (:mod:`spiffy.decoding.sdar`) computes for block ``b`` with the committed K/V of blocks
``< b`` in the cache. Loss: mean cross entropy over masked positions, **row i predicting token i** (no shift, as
the decoder reads ``logits[:, i]`` for block position ``i``). A fraction ``--prompt-frac`` of rows keep a random
prefix of every block clean (a prompt ending inside the first decode block, as with unaligned prompts).
``--blocks 16,32`` draws the block length per step.

Continued adaptation: ``--start-from`` (an SDAR checkpoint or a training state of this trainer) replaces the Qwen3
copy by those weights (fresh optimizer and schedule). ``--teacher AR_DIR`` mixes windows of low-entropy text into
every batch (``--teacher-frac`` of the rows): training-corpus prefixes continued greedily by the AR model
(:mod:`spiffy.train.teacher`), which makes the dLLM confident where the text is predictable.

Resumable (``--resume``), time-boxed (``--max-minutes``); the model is written with
:func:`spiffy.models.loading.save_checkpoint` into ``OUT/model`` plus ``metrics.json`` and ``MODEL_CARD.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spiffy.api import generate
from spiffy.embedded import embedded_models_dir
from spiffy.errors import ConfigError, MissingTokenError
from spiffy.models.loading import load_model, load_tokenizer, save_checkpoint
from spiffy.models.sdar import SDARConfig, SDARForCausalLM
from spiffy.train import common, functions, teacher
from spiffy.train.corpus import load_split
from spiffy.train.ar import prepare_data

MASK_TOKEN = "<|MASK|>"


def training_mask(length: int, block: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Visibility of the ``[noisy ; clean]`` training layout: bool ``[1, 1, 2L, 2L]`` (True = visible).

    Row/column ``r < L`` is noisy position ``r``, ``r >= L`` clean position ``r - L``; ``blk(p) = p // block``.
    Noisy query q sees noisy key k iff ``blk(k) == blk(q)`` and clean key k iff ``blk(k) < blk(q)``; clean query
    q sees clean key k iff ``blk(k) <= blk(q)`` and no noisy key.
    """
    if length % block:
        raise ConfigError(f"training window {length} is not a multiple of block {block}; fix: --context k*block")
    b = torch.arange(length, device=device) // block
    noisy_noisy = b[None, :] == b[:, None]
    noisy_clean = b[None, :] < b[:, None]
    clean_clean = b[None, :] <= b[:, None]
    top = torch.cat([noisy_noisy, noisy_clean], dim=1)
    bottom = torch.cat([torch.zeros_like(clean_clean), clean_clean], dim=1)
    return torch.cat([top, bottom], dim=0)[None, None]


def noise_blocks(x0: torch.Tensor, block: int, mask_id: int, gen: torch.Generator, eps: float = 1e-3,
                 prompt_frac: float = 0.0, clean_prefix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block forward noise of ``x0 [B, L]``: returns ``xt [B, L]`` and ``masked [B, L]`` (bool).

    Every block has its own ratio ``(1 - eps) * U(0, 1) + eps``; prompt rows (probability ``prompt_frac``) keep the
    first ``o_b ~ U{0..block-1}`` positions of every block ``b`` clean; ``clean_prefix [B]`` (function rows'
    prompt lengths, 0 elsewhere) keeps the first ``clean_prefix[r]`` positions of row ``r`` clean.
    """
    b, length = x0.shape
    nb = length // block
    p = (1 - eps) * torch.rand(b, nb, generator=gen) + eps
    masked = torch.rand(b, length, generator=gen) < p.repeat_interleave(block, dim=1)
    prompt_rows = torch.rand(b, generator=gen) < prompt_frac
    offsets = torch.randint(0, block, (b, nb), generator=gen).repeat_interleave(block, dim=1)
    in_block = (torch.arange(length) % block)[None, :]
    masked &= ~(prompt_rows[:, None] & (in_block < offsets))
    if clean_prefix is not None:
        masked &= torch.arange(length)[None, :] >= clean_prefix[:, None]
    xt = torch.where(masked, torch.full_like(x0, mask_id), x0)
    return xt, masked


def noisy_logits(model: torch.nn.Module, xt: torch.Tensor, x0: torch.Tensor, block: int) -> torch.Tensor:
    """Logits ``[B, L, V]`` of the noisy rows of one ``[xt ; x0]`` forward (see :func:`training_mask`)."""
    length = x0.shape[1]
    ids = torch.cat([xt, x0], dim=1)
    pos = torch.arange(length, device=x0.device).repeat(2)[None]
    mask = training_mask(length, block, x0.device)
    h = model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[:, :length]
    head = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
    return F.linear(h, head)


def block_diffusion_loss(model: torch.nn.Module, x0: torch.Tensor, block: int, mask_id: int, gen: torch.Generator,
                         eps: float, prompt_frac: float, clean_prefix: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean CE over masked positions of ``x0 [B, L]``: returns (loss, #correct masked predictions, #masked)."""
    xt, masked = noise_blocks(x0, block, mask_id, gen, eps, prompt_frac, clean_prefix)
    logits = noisy_logits(model, xt, x0, block).float()
    n = masked.sum().clamp(min=1)
    loss = F.cross_entropy(logits[masked], x0[masked], reduction="sum") / n
    with torch.no_grad():
        correct = (logits.argmax(-1)[masked] == x0[masked]).sum()
    return loss, correct, masked.sum()


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, mask_id: int, blocks: tuple[int, ...],
             ratios: tuple[float, ...] = (0.15, 0.5, 0.9), batch: int = 8, seed: int = 1234) -> dict[str, Any]:
    """Held-out masked-token accuracy and CE per block length and mask ratio (fixed seed, clean context of the
    previous blocks as at decoding): ``{"b{block}_mask_{ratio}": {accuracy, ce, tokens}}``."""
    model.eval()
    out: dict[str, Any] = {}
    for blk in blocks:
        for r in ratios:
            g = torch.Generator().manual_seed(seed)
            ok, n, ce_sum = 0, 0, 0.0
            for i in range(0, windows.size(0), batch):
                x0 = windows[i:i + batch]
                m = torch.rand(x0.shape, generator=g) < r
                xt = torch.where(m, torch.full_like(x0, mask_id), x0)
                logits = noisy_logits(model, xt, x0, blk).float()
                ce_sum += float(F.cross_entropy(logits[m], x0[m], reduction="sum"))
                ok += int((logits.argmax(-1)[m] == x0[m]).sum())
                n += int(m.sum())
            out[f"b{blk}_mask_{r}"] = {"accuracy": round(ok / max(1, n), 4), "ce": round(ce_sum / max(1, n), 4),
                                       "tokens": n}
    model.train()
    return out


def init_from_qwen3(src: str | Path, max_positions: int | None = None) -> tuple[torch.nn.Module, Any]:
    """An SDAR model (float32) with the Qwen3 checkpoint ``src``'s weights copied key for key, and its tokenizer.

    Raises :class:`MissingTokenError` when the tokenizer has no ``<|MASK|>`` and :class:`ConfigError` when the
    checkpoint is not a Qwen3 or its keys do not match the SDAR layout.
    """
    ar = load_model(src, dtype="float32")
    tok = load_tokenizer(src)
    c = ar.config
    if getattr(c, "model_type", None) != "qwen3":
        raise ConfigError(f"{str(src)!r} is a {getattr(c, 'model_type', '?')!r} model; fix: pass a Qwen3 checkpoint")
    mask = tok.convert_tokens_to_ids(MASK_TOKEN)
    if mask is None or mask == tok.unk_token_id:
        raise MissingTokenError(f"tokenizer of {str(src)!r} has no {MASK_TOKEN}; fix: use a tokenizer with one")
    rope = getattr(c, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    cfg = SDARConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=max_positions or c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=bool(c.tie_word_embeddings), rope_theta=theta, attention_bias=bool(c.attention_bias),
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        max_window_layers=c.num_hidden_layers, mask_token_id=int(mask),
    )
    model = SDARForCausalLM(cfg)
    src_state = ar.state_dict()
    if cfg.tie_word_embeddings:  # transformers lists the tied head; SDAR (tied) has no lm_head parameter
        src_state.pop("lm_head.weight", None)
    dst_keys = set(model.state_dict())
    if set(src_state) != dst_keys:
        raise ConfigError(f"Qwen3 and SDAR keys differ: only in Qwen3 {sorted(set(src_state) - dst_keys)[:5]}, "
                          f"only in SDAR {sorted(dst_keys - set(src_state))[:5]}")
    model.load_state_dict(src_state, strict=True)
    return model, tok


@torch.no_grad()
def sample_sdar_completion(model: torch.nn.Module, tok: Any, prompt: str, gen_length: int = 32, block: int = 16) -> str:
    """Greedy SDAR decoding (one token per step) of ``prompt`` with spiffy's decoder."""
    model.eval()
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    res = generate(model, ids, gen_length=gen_length, block_length=block, temperature=0.0, tokenizer=tok)
    model.train()
    return res.text[0] if res.text else tok.decode(res.tokens[0])


def load_start_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load ``path``'s weights into ``model`` (strict): a training state of this trainer (``train_state.pt``, its
    ``model`` entry) or an SDAR checkpoint directory. Raises :class:`ConfigError` when neither fits."""
    path = Path(path)
    if path.is_file():
        state = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(state, dict) or "model" not in state:
            raise ConfigError(f"--start-from {str(path)!r} is not a training state (no 'model' entry); fix: pass "
                              "a train_state.pt of spiffy.train.sdar or an SDAR checkpoint directory")
        weights = state["model"]
    elif (path / "config.json").is_file():
        src = load_model(path, dtype="float32")
        if getattr(src.config, "model_type", None) != "sdar":
            raise ConfigError(f"--start-from {str(path)!r} is a {src.config.model_type!r} model; fix: pass an SDAR "
                              "checkpoint")
        weights = src.state_dict()
    else:
        raise ConfigError(f"--start-from {str(path)!r} is neither a training state file nor a checkpoint directory")
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise ConfigError(f"--start-from {str(path)!r} does not match the architecture of --init; fix: start from "
                          f"a model adapted from the same Qwen3 checkpoint ({exc})") from exc


def save_weights(model: torch.nn.Module, tok: Any, final: str | Path, dtype: str) -> None:
    """Write ``model`` (a copy cast to ``dtype``) and ``tok`` as an SDAR checkpoint directory ``final`` and check it
    loads through the library loader."""
    export = type(model)(model.config)
    export.load_state_dict(model.state_dict())
    export = export.to(getattr(torch, dtype)).eval()
    export.config.torch_dtype = dtype
    gen_cfg = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
               "mask_token_id": int(model.config.mask_token_id)}
    save_checkpoint(export, final, tokenizer=tok, generation_config=gen_cfg)
    load_model(final, dtype="float32")


def load_snapshot(model: torch.nn.Module, out: Path, step: int) -> int:
    """Load the weights kept at ``step`` (``OUT/snapshots/step-STEP.pt``, written by ``--keep-every``) into
    ``model``; returns ``step``. Raises :class:`ConfigError` naming the snapshots there are."""
    path = out / "snapshots" / f"step-{step}.pt"
    if not path.is_file():
        kept = sorted(int(p.stem.split("-")[1]) for p in (out / "snapshots").glob("step-*.pt"))
        raise ConfigError(f"--export-step {step}: no snapshot {path}; kept steps: {kept or 'none'} (fix: pick one of "
                          "them, or train with --keep-every)")
    load_start_weights(model, path)
    return int(step)


def _parse_blocks(text: str) -> tuple[int, ...]:
    try:
        blocks = tuple(int(b) for b in text.split(","))
    except ValueError as exc:
        raise ConfigError(f"--blocks {text!r} is not a comma-separated list of integers; fix: e.g. --blocks 16,32") from exc
    if not blocks or any(b <= 0 for b in blocks):
        raise ConfigError(f"--blocks {text!r} must list positive block lengths")
    return blocks


def _teacher_sentence(args: argparse.Namespace, info: dict[str, Any] | None, fn_info: dict[str, Any] | None = None) -> str:
    """The model card's account of ``--start-from``, the teacher mix and the function rows (empty for a plain run)."""
    text = f", continuing from `{args.start_from}`" if args.start_from else ""
    if info:
        text += (f", {args.teacher_frac:.0%} of every batch's rows being {info['count']} windows of low-entropy text "
                 f"(corpus prefixes of {info['prefix'][0]}-{info['prefix'][1]} tokens continued greedily by "
                 f"`{Path(args.teacher).name}`)")
    if fn_info:
        text += (f", {args.functions_frac:.0%} of every batch's rows being function completions ({fn_info['corpus_rows']} "
                 f"documented functions of the training split: the def line and docstring as a clean prompt, the body "
                 f"(median {fn_info['answer_tokens_median']:.0f} tokens), then end-of-text to the window's end)")
        if fn_info.get("mbpp_rows"):
            text += (f", the function pool also holding {fn_info['mbpp_copies']} copies of {fn_info['mbpp_rows']} MBPP "
                     "tasks recast in HumanEval's shape (the task and its asserts as docstring and doctests, the "
                     "reference body as the answer; MBPP is therefore not a held-out benchmark for this model)")
    return text


def _eta_seconds(args: argparse.Namespace, step: int, wall_s: float) -> float:
    """Estimated training seconds left: the rest of the time budget (``--schedule time``) or of ``--steps``."""
    by_steps = (args.steps - step) * wall_s / max(1, step)
    if args.schedule == "time":
        return max(0.0, min(args.max_minutes * 60.0 - wall_s, by_steps))
    return max(0.0, by_steps)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run block-diffusion adaptation as configured by ``args``; returns the metrics dict."""
    common.set_threads(args.threads)
    common.seed_everything(args.seed)
    blocks = _parse_blocks(args.blocks)
    for blk in blocks:
        if args.context % blk:
            raise ConfigError(f"--context {args.context} is not a multiple of block {blk}; fix: --context k*{max(blocks)}")
    if args.functions_mbpp and args.functions_frac <= 0:
        raise ConfigError("--functions-mbpp adds rows to the function-row pool, which --functions-frac 0 never "
                          "samples; fix: set --functions-frac")
    if args.teacher and args.functions_frac > 0 and args.teacher_frac + args.functions_frac > 1:
        raise ConfigError(f"--teacher-frac {args.teacher_frac} + --functions-frac {args.functions_frac} exceed 1; fix: "
                          "lower one of them (the rest of every batch is corpus windows)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = init_from_qwen3(args.init, args.max_positions)
    if args.start_from:
        load_start_weights(model, args.start_from)
    _, train_s, held_s, info = prepare_data(args.corpus, out, len(tok), "qwen3", args.max_files, args.init,
                                            heldout_percent=args.heldout_percent)
    teacher_w, teacher_info = None, None
    if args.teacher:
        teacher_w, teacher_info = teacher.load_or_generate(
            out, args.teacher, train_s, args.teacher_windows, args.context,
            teacher.parse_prefix_range(args.teacher_prefix), args.seed, model.config.vocab_size,
            args.teacher_min_distinct)
        print(f"teacher windows {tuple(teacher_w.shape)} ({teacher_info['generation_s']} s to generate)", flush=True)
    fn_rows, fn_lens, fn_info = None, None, None
    if args.functions_frac > 0:
        fn_rows, fn_lens, fn_info = functions.load_or_build(
            out, tok, load_split(info.out_dir, "train"), args.context, args.functions_max_prompt,
            int(tok.eos_token_id), args.seed, args.functions_max_answer, args.functions_mbpp)
        print(f"function rows {fn_info}", flush=True)
    model.train()
    mask_id = int(model.config.mask_token_id)
    opt = common.adamw_decay_groups(model, args.lr, args.weight_decay)
    step, extra = common.maybe_resume(args, out, model, opt, {"wall_s": 0.0, "tokens": 0})
    n_params = sum(p.numel() for p in model.parameters())
    held_w = common.eval_windows(held_s, args.context, args.eval_windows)
    if "init_heldout" not in extra:
        extra["init_heldout"] = evaluate(model, held_w, mask_id, blocks)
        print(f"init heldout {extra['init_heldout']}", flush=True)
    loop = common.TrainLoop(args, out, model, opt, step, extra, "sdar", refresh_postfix=False)
    while loop.running():
        lr = loop.set_lr()
        gen = common.step_generator(args.seed, loop.step)
        x0 = common.sample_windows(train_s, args.batch_size, args.context, gen)
        if teacher_w is not None:
            x0 = teacher.mix_batch(x0, teacher_w, args.teacher_frac, gen)
        clean = None
        if fn_rows is not None:
            x0, clean = functions.mix_rows(x0, fn_rows, fn_lens, args.functions_frac, gen)
        blk = blocks[int(torch.randint(0, len(blocks), (1,), generator=gen))]
        loss, correct, n = block_diffusion_loss(model, x0, blk, mask_id, gen, args.eps, args.prompt_frac, clean)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loop.end_step(loss, lr, x0.numel())
        step = loop.step
        if loop.should_log():
            loop.log({"step": step, "loss": lv, "ema_loss": loop.ema, "lr": lr, "block": blk,
                      "masked_acc": int(correct) / max(1, int(n)), "wall_s": extra["wall_s"],
                      "eta_min": round(_eta_seconds(args, step, float(extra["wall_s"])) / 60, 1)})
        loop.maybe_checkpoint()
        if args.eval_every and step % args.eval_every == 0:
            ev = evaluate(model, held_w, mask_id, blocks)
            loop.log({"step": step, "wall_s": extra["wall_s"], "heldout": ev})
            print(f"\nstep {step} heldout {ev}", flush=True)
    loop.finish()
    step = loop.step
    if args.export_step is not None:
        step = load_snapshot(model, out, args.export_step)
    ev = evaluate(model, held_w, mask_id, blocks)
    samples = {p: sample_sdar_completion(model, tok, p, args.sample_tokens, min(blocks)) for p in common.SAMPLE_PROMPTS}
    metrics = {
        "model": "tiny-sdar", "init": str(args.init), "start_from": args.start_from, "steps": step, "planned_steps": args.steps,
        "trained_steps": loop.step, "exported_snapshot": args.export_step,
        "finished": loop.finished, "wall_s_total": round(float(extra["wall_s"]), 1),
        "invocations": extra.get("invocations", []), "train_tokens_seen": int(extra["tokens"]),
        "heldout_masked": ev, "heldout_masked_init": extra.get("init_heldout"), "params": n_params,
        "config": {"hidden": model.config.hidden_size, "layers": model.config.num_hidden_layers,
                   "heads": model.config.num_attention_heads, "kv_heads": model.config.num_key_value_heads,
                   "context": args.context, "vocab": len(tok), "tie_word_embeddings": model.config.tie_word_embeddings,
                   "mask_token_id": mask_id},
        "train": {"batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup, "seed": args.seed,
                  "schedule": args.schedule, "max_minutes": args.max_minutes, "blocks": list(blocks),
                  "eps": args.eps, "prompt_frac": args.prompt_frac, "weight_decay": args.weight_decay,
                  "teacher": teacher_info and {**teacher_info, "frac": args.teacher_frac},
                  "functions": fn_info and {**fn_info, "frac": args.functions_frac,
                                            "max_prompt": args.functions_max_prompt,
                                            "max_answer": args.functions_max_answer,
                                            "mbpp_copies": args.functions_mbpp}},
        "corpus": {"python": info.python_version, "files_train": info.n_files_train,
                   "files_heldout": info.n_files_heldout, "train_tokens": len(train_s), "heldout_tokens": len(held_s)},
        "save_dtype": args.save_dtype, "samples_greedy": samples, "torch": torch.__version__,
    }
    body = (f"SDAR-architecture block-diffusion LM (spiffy.models.sdar.SDARForCausalLM, block-causal), "
            f"{n_params/1e6:.2f}M parameters, initialised from the Qwen3 checkpoint `{Path(args.init).name}` (same "
            f"tokenizer, mask token {MASK_TOKEN} = {mask_id}) and trained with the block-diffusion objective "
            f"(blocks {', '.join(map(str, blocks))}, +{args.prompt_frac:.0%} prompt rows) for {loop.step} steps "
            f"({metrics['wall_s_total']/60:.1f} min, 1 CPU thread) on the Python {info.python_version} standard "
            f"library's .py sources{_teacher_sentence(args, teacher_info, fn_info)}. "
            + (f"These are the weights of its step-{step} snapshot, the one chosen on "
               f"validation prompts. " if args.export_step is not None else "")
            + f"Weights stored in {args.save_dtype}. "
            f"Reproduce with `{args.card_script}`.")
    final = out / "model"
    save_weights(model, tok, final, args.save_dtype)
    metrics["size_mb"] = round(common.file_size_mb(final), 2)
    common.write_cards(final, out, "tiny-sdar (spiffy demo block-diffusion dLLM)", metrics, body)
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("samples_greedy", "invocations")}, indent=2))
    for p, s in samples.items():
        print(f"--- {p!r} ->\n{p}{s}")
    return metrics


def build_parser() -> argparse.ArgumentParser:

    p = argparse.ArgumentParser(description="Adapt spiffy's tiny Qwen3 into an SDAR block-diffusion LM.")
    p.add_argument("--out", required=True, help="run dir (train_state.pt, logs; final model in OUT/model)")
    p.add_argument("--init", default=str(embedded_models_dir() / "tiny-qwen3"),
                   help="Qwen3 checkpoint to initialise from (its tokenizer is reused; default: the embedded tiny Qwen3)")
    common.add_corpus_arguments(p)
    p.add_argument("--context", type=int, default=256, help="training window length (a multiple of every block)")
    p.add_argument("--max-positions", type=int, default=None, help="config max_position_embeddings (default: init's)")
    p.add_argument("--blocks", default="16,32", help="block lengths, one drawn per step (comma-separated)")
    common.add_optim_arguments(p, steps=600)
    p.add_argument("--eps", type=float, default=1e-3, help="minimum mask probability")
    p.add_argument("--prompt-frac", type=float, default=0.2, help="fraction of rows with a clean prefix in every block")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--start-from", default=None, metavar="STATE|DIR",
                   help="continue from these weights (a train_state.pt of this trainer or an SDAR checkpoint) "
                        "instead of the Qwen3 copy; fresh optimizer and schedule")
    p.add_argument("--teacher", default=None, metavar="AR_DIR",
                   help="mix in windows of corpus prefixes continued greedily by this AR model (same tokenizer)")
    p.add_argument("--teacher-windows", type=int, default=2048, help="number of teacher windows generated")
    p.add_argument("--teacher-prefix", default="16,160", help="corpus prefix length range MIN,MAX of teacher windows")
    p.add_argument("--teacher-min-distinct", type=float, default=0.0,
                   help="drop teacher windows whose last 64 tokens have a lower distinct-token ratio (loops); 0: keep all")
    p.add_argument("--teacher-frac", type=float, default=0.5, help="fraction of every batch's rows from the teacher")
    p.add_argument("--functions-frac", type=float, default=0.0,
                   help="fraction of every batch's rows that are function completions (def line + docstring as a "
                        "clean prompt, the body, then end-of-text to the window's end; spiffy.train.functions)")
    p.add_argument("--export-step", type=int, default=None, metavar="N",
                   help="export the weights of the step-N snapshot (--keep-every) instead of the last step's, e.g. "
                        "the one chosen on validation prompts; with --resume on a finished run it only re-exports")
    p.add_argument("--functions-mbpp", type=int, default=0, metavar="K",
                   help="add K copies of the MBPP tasks, recast as HumanEval-shaped function completions "
                        "(spiffy.train.mbpp_rows), to the function-row pool (default 0: none)")
    p.add_argument("--functions-max-prompt", type=int, default=160, help="longest function prompt kept (tokens)")
    p.add_argument("--functions-max-answer", type=int, default=0,
                   help="longest function body kept (tokens; 0: all, bodies longer than the window are cut)")
    p.add_argument("--card-script", default="scripts/train_tiny_sdar.sh", help="reproduce script named in the card")
    common.add_run_arguments(p, max_minutes=90.0, ckpt_every=50)
    common.add_eval_arguments(p)
    common.add_output_arguments(p)
    p.add_argument("--sample-tokens", type=int, default=32, help="tokens per sample completion in the report")
    return p


def main(argv: list[str] | None = None) -> int:
    train(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
