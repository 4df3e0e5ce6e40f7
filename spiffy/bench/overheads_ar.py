"""``spiffy bench overheads``: DDTree's builder and compile against the reference's, and plain AR against a bare loop.

Two questions the per-stage figures of :mod:`spiffy.bench.overheads` leave open:

* **Builder and compile vs the reference** (:func:`measure_builders`): on identical ``[L, V]`` drafter logits
  (``L = 15``: a DFlash block of 16 drafts 15 positions), at the small vocabulary of the embedded pair
  (``V = 4,096``) and Qwen3's (``V = 151,936``), per budget and for two kinds of logits: ``peaked``
  (:func:`~spiffy.bench.synthetic.synthetic_draft_logits`, confidence fading with depth) and ``flat`` (N(0, 1.5)
  noise: a weak drafter, the hard case for spiffy's bound). spiffy's stages are the generation loop's own: the
  method's ``build_tree`` (temperature, log-softmax, :func:`~spiffy.arspec.tree.build_ddtree`) and
  :func:`~spiffy.arspec.stages.compile_round`; the reference's are :mod:`spiffy.bench.ddtree_reference`'s
  re-expression (its builder: top-k, log-normaliser and heap; its compile into buffers allocated once). The
  reference's ``build_ddtree_tree`` also draws the ancestor-visibility matrix, which spiffy draws in its compile:
  here it is counted in the reference's compile, so each stage does the same work on both sides (the JSON keeps
  it apart). Interleaved; medians of the repeats (minima kept in JSON).
* **Plain AR's per-token overhead** (:func:`measure_ar_overhead`): decode time per token of
  :func:`~spiffy.arspec.speculative_generate` with ``method="ar"`` against a bare loop over the same target (the
  transformers model with its ``DynamicCache``, one token per forward, argmax, nothing else), and against the same
  AR run forced through the tree stages (build, compile, walk and commit of empty trees: what every AR round paid
  before rounds that draft nothing took the plain path). Same prompt, same tokens (checked), interleaved, medians.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from transformers import DynamicCache

import spiffy.arspec.batch as ar_batch
from spiffy.arspec.config import ARSpecConfig
from spiffy.arspec.generate import speculative_generate
from spiffy.arspec.methods import AR, DDTREE
from spiffy.arspec.stages import RoundBuffers, compile_round
from spiffy.bench.ddtree_reference import ReferenceCompiler, reference_build, reference_visibility
from spiffy.bench.synthetic import synthetic_draft_logits
from spiffy.embedded import embedded_model_path, is_embedded_available
from spiffy.models import load_target, make_tiny_target
from spiffy.models.cache import hf_cache

__all__ = ["BUILDER_VOCABS", "BUILDER_BUDGETS", "LOGIT_KINDS", "draft_logits", "measure_builders",
           "measure_ar_overhead", "markdown_builders", "markdown_ar_overhead"]

BUILDER_VOCABS: tuple[int, ...] = (4_096, 151_936)
BUILDER_BUDGETS: tuple[int, ...] = (16, 64, 256)
LOGIT_KINDS: tuple[str, ...] = ("peaked", "flat")
DRAFT_DEPTH = 15


def draft_logits(kind: str, depth: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[depth, vocab]`` float32 drafter logits of one kind (module docstring)."""
    if kind == "peaked":
        return synthetic_draft_logits(depth, vocab, seed=seed)
    if kind == "flat":
        return torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)) * 1.5
    raise ValueError(f"unknown logits kind {kind!r}; use one of {LOGIT_KINDS}")


def _ms(values: Sequence[float]) -> float:
    return 1e3 * statistics.median(values)


def _paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for tok, par in zip(tokens, parents):
        paths.append((paths[par] if par >= 0 else ()) + (tok,))
    return set(paths)


def measure_builders(vocabs: Sequence[int] = BUILDER_VOCABS, budgets: Sequence[int] = BUILDER_BUDGETS,
                     depth: int = DRAFT_DEPTH, repeats: int = 9, context: int = 256,
                     kinds: Sequence[str] = LOGIT_KINDS) -> dict[str, Any]:
    """spiffy's tree build and compile against the reference's, per vocabulary, logits kind and budget."""
    rows: list[dict[str, Any]] = []
    root = 1
    valid = torch.ones(1, context, dtype=torch.bool)
    for vocab in vocabs:
        for kind in kinds:
            logits = draft_logits(kind, depth, int(vocab))
            for budget in budgets:
                config = ARSpecConfig(method=DDTREE.name, budget=int(budget))
                buffers = RoundBuffers.allocate(1, 1 + int(budget))
                compiler = ReferenceCompiler(int(budget), context + 1 + int(budget))
                times: dict[str, list[float]] = {k: [] for k in ("build", "compile", "ref_build", "ref_visibility",
                                                                 "ref_compile")}
                same = True
                for _ in range(max(1, repeats)):
                    fresh = logits.clone()  # freshly written logits, as right after the drafter's forward
                    t0 = time.perf_counter()
                    tree = config.spec.build_tree(config, fresh, context)
                    t1 = time.perf_counter()
                    compile_round([tree], [(root, context)], valid, torch.float32, buffers)
                    t2 = time.perf_counter()
                    fresh = logits.clone()
                    t3 = time.perf_counter()
                    ref = reference_build(fresh, int(budget))
                    t4 = time.perf_counter()
                    vis = reference_visibility(ref)
                    t5 = time.perf_counter()
                    compiler.compile(root, context, ref, vis)
                    t6 = time.perf_counter()
                    for key, seconds in zip(times, (t1 - t0, t2 - t1, t4 - t3, t5 - t4, t6 - t5)):
                        times[key].append(seconds)
                    same = same and _paths(tree.tokens.tolist(), tree.parents.tolist()) == ref.sequences()
                med = {k: _ms(v) for k, v in times.items()}
                ref_compile = med["ref_visibility"] + med["ref_compile"]  # where spiffy draws the mask
                ours, theirs = med["build"] + med["compile"], med["ref_build"] + ref_compile
                rows.append({"vocab": int(vocab), "logits": kind, "budget": int(budget), "nodes": tree.num_nodes,
                             "build_ms": med["build"], "compile_ms": med["compile"], "total_ms": ours,
                             "reference_build_ms": med["ref_build"], "reference_visibility_ms": med["ref_visibility"],
                             "reference_compile_ms": ref_compile, "reference_total_ms": theirs,
                             "build_speedup": med["ref_build"] / med["build"],
                             "compile_speedup": ref_compile / med["compile"],
                             "total_speedup": theirs / ours, "same_tree": same,
                             "min_ms": {k: 1e3 * min(v) for k, v in times.items()}})
    return {"depth": depth, "context": context, "repeats": repeats, "statistic": "median", "rows": rows}


@contextmanager
def _tree_stages_forced() -> Iterator[None]:
    """Every AR round through the tree stages (empty trees), as before plain rounds skipped them."""
    plain = ar_batch._plain_round
    ar_batch._plain_round = lambda depths: False  # type: ignore[assignment]
    try:
        yield
    finally:
        ar_batch._plain_round = plain  # type: ignore[assignment]


def _bare_loop(target: nn.Module, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """The bare decode loop: prefill, then one token per forward on the model's own cache, argmax. Returns the tokens
    and the decode seconds per token (after the prefill's)."""
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        out = target(input_ids=torch.tensor([prompt]), **hf_cache(cache), use_cache=True)
        token = out.logits[:, -1].argmax(dim=-1)
        produced = [int(token)]
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            out = target(input_ids=token.view(1, 1), **hf_cache(cache), use_cache=True)
            token = out.logits[:, -1].argmax(dim=-1)
            produced.append(int(token))
        return produced, (time.perf_counter() - t0) / max(1, tokens - 1)


def _spiffy_ar(target: nn.Module, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    res = speculative_generate(target, None, prompt, ARSpecConfig(method=AR.name, max_new_tokens=tokens,
                                                                  stop_token_ids=()))
    return list(res.tokens), (res.seconds - res.prefill_seconds) / max(1, res.rounds)


def _ar_target(directory: Path) -> tuple[nn.Module, str]:
    """The embedded AR target (float32), else a tiny random Qwen3 written into ``directory``."""
    if is_embedded_available("ar-target"):
        return load_target(embedded_model_path("ar-target"), torch.float32), "embedded ar-target"
    path = make_tiny_target(directory / "target", seed=0, with_tokenizer=False)
    return load_target(path, torch.float32, "cpu"), "tiny random Qwen3"


def measure_ar_overhead(tokens: int = 64, repeats: int = 5, prompt_len: int = 16,
                        target: nn.Module | None = None) -> dict[str, Any]:
    """Decode ms per token: bare loop, spiffy's AR, spiffy's AR through the tree stages (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        name = "given target"
        if target is None:
            target, name = _ar_target(Path(tmp))
        vocab = int(target.config.vocab_size)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        variants = {"bare loop": _bare_loop, "spiffy ar": _spiffy_ar, "spiffy ar, tree stages forced": None}
        per_token: dict[str, list[float]] = {v: [] for v in variants}
        outputs: dict[str, list[int]] = {}
        for _ in range(max(1, repeats) + 1):  # the first pass warms up and is not counted
            for variant, run in variants.items():
                if run is None:
                    with _tree_stages_forced():
                        produced, seconds = _spiffy_ar(target, prompt, tokens)
                else:
                    produced, seconds = run(target, prompt, tokens)
                outputs.setdefault(variant, produced)
                if len(outputs) == len(variants) and outputs[variant] != produced:
                    raise AssertionError(f"{variant} produced different tokens across repeats")
                per_token[variant].append(seconds)
        for values in per_token.values():
            del values[0]
        bare = _ms(per_token["bare loop"])
        rows = [{"variant": v, "ms_per_token": _ms(t), "min_ms_per_token": 1e3 * min(t),
                 "overhead_ms_per_token": _ms(t) - bare, "ratio_to_bare": _ms(t) / bare} for v, t in per_token.items()]
        first = outputs["bare loop"]
        return {"model": name, "vocab": vocab, "parameters": sum(p.numel() for p in target.parameters()),
                "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
                "attention": str(getattr(target.config, "_attn_implementation", None)), "tokens": tokens,
                "prompt_tokens": prompt_len, "repeats": repeats, "statistic": "median", "rows": rows,
                "identical": all(out == first for out in outputs.values())}


def markdown_builders(res: dict[str, Any]) -> list[str]:
    """The builder / compile comparison as Markdown lines."""
    lines = ["", f"## DDTree builder and compile vs the reference (depth {res['depth']}, context {res['context']}, "
             f"median of {res['repeats']})", "",
             "speedup = reference ms / spiffy ms (above 1: spiffy is faster). The reference's compile includes its "
             "visibility matrix (its builder draws it; spiffy's compile draws the mask).", "",
             "| V | logits | budget | spiffy build ms | reference build ms | speedup | spiffy compile ms | "
             "reference compile ms | speedup | spiffy total ms | reference total ms | total speedup | same tree |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['vocab']:,} | {r['logits']} | {r['budget']} | {r['build_ms']:.3f} | "
                     f"{r['reference_build_ms']:.3f} | {r['build_speedup']:.2f}x | {r['compile_ms']:.3f} | "
                     f"{r['reference_compile_ms']:.3f} | {r['compile_speedup']:.2f}x | {r['total_ms']:.3f} | "
                     f"{r['reference_total_ms']:.3f} | {r['total_speedup']:.2f}x | {'yes' if r['same_tree'] else 'NO'} |")
    return lines


def markdown_ar_overhead(res: dict[str, Any]) -> list[str]:
    """Plain AR's per-token overhead as Markdown lines."""
    lines = ["", f"## Plain AR against a bare decode loop ({res['model']}, V = {res['vocab']:,}, "
             f"{res['parameters'] / 1e6:.1f}M parameters, {res['dtype']}, {res['attention']}; {res['tokens']} tokens "
             f"after a {res['prompt_tokens']}-token prompt, median of {res['repeats']})", "",
             "| variant | decode ms/token | overhead ms/token vs bare | ratio | identical tokens |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['variant']} | {r['ms_per_token']:.3f} | {r['overhead_ms_per_token']:+.3f} | "
                     f"{r['ratio_to_bare']:.3f}x | {'yes' if res['identical'] else 'NO'} |")
    return lines
