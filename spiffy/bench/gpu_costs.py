"""Forward costs at real sizes with random weights, and the speedups they project (``scripts/gpu_run.py``).

Speculative decoding trades model calls for wider calls: Spiffy evaluates ``1 + D`` dLLM states in one forward,
DDTree verifies ``1 + B`` tree nodes in one target forward. Whether fewer calls become wall-clock depends on how a
forward's cost grows with its rows, which on a GPU is a property of the model size and the kernels, not of the
weights. This module measures exactly that on architectures built from the published ``config.json`` files
(``tests/data/real_configs``) with random weights, so no checkpoint is needed:

* :func:`dllm_state_costs`: one session forward over ``N`` states (``N = 1..8``) for each cache mode, exactly the
  call Spiffy makes (:meth:`spiffy.decoding.session.DecodeSession.forward_states`).
* :func:`ar_verify_costs`: a 1-token decode against a tree verification of ``1 + B`` nodes (4-D ancestor mask,
  explicit positions) over a context of ``C`` tokens, transformers' own class, eager.
* :func:`ar_verify_graph_costs`: the same verification step captured in a CUDA graph per budget (static shapes, a
  :class:`transformers.StaticCache`), replayed.
* :func:`drafter_cost`: one DFlash drafter block forward.
* :func:`project_dllm` / :func:`project_ar`: projected speedups = measured acceptance (from the embedded models) x
  measured costs. They are projections: the acceptance of a real model on real prompts is not the tiny model's.

Timings are medians over repetitions after warm-up (CUDA events on a GPU, ``perf_counter`` on a CPU).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, StaticCache

from spiffy.decoding import DecodeConfig, make_session
from spiffy.models.dflash import DFlashDraftModel
from spiffy.models.loading import family_of, load_config
from spiffy.models.cache import hf_cache
from spiffy.models.registry import family_spec

__all__ = [
    "timed",
    "REAL_CONFIGS",
    "ar_verify_costs",
    "ar_verify_graph_costs",
    "build_random",
    "count_parameters",
    "dllm_state_costs",
    "drafter_cost",
    "project_ar",
    "project_dllm",
    "real_config",
    "shrink_config",
    "time_ms",
]

#: the fixture directory holding the published config.json files
REAL_CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "data" / "real_configs"

#: the sizes a self-check shrinks every real config to (same architecture, CPU-cheap)
_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "moe_intermediate_size": 32,
         "num_experts": 4, "num_experts_per_tok": 2, "max_window_layers": 2,
         # LLaDA spellings
         "d_model": 64, "mlp_hidden_size": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "embedding_size": 512}


def real_config(name: str) -> dict[str, Any]:
    """The published ``config.json`` of ``name`` (a fixture file stem, e.g. ``"Qwen--Qwen3-8B"``)."""
    return json.loads((REAL_CONFIGS / f"{name}.config.json").read_text())


def shrink_config(config: dict[str, Any]) -> dict[str, Any]:
    """The same architecture at toy size (every size field that ``config`` has replaced by a tiny value)."""
    out = dict(config)
    for key, value in _TINY.items():
        if key in out:
            out[key] = value
    if "dflash_config" in out:  # a drafter for a 2-layer target reads both layers
        out["dflash_config"] = {**out["dflash_config"], "target_layer_ids": [0, 1], "mask_token_id": 511}
        out["num_target_layers"] = 2
    for key in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        if isinstance(out.get(key), int) and out[key] >= 512:
            out[key] = 500 + hash(key) % 10
    return out


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def build_random(config: dict[str, Any], device: str | torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A model of ``config``'s architecture with random weights, built directly on ``device`` in ``dtype``.

    ``model_type`` ``llada`` / ``Dream`` / ``sdar`` use spiffy's family classes (loaded as ``load_model`` builds
    them); a DFlash drafter config (``dflash_config``) gives :class:`DFlashDraftModel`; anything else is
    transformers' ``AutoModelForCausalLM`` class for its ``model_type`` (``qwen3``, ``qwen3_moe``, ...).
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if "dflash_config" in config:
                model: torch.nn.Module = DFlashDraftModel(AutoConfig.for_model(**config))
            elif config.get("model_type") in ("llada", "Dream", "sdar"):
                with tempfile.TemporaryDirectory() as tmp:
                    (Path(tmp) / "config.json").write_text(json.dumps(config))
                    cfg = load_config(tmp)
                cfg._attn_implementation = "sdpa"
                model = family_spec(family_of(config)).model_class(cfg)  # LLaDA-MoE also says "llada"
            else:
                cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "model_type"},
                                           model_type=config["model_type"])
                cfg._attn_implementation = "sdpa"
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype).eval()


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), seconds)`` of one call, the device synchronised before and after (a GPU runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 2, reps: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(samples))


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def dllm_state_costs(model: torch.nn.Module, prompt_len: int, gen_length: int, block_length: int,
                     cache_modes: Sequence[str], states: Iterable[int], reps: int = 5) -> list[dict[str, Any]]:
    """Milliseconds of one :meth:`forward_states` call over ``N`` copies of the block-0 state, per cache mode.

    Returns rows ``{"cache", "states", "ms", "relative"}`` (``relative`` = ms / ms at one state).
    """
    device = _device(model)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    prompt = torch.randint(0, min(vocab, 1000), (1, prompt_len), device=device)
    rows: list[dict[str, Any]] = []
    for cache in cache_modes:
        cfg = DecodeConfig(gen_length=gen_length, block_length=block_length, steps=gen_length, cache=cache)
        session = make_session(model, prompt, cfg)
        session.begin_block(0)
        one = None
        for n in states:
            x = session.x.expand(n, -1).contiguous()
            ms = time_ms(lambda: session.forward_states(x), device, reps=reps)
            one = ms if one is None else one
            rows.append({"cache": cache, "states": int(n), "ms": ms, "relative": ms / one})
    return rows


def _ancestor_mask(budget: int, context: int, dtype: torch.dtype, device: torch.device,
                   total_keys: int | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of ``1 + budget`` nodes (node 0 the root, every parent earlier): its additive ``[1, 1, 1 + B,
    K]`` ancestor-only mask over ``[context ; tree]`` keys (``K = total_keys`` or ``context + 1 + B``, the extra
    keys hidden) and ``[1, 1 + B]`` positions ``context + depth``."""
    g = torch.Generator().manual_seed(seed)
    n = budget + 1
    parent = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    visible = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i in range(n):
        visible[i, i] = True
        if i:
            visible[i] |= visible[parent[i]]
            depth[i] = depth[parent[i]] + 1
    keys = total_keys or context + n
    mask = torch.full((1, 1, n, keys), torch.finfo(dtype).min, dtype=dtype)
    mask[..., :context] = 0
    mask[0, 0, :, context:context + n].masked_fill_(visible, 0)
    positions = torch.tensor([[context + d for d in depth]])
    return mask.to(device), positions.to(device)


def _cut(cache: Any, length: int) -> None:
    """Drop every cached position at or after ``length`` (transformers' ``crop`` changed meaning across 5.x)."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def _rewind(cache: Any, tokens: int) -> None:
    """Forget the last ``tokens`` writes of a ``StaticCache`` whose layers count their length on the device
    (transformers >= 5.2x: ``cumulative_length``, an in-place device op, so it can sit inside a CUDA graph);
    older static caches take positions from ``cache_position`` and need nothing."""
    for layer in getattr(cache, "layers", []):
        length = getattr(layer, "cumulative_length", None)
        if isinstance(length, torch.Tensor):
            length.sub_(tokens)


@torch.inference_mode()
def ar_verify_costs(target: torch.nn.Module, context: int, budgets: Sequence[int], reps: int = 5) -> list[dict[str, Any]]:
    """Eager milliseconds of a 1-token decode (``budget`` 0) and of verifying ``1 + B`` tree nodes, each over a
    ``context``-token K/V cache (the nodes' K/V are dropped after every call). Rows ``{"budget", "ms",
    "relative"}`` (``relative`` = ms / 1-token ms)."""
    device, dtype = _device(target), next(target.parameters()).dtype
    vocab = int(target.config.vocab_size)
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.randint(0, vocab, (1, context), device=device), use_cache=True, **hf_cache(cache))
    rows: list[dict[str, Any]] = []
    one = None
    for budget in [0, *budgets]:
        mask, positions = _ancestor_mask(budget, context, dtype, device)
        ids = torch.randint(0, vocab, (1, budget + 1), device=device)

        def step() -> None:
            target(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, **hf_cache(cache))
            _cut(cache, context)

        ms = time_ms(step, device, reps=reps)
        one = ms if one is None else one
        rows.append({"budget": int(budget), "ms": ms, "relative": ms / one})
    return rows


@torch.inference_mode()
def ar_verify_graph_costs(target: torch.nn.Module, context: int, budgets: Sequence[int], reps: int = 10,
                          capture: bool = True) -> list[dict[str, Any]]:
    """The verification step with static shapes (a ``StaticCache`` of ``context + 1 + max(budgets)`` slots, static
    id / position / mask / cache-position buffers per budget), captured in one CUDA graph per budget and replayed
    (``capture=False``, or no CUDA: the same static step run eagerly, which is what the CPU self-check exercises).
    Rows ``{"budget", "ms", "relative", "captured"}``; a budget whose capture fails reports its ``error``."""
    device, dtype = _device(target), next(target.parameters()).dtype
    vocab = int(target.config.vocab_size)
    slots = context + 1 + max([0, *budgets])
    cache = StaticCache(config=target.config, max_cache_len=slots)
    prefix = torch.randint(0, vocab, (1, context), device=device)
    prefix_mask = torch.full((1, 1, context, slots), torch.finfo(dtype).min, dtype=dtype, device=device)
    prefix_mask[..., :context] = torch.triu(torch.full((context, context), torch.finfo(dtype).min, dtype=dtype,
                                                       device=device), diagonal=1)
    target(input_ids=prefix, attention_mask=prefix_mask, use_cache=True, **hf_cache(cache),
           position_ids=torch.arange(context, device=device)[None], cache_position=torch.arange(context, device=device))
    rows: list[dict[str, Any]] = []
    one = None
    use_graph = capture and device.type == "cuda"
    for budget in [0, *budgets]:
        mask, positions = _ancestor_mask(budget, context, dtype, device, total_keys=slots)
        ids = torch.randint(0, vocab, (1, budget + 1), device=device)
        cache_position = torch.arange(context, context + budget + 1, device=device)

        def step() -> torch.Tensor:
            logits = target(input_ids=ids, position_ids=positions, attention_mask=mask, cache_position=cache_position,
                            use_cache=True, **hf_cache(cache)).logits
            _rewind(cache, ids.shape[1])
            return logits

        row: dict[str, Any] = {"budget": int(budget), "captured": False}
        try:
            if use_graph:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        step()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                row["ms"] = time_ms(graph.replay, device, warmup=2, reps=reps)
                row["captured"] = True
                del graph
            else:
                row["ms"] = time_ms(step, device, reps=reps)
        except Exception as exc:  # noqa: BLE001  (a capture failure is a result to report, not a crash)
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            continue
        one = row["ms"] if one is None else one
        row["relative"] = row["ms"] / one
        rows.append(row)
    return rows


@torch.inference_mode()
def drafter_cost(drafter: DFlashDraftModel, embed: torch.nn.Module, context: int, reps: int = 5) -> dict[str, Any]:
    """Milliseconds of one DFlash block forward: ``context`` new target-feature rows projected into the drafter's
    cache and one block of ``block_size`` rows (a round's drafting; the head is the target's and is not included)."""
    device, dtype = _device(drafter), drafter.dtype
    h = int(drafter.config.hidden_size)
    feats = torch.randn(1, 1, len(drafter.target_layer_ids) * h, device=device, dtype=dtype)
    block = int(drafter.block_size)
    noise = embed(torch.full((1, block), drafter.mask_token_id, device=device))
    cache = drafter.new_cache()
    warm = torch.randn(1, context, len(drafter.target_layer_ids) * h, device=device, dtype=dtype)
    drafter(warm, noise[:, :0], torch.arange(context, device=device), past_key_values=cache)
    positions = torch.arange(context, context + 1 + block, device=device)

    def step() -> None:
        drafter(feats, noise, positions, past_key_values=cache, store_context=False)

    return {"block_size": block, "context": context, "ms": time_ms(step, device, reps=reps)}


def project_dllm(costs: Sequence[dict[str, Any]], measured: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Projected Spiffy wall-clock speedup per cache mode and budget ``D``: ``NFE reduction(D) x cost(1 state) /
    cost(1 + D states)``. ``measured`` rows are ``{"budget", "nfe_reduction"}`` from the embedded model."""
    out = []
    for m in measured:
        d = int(m["budget"])
        for row in costs:
            if row["states"] == d + 1:
                out.append({"cache": row["cache"], "budget": d, "nfe_reduction": m["nfe_reduction"],
                            "cost_ratio": row["relative"], "projected_speedup": m["nfe_reduction"] / row["relative"]})
    return out


def project_ar(costs: Sequence[dict[str, Any]], measured: Sequence[dict[str, Any]],
               drafter_ms: float) -> list[dict[str, Any]]:
    """Projected DDTree / DFlash speedups over AR: ``tau x t(1 token) / (t(drafter) + t(verify 1 + B))``.

    ``measured`` rows are ``{"method", "budget", "tau"}`` (``budget``: the draft nodes a round verifies besides the
    root, as ``spiffy bench ar`` reports them; a DFlash chain of block 16 verifies 15). Uses the nearest measured
    verification budget at or above the round's."""
    by_budget = {row["budget"]: row["ms"] for row in costs if "ms" in row}
    if 0 not in by_budget:
        return []
    out = []
    for m in measured:
        budget = int(m["budget"])
        fits = sorted(b for b in by_budget if b >= budget)
        if not fits:
            continue
        verify = by_budget[fits[0]]
        out.append({"method": m["method"], "budget": budget, "tau": m["tau"], "verify_ms": verify,
                    "drafter_ms": drafter_ms,
                    "projected_speedup": m["tau"] * by_budget[0] / (drafter_ms + verify)})
    return out
