"""Exactness at real size (issue 38): random-weight LLaDA-8B, SDAR-8B and Qwen3-8B with a DFlash drafter, per mode.

For each model and mode (``float32`` with TF32 off; ``bfloat16``; ``bfloat16`` in :func:`spiffy.batch_invariant`
mode) it decodes one prompt with the baseline and the speculative path (Spiffy on FreeDave's chain graph, 3 states;
DDTree@16 and DFlash against AR), and a batch of two ragged prompts against each prompt alone, and reports per pair:
identical or not, the first differing position, and for every differing pair the near-tie proof of the one rule of
:mod:`spiffy.bench.fidelity` (``near_tie``, ``proof``): a batched row against its prompt alone
(:mod:`spiffy.bench.batch_fidelity`), Spiffy against the baseline and DFlash / DDTree against AR
(:mod:`spiffy.bench.spec_fidelity`). The mode's cost is the ratio of its seconds per generated token to bfloat16's
(AR also with the mode's stages unfused: what :mod:`spiffy.fused_stages` saves). Before any model, the mode's
arithmetic is checked on the device (:func:`exact_stages_check`). ``scripts/gpu_run.py`` runs it on a GPU (section
``exactness``); ``small=True`` builds the same architectures at toy size (its CPU self-check).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn.functional as F

from spiffy.api import generate
from spiffy.arspec import ARSpecConfig, DFlashDrafter, SamplingConfig, ddtree_generate
from spiffy.batch_invariance import batch_invariant, exact_sum
from spiffy.bench import gpu_costs
from spiffy.bench.batch_fidelity import explain_dllm_batch_row
from spiffy.bench.batch_fidelity_ar import explain_ar_batch_row
from spiffy.bench.common import first_mismatch
from spiffy.bench.spec_fidelity import prove_ar_divergence, prove_dllm_divergence
from spiffy.decoding import DecodeConfig
from spiffy.exact_linear import WeightGrid, activation_stage, digit_sums_stage, exact_linear, finish_stage
from spiffy.fused_stages import FELL_BACK, compiled_stages, run_stage
from spiffy.selfspec.freedave import chain_graph_for

#: (label, dtype, batch-invariant mode)
MODES = (("float32", torch.float32, False), ("bfloat16", torch.bfloat16, False),
         ("bfloat16 batch-invariant", torch.bfloat16, True))
DLLMS = (("LLaDA-8B", "GSAI-ML--LLaDA-8B-Instruct", "prefix"), ("SDAR-8B", "JetLM--SDAR-8B-Chat", "prefix"))



def _pair(name: str, a: list[int], b: list[int], proof: Any = None) -> dict[str, Any]:
    first = first_mismatch(list(a), list(b))
    row: dict[str, Any] = {"pair": name, "identical": first is None, "first_divergence": first}
    if first is not None:
        row["near_tie"] = None if proof is None else bool(proof.near_tie)
        row["proof"] = None if proof is None else proof.to_dict()
    return row


def _prompts(vocab: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, min(vocab, 30000), (n,), generator=g).tolist() for n in lengths]


def dllm_exactness(model: torch.nn.Module, device: torch.device, small: bool, invariant: bool) -> dict[str, Any]:
    """Spiffy vs baseline (one prompt), batched rows vs alone (two prompts), both with and without a graph."""
    gen = 16 if small else 64
    cfg = DecodeConfig(gen_length=gen, block_length=gen // 2, steps=gen, cache="prefix")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    prompts = _prompts(vocab, (6, 9) if small else (48, 64))
    graph = chain_graph_for(model, cfg, 3)
    rows = []
    with batch_invariant(invariant, model=model):
        one = torch.tensor([prompts[0]], device=device)
        # untimed first: one block of each path (the mode's stages compile, its weight copies are made)
        short = DecodeConfig(gen_length=gen // 2, block_length=gen // 2, steps=gen // 2, cache="prefix")
        generate(model, one, short)
        generate(model, one, short, graph=graph, budget=3)
        base, t_base = gpu_costs.timed(device, lambda: generate(model, one, cfg))
        spec, t_spec = gpu_costs.timed(device, lambda: generate(model, one, cfg, graph=graph, budget=3))
        proof = None
        if base.tokens[0] != spec.tokens[0]:
            proof = prove_dllm_divergence(model, prompts[0], cfg, graph=graph, budget=3)
        rows.append(_pair("spiffy vs baseline", base.tokens[0], spec.tokens[0], proof))
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        batched = generate(model, ids, cfg, attention_mask=mask, seeds=[0, 0])
        for r, p in enumerate(prompts):
            alone = generate(model, torch.tensor([p], device=device), cfg).tokens[0]
            proof = None
            if alone != batched.tokens[r]:
                proof = explain_dllm_batch_row(model, prompts, r, cfg)
            rows.append(_pair(f"batched row {r} vs alone", alone, batched.tokens[r], proof))
    return {"rows": rows, "seconds_per_token": {"baseline": t_base / gen, "spiffy": t_spec / gen}}


def ar_exactness(target: torch.nn.Module, drafter: torch.nn.Module, device: torch.device, small: bool,
                 invariant: bool) -> dict[str, Any]:
    """DFlash and DDTree@16 vs AR (one prompt, greedy), and DFlash batched rows vs alone; AR and DDTree@16 timed on
    the captured path too (``compile=True``, after two calls: one builds the buckets, one records them), with whether
    its tokens are the eager path's (``captured_equals_eager``: informative; bfloat16 kernels chosen by shape may round
    otherwise)."""
    new = 16 if small else 32
    vocab = int(target.get_input_embeddings().weight.shape[0])
    prompts = _prompts(vocab, (5, 8) if small else (48, 64), seed=1)
    kw = {"max_new_tokens": new, "temperature": 0.0}
    rows, seconds = [], {}
    warm = dict(kw, max_new_tokens=4)  # untimed first (the mode's stages compile, its weight copies are made)
    with batch_invariant(invariant, model=target):
        for method, budget, draft in (("ar", None, None), ("dflash", None, drafter), ("ddtree", 16, drafter)):
            ddtree_generate(target, draft, prompts[0], method=method, budget=budget, **warm)
        ar, seconds["ar"] = gpu_costs.timed(device, lambda: ddtree_generate(target, None, prompts[0], method="ar", **kw))
        eager = {"ar": ar}
        for method, budget in (("dflash", None), ("ddtree", 16)):
            got, seconds[method] = gpu_costs.timed(device, lambda: ddtree_generate(target, drafter, prompts[0], method=method,
                                                                         budget=budget, **kw))
            eager[method] = got
            div = None
            if list(ar.tokens) != list(got.tokens):
                spec_cfg = ARSpecConfig(method=method, max_new_tokens=new, sampling=SamplingConfig(temperature=0.0),
                                        **({} if budget is None else {"budget": budget}))
                div = prove_ar_divergence(target, DFlashDrafter(drafter), prompts[0], spec_cfg,
                                          outputs=(list(ar.tokens), list(got.tokens)))
            rows.append(_pair(f"{method} vs ar", list(ar.tokens), list(got.tokens), div))
        captured = {}
        for method, budget, draft in (("ar", None, None), ("ddtree", 16, drafter)):  # the captured path, as used
            def run(method: str = method, budget: int | None = budget, draft: Any = draft) -> Any:
                return ddtree_generate(target, draft, prompts[0], method=method, budget=budget, compile=True, **kw)
            run()  # builds the buckets (each run eagerly once)
            run()  # records them (a bucket's second call)
            got, seconds[f"{method} captured"] = gpu_costs.timed(device, run)
            captured[method] = list(got.tokens) == list(eager[method].tokens)
        cfg = ARSpecConfig(method="dflash", max_new_tokens=new, sampling=SamplingConfig(temperature=0.0))
        for r in range(len(prompts)):
            proof = explain_ar_batch_row(target, lambda: DFlashDrafter(drafter), prompts, r, cfg)
            rows.append({"pair": f"dflash batched row {r} vs alone", "identical": proof is None,
                         "first_divergence": None if proof is None else proof.position,
                         **({} if proof is None else {"near_tie": bool(proof.near_tie), "proof": proof.to_dict()})})
    unfused_same = None
    if invariant:  # the mode with its exact stages unfused (eager kernels): what fusing them saves, eager and captured
        with batch_invariant(model=target, fused=False):
            ddtree_generate(target, None, prompts[0], method="ar", **warm)
            plain, seconds["ar unfused"] = gpu_costs.timed(device, lambda: ddtree_generate(target, None, prompts[0],
                                                                                            method="ar", **kw))
            unfused_same = list(plain.tokens) == list(ar.tokens)  # the same numbers: must hold
            for _ in range(2):  # builds the buckets, then records them
                ddtree_generate(target, None, prompts[0], method="ar", compile=True, **kw)
            _, seconds["ar captured unfused"] = gpu_costs.timed(device, lambda: ddtree_generate(
                target, None, prompts[0], method="ar", compile=True, **kw))
    return {"rows": rows, "seconds_per_token": {k: v / new for k, v in seconds.items()},
            "captured_equals_eager": captured,
            **({} if unfused_same is None else {"unfused_equals_fused": unfused_same})}


#: the result's entry for :func:`exact_stages_check`
BACKEND_KEY = "exact stages"
#: (rows, in features, out features) of the backend check: a decode step, a verification, Qwen3-8B's MLP and
#: vocabulary shapes, and sizes that are no multiples of 8
BACKEND_SHAPES = ((1, 4096, 4096), (17, 4096, 1024), (65, 12288, 4096), (3, 4096, 151936), (5, 100, 37))


def exact_stages_check(device: torch.device, small: bool) -> dict[str, Any]:
    """The batch-invariant mode's arithmetic on ``device``, before anything is timed: its linear layer on int8 digits,
    with fused stages (:mod:`spiffy.fused_stages`, what the mode runs on CUDA) and eager ones, against float64 (all
    compute exact integers: bitwise equal), bfloat16 inputs of :data:`BACKEND_SHAPES` (``small``: shrunk); and the
    mode's other stages (exact sums, products, attention, norms) fused against eager. Reports which stages compiled
    and which fell back to eager (:data:`~spiffy.fused_stages.FELL_BACK`)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for m, k, n in BACKEND_SHAPES:
        if small:
            k, n = min(k, 200), min(n, 120)
        x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
        w, b = torch.randn(n, k, generator=g).to(device, torch.bfloat16), torch.randn(n, generator=g).to(device)
        ref = exact_linear(WeightGrid(int8=False, fused=False), x, w, b)
        same = {f"int8 {label}": torch.equal(exact_linear(WeightGrid(int8=True, fused=fused), x, w, b), ref)
                for label, fused in (("eager", False), ("fused", True))}
        same["float64 sums"] = _float64_sums_agree(x, w, b)
        rows.append({"shape": [m, k, n], "identical": all(same.values()), **same})
    q, kv, terms = (torch.randn(*shape, generator=g).to(device, torch.bfloat16)
                    for shape in ((1, 32, 17, 128), (1, 32, 300, 128), (17, 4096)))
    runs = []
    for fused in (False, True):
        with batch_invariant(fused=fused):
            runs.append((exact_sum(terms, -1), F.scaled_dot_product_attention(q, kv, kv),
                         F.rms_norm(terms, (terms.shape[-1],)), F.softmax(terms, -1)))
    rows.append({"shape": "sums, attention, rms_norm, softmax", "identical": all(map(torch.equal, *runs))})
    return {"rows": rows, "identical": f"{sum(r['identical'] for r in rows)}/{len(rows)}",
            "compiled": compiled_stages(),
            "fell_back": {f"{name} {variant}": err for (name, variant), err in FELL_BACK.items()}}


def _float64_sums_agree(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> bool:
    """The layer's exact sums before any rounding (float64 outputs: a last-bit error shows, which a bfloat16 output
    would round away): int8 digit sums fused and eager, and the float64 product, all equal."""
    wide, digits = WeightGrid(int8=False).get(w), WeightGrid(int8=True).get(w)
    ints, unscale = run_stage(activation_stage, False, x, False)
    ref = finish_stage(torch.mm(ints, wide.ints), unscale, wide.unscale, b, torch.float64)
    outs = []
    for fused in (False, True):
        form, unscale = run_stage(activation_stage, fused, x, True)
        products = torch._int_mm(form, digits.digits.t())
        outs.append(run_stage(digit_sums_stage, fused, products, x.shape[0], w.shape[0], unscale, digits.unscale, b,
                              torch.float64))
    return all(torch.equal(out, ref) for out in outs)


def real_size_exactness(device: torch.device, small: bool,
                        progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every model in every mode (see the module docstring); ``small``: toy sizes; ``progress``: called with the
    summary so far after every model and mode (a run cut short keeps what it measured)."""
    size = gpu_costs.shrink_config if small else (lambda c: c)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 products
    out: dict[str, Any] = {}

    def summary() -> dict[str, Any]:  # summarize() annotates in place: the running results stay raw
        return summarize(copy.deepcopy(out)) | {BACKEND_KEY: backends}

    try:
        backends = exact_stages_check(device, small)
        for name, fixture, _ in DLLMS:
            config = gpu_costs.real_config(fixture)
            config.setdefault("mask_token_id", 151669)  # SDAR's <|MASK|> lives in its tokenizer, not its config
            for label, dtype, invariant in MODES:
                model = gpu_costs.build_random(size(config), device, dtype)
                out.setdefault(name, {})[label] = dllm_exactness(model, device, small, invariant)
                del model
                _free(device)
                if progress is not None:
                    progress(summary())
        for label, dtype, invariant in MODES:
            target = gpu_costs.build_random(size(gpu_costs.real_config("Qwen--Qwen3-8B")), device, dtype)
            drafter = gpu_costs.build_random(size(gpu_costs.real_config("z-lab--Qwen3-8B-DFlash-b16")), device, dtype)
            out.setdefault("Qwen3-8B + DFlash", {})[label] = ar_exactness(target, drafter, device, small, invariant)
            del target, drafter
            _free(device)
            if progress is not None:
                progress(summary())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return summary()


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Adds per model and mode ``identical`` (``k/n``), ``unproven`` (differing pairs whose proof failed or does
    not apply) and the batch-invariant mode's cost (its seconds per token / bfloat16's, per path)."""
    for modes in out.values():
        for label, res in modes.items():
            rows = res["rows"]
            res["identical"] = f"{sum(r['identical'] for r in rows)}/{len(rows)}"
            res["unproven"] = [r["pair"] for r in rows if not r["identical"] and not r.get("near_tie")]
        base, inv = modes.get("bfloat16"), modes.get("bfloat16 batch-invariant")
        if base and inv:
            base_seconds = base["seconds_per_token"]  # "ar unfused" against "ar": the mode unfused vs the default
            modes["batch_invariant_cost"] = {k: round(v / base_seconds[path], 2)
                                             for k, v in inv["seconds_per_token"].items()
                                             if base_seconds.get(path := k.replace(" unfused", ""))}
    return out


def failures(result: dict[str, Any]) -> list[str]:
    """What the run must not show: float32 or batch-invariant pairs that differ, bfloat16 divergences unproven, the
    mode's two product backends apart."""
    bad = []
    for model, modes in result.items():
        if model == BACKEND_KEY:
            if not _all(modes["identical"]):
                bad.append(f"the mode's stages (int8 or fused) != float64 or eager: {modes['identical']} identical")
            continue
        for label, res in modes.items():
            if label == "batch_invariant_cost":
                continue
            if res.get("unfused_equals_fused") is False:
                bad.append(f"{model} {label}: the mode's fused stages decode other tokens than its eager ones")
            if label != "bfloat16" and not _all(res["identical"]):
                bad.append(f"{model} {label}: {res['identical']} identical")
            elif label == "bfloat16" and res["unproven"]:
                bad.append(f"{model} bfloat16: unproven {res['unproven']}")
    return bad


def _all(identical: str) -> bool:
    """Whether a ``"k/n"`` count is every one."""
    k, n = identical.split("/")
    return k == n


__all__ = ["BACKEND_KEY", "MODES", "ar_exactness", "dllm_exactness", "failures", "exact_stages_check",
           "real_size_exactness", "summarize"]
