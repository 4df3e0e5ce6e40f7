"""``spiffy generate``: decode one prompt (or a batch: ``--prompt`` repeated) with a diffusion LM (baseline or Spiffy), or an AR target (DDTree).

dLLM mode: ``spiffy generate --model DIR --prompt TEXT [decoding flags] [--graph FILE --budget D] [--json]``.
AR mode: ``spiffy generate --target DIR [--drafter DIR --method ar|dflash|ddtree --max-new-tokens N] ...``
(delegated to :func:`spiffy.cli.generate_ar.run_generate`). Flags shared by both modes are defined here once:
``--prompt --chat --json --dtype --device --budget --temperature --top-p --top-k --seed``.

:func:`add_decoding_arguments` / :func:`config_from_args` are reusable by other subcommands (``spiffy calibrate``)
that take the same decoding flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from spiffy.api import generate
from spiffy.arspec.config import DEFAULT_BUDGET
from spiffy.cli.generate_ar import EMBEDDED_DLLM_METHODS, add_ar_arguments, run_generate
from spiffy.cli.placement import add_placement_arguments, placement_kwargs
from spiffy.decoding import DecodeConfig
from spiffy.embedded import compatible_shipped_graph, default_dllm_path, resolve_graph_argument
from spiffy.errors import ConfigError
from spiffy.models import load_model, load_tokenizer, prompt_token_ids
from spiffy.selfspec.rivals import parse_rival, rival_graph
from spiffy.selfspec.pruning import SCORES
from spiffy.selfspec.graph import load_graph
from spiffy.torch_utils import model_device

DESCRIPTION = """\
Decode one prompt, or several as one batch (repeat --prompt; with --json one JSON object per prompt, in order).

  dLLM mode:  spiffy generate --model DIR --prompt TEXT [decoding flags] [--graph FILE --budget D] [--json]
  AR mode:    spiffy generate --target DIR [--drafter DIR --method ar|dflash|ddtree --max-new-tokens N] ...

With --graph (a draft graph from `spiffy calibrate`) the diffusion LM decodes with Spiffy self-speculation:
the same tokens as the baseline, fewer model calls. --json prints one JSON object (tokens, text, nfe, seconds,
steps, config) on stdout; the progress bar goes to stderr.
"""

#: flags defined here and shared with AR mode (add_ar_arguments skips them)
SHARED_FLAGS: tuple[str, ...] = (
    "--prompt", "--chat", "--json", "--dtype", "--device", "--budget", "--temperature", "--top-p", "--top-k", "--seed",
)


def add_decoding_arguments(parser: argparse.ArgumentParser, *, sampling: bool = True) -> argparse.ArgumentParser:
    """Add the dLLM decoding flags (one per :class:`~spiffy.decoding.DecodeConfig` field).

    With ``sampling=False`` the flags shared with AR mode (``--temperature --top-p --top-k --seed``) are left out
    (a caller that defines them itself).
    """
    g = parser.add_argument_group("decoding (diffusion LMs)")
    g.add_argument("--gen-length", type=int, default=128, metavar="N", help="number of generated positions (default 128)")
    g.add_argument("--block-length", type=int, default=None, metavar="B",
                   help="positions per block; must divide --gen-length (default: one block = gen length; SDAR: 4)")
    g.add_argument("--steps", type=int, default=None, metavar="S",
                   help="total denoising steps, split evenly over blocks (default: gen length = one token per step)")
    g.add_argument("--threshold", type=float, default=None, metavar="TAU",
                   help="dynamic unmasking: every masked position with confidence >= TAU per step (0 < TAU <= 1)")
    g.add_argument("--remasking", default="low_confidence", choices=("low_confidence", "random"),
                   help="which positions to unmask (LLaDA): most confident or random (default low_confidence)")
    g.add_argument("--cache", default="none", choices=("none", "prefix", "dual"),
                   help="K/V cache mode (Fast-dLLM): none, prefix or dual (default none; SDAR always caches)")
    g.add_argument("--cfg-scale", type=float, default=0.0, metavar="W", help="classifier-free guidance scale (LLaDA; 0 = off)")
    g.add_argument("--logits-eos-inf", action="store_true", help="LLaDA: forbid EOS proposals (EOS logit = -inf)")
    g.add_argument("--confidence-eos-eot-inf", action="store_true",
                   help="LLaDA: lower the confidence of EOS/EoT proposals (official semantics)")
    g.add_argument("--alg", default=None, choices=("origin", "maskgit_plus", "topk_margin", "entropy"),
                   help="Dream unmasking rule (default: maskgit_plus, or origin with --remasking random)")
    g.add_argument("--alg-temp", type=float, default=None, metavar="T", help="Dream: sample positions with softmax(confidence / T)")
    g.add_argument("--eps", type=float, default=1e-3, help="Dream: final timestep of linspace(1, eps, steps + 1) (default 1e-3)")
    g.add_argument("--strategy", default=None,
                   choices=("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded"),
                   help="SDAR remasking strategy (default: dynamic with --threshold, else static)")
    if sampling:
        add_sampling_arguments(parser)
    return parser


def add_sampling_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--temperature --top-p --top-k --seed`` (shared with AR mode)."""
    g = parser.add_argument_group("sampling (both modes)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (0 = greedy, default)")
    g.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass in (0, 1] (default off)")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="top-k sampling (default off; 0 = off)")
    g.add_argument("--seed", type=int, default=0, metavar="K", help="seed of every random draw (default 0)")
    return parser


def config_from_args(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """``(DecodeConfig, extra overrides)`` from parsed decoding flags; extras are family-specific (``strategy``)."""
    top_p = getattr(args, "top_p", None)
    top_k = getattr(args, "top_k", None)
    cfg = DecodeConfig(
        gen_length=args.gen_length,
        block_length=args.block_length,
        steps=args.steps,
        threshold=args.threshold,
        remasking=args.remasking,
        temperature=float(getattr(args, "temperature", 0.0) or 0.0),
        cfg_scale=args.cfg_scale,
        logits_eos_inf=bool(args.logits_eos_inf),
        confidence_eos_eot_inf=bool(args.confidence_eos_eot_inf),
        cache=args.cache,
        seed=getattr(args, "seed", 0),
        alg=args.alg,
        alg_temp=args.alg_temp,
        eps=args.eps,
        top_p=None if top_p is None or float(top_p) >= 1.0 else float(top_p),
        top_k=None if not top_k else int(top_k),
    )
    extra: dict[str, Any] = {}
    if getattr(args, "strategy", None) is not None:
        extra["strategy"] = args.strategy
    return cfg, extra


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Create the ``generate`` subparser."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text with a diffusion LM (baseline or Spiffy) or an AR target (DDTree)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, metavar="DIR|ID",
                        help="diffusion LM checkpoint (LLaDA, Dream or SDAR): a directory or a Hub id ORG/NAME[@REVISION]")
    parser.add_argument("--prompt", action="append", default=None,
                        help="prompt text, tokenized as is (see --chat); must not be empty. Repeat it to decode several "
                             "prompts as one batch (with --json: one JSON object per prompt, in order)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (tokens, text, nfe, seconds, steps, config) instead of the text")
    parser.add_argument("--dtype", default=None,
                        help="model dtype: float32 (CPU default), float64, bfloat16, float16 or auto (config)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--graph", default=None, metavar="FILE|NAME|auto",
                        help="calibrated draft graph (JSON): Spiffy speculative decoding, same tokens, fewer forwards; "
                             "a file, the name of a graph shipped with the model (e.g. tiny-sdar-s1), or auto (the "
                             "shipped graph calibrated for these decoding flags), or freedave:K (FreeDave's top-k chain "
                             "with K draft steps, no calibration), or ssd:K (SSD's verification tree, K states per "
                             "forward)")
    parser.add_argument("--budget", type=int, default=None, metavar="D",
                        help="draft nodes kept per step with --graph (default: the D* the graph was tuned for, else 3); "
                             f"AR mode: tree nodes per round (default {DEFAULT_BUDGET}; 0 = no drafts)")
    parser.add_argument("--score", default=None, choices=SCORES,
                        help="pruning score that picks the --budget nodes (default: the one the graph was calibrated "
                             "for, else gm)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_placement_arguments(parser)
    add_decoding_arguments(parser)
    add_ar_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


def _load_graph(path: str) -> Any:
    return load_graph(path)


def run(args: argparse.Namespace) -> int:
    """Run ``spiffy generate``; returns the exit status."""
    prompts = args.prompt if isinstance(args.prompt, list) else [args.prompt or ""]
    if not prompts or not all(prompts):  # the API refuses an empty prompt too (decoding.base / ar)
        raise ConfigError("the prompt is empty; fix: pass --prompt TEXT with at least one character")
    args.prompt = prompts
    if getattr(args, "target", None) or getattr(args, "method", None) in EMBEDDED_DLLM_METHODS:
        return int(run_generate(args) or 0)
    if not args.model:  # default: the embedded tiny dLLM shipped with the package
        args.model = default_dllm_path(" or --target DIR for AR mode")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    placement = placement_kwargs(args)
    model = load_model(args.model, dtype=args.dtype, device=device, **placement)
    if placement:  # inputs go where the model's embedding computes
        device = str(model_device(model))
    tokenizer = load_tokenizer(args.model)
    batch = [prompt_token_ids(tokenizer, p, chat=args.chat, require_template=True) for p in prompts]
    cfg, extra = config_from_args(args)
    graph = None
    if args.graph:
        rival = parse_rival(args.graph)
        if rival is not None:  # FreeDave / SSD: the whole chain or tree verified per forward
            graph = rival_graph(model, cfg, *rival, **extra)
            args.budget = len(graph) if args.budget is None else args.budget
        elif args.graph == "auto":
            args.graph = str(compatible_shipped_graph(model, args.model, cfg, **extra))
        else:
            args.graph = str(resolve_graph_argument(args.graph, args.model))
        if graph is None:
            graph = _load_graph(args.graph)
    if graph is None and args.budget is not None:
        print("spiffy generate: note: --budget has no effect without --graph", file=sys.stderr)
    if graph is None and args.score is not None:
        print("spiffy generate: note: --score has no effect without --graph", file=sys.stderr)
    input_ids, attention_mask = _left_pad(batch, tokenizer)
    res = generate(
        model,
        input_ids,
        cfg,
        attention_mask=attention_mask,
        tokenizer=tokenizer,
        graph=graph,
        budget=args.budget,
        score=args.score,
        progress=not args.no_progress and len(batch) == 1,
        **extra,
    )
    for r, ids in enumerate(batch):
        _print_row(args, res, r, ids, model, device, graph)
    return 0


def _left_pad(batch: list[list[int]], tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, P]`` left-padded ids and their 0/1 mask (``None`` when every prompt has the same length)."""
    width = max(len(ids) for ids in batch)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = int(pad_id) if pad_id is not None else 0  # padded rows are masked out: the id never matters
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, ids in enumerate(batch):
        input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[r, width - len(ids) :] = 1
    return input_ids, None if bool(mask.all()) else mask


def _print_row(args: argparse.Namespace, res: Any, r: int, ids: list[int], model: Any, device: str, graph: Any) -> None:
    """Print row ``r`` of a (possibly batched) result: text, or one JSON object."""
    text = res.text[r] if res.text else ""
    rows = res.stats.get("rows") if isinstance(res.stats, dict) else None
    row_stats = rows[r] if rows else res.to_dict()["stats"]
    nfe = int(row_stats.get("nfe", res.nfe)) if rows else res.nfe
    steps = int(row_stats.get("steps", res.steps)) if rows else res.steps
    if args.json:
        payload = {
            "tokens": res.tokens[r],
            "text": text,
            "nfe": nfe,
            "seconds": res.seconds,
            "steps": steps,
            "batch_size": len(res.tokens),
            "batch_nfe": res.nfe,
            "family": res.family,
            "prompt_tokens": len(ids),
            "model": str(args.model),
            "graph": args.graph,
            "budget": args.budget,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "device": str(device),
            "config": res.config.to_dict() if res.config is not None else None,
            "stats": row_stats,
        }
        print(json.dumps(payload))
    else:
        print(text)
        mode = "spiffy" if graph is not None else "baseline"
        print(f"[{res.family} {mode}] {len(res.tokens[r])} positions, {steps} steps, {nfe} NFE, "
              f"{res.seconds:.2f}s", file=sys.stderr)
