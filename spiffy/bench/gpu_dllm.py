"""dLLM decoding eager against the static path (``scripts/gpu_run.py``, section ``dllm_captured``).

For LLaDA-8B, SDAR-8B and LLaDA2.0-mini (random weights, the published ``config.json``, built directly on the device
at real size): ``spiffy.generate`` with ``compile=False`` and ``compile=True`` for the baseline, Spiffy (an oracle
graph of the model's own baseline trajectory, ``D* = 3``: four states per forward), FreeDave and SSD (four states per
forward), each timed on its third call (the first builds the buckets and runs each eagerly, the second records them
on a GPU; both reported), as ms per forward and
ms per generated token, beside the memory-bandwidth limit of one forward (weight bytes over a measured read
bandwidth), and whether the tokens equal eager's. LLaDA2.0's static forward runs its experts grouped
(:mod:`spiffy.models.moe_dispatch`); a ``compile=True`` refusal or failure is reported as the row's error. With a prefix cache, LLaDA-8B's ``forward_states`` over one 32-row block is also timed
alone at 1 and 4 states, eager and static (the issue's first "done when": the one-state forward against the
bandwidth limit, the four-state forward against the one-state one). Nothing here is projected.
"""

from __future__ import annotations

from typing import Any

import torch

from spiffy.api import generate
from spiffy.bench import gpu_costs
from spiffy.bench.gpu_captured import read_bandwidth
from spiffy.bench.gpu_costs import timed
from spiffy.decoding import make_session
from spiffy.models.registry import family_spec
from spiffy.selfspec.freedave import freedave_graph
from spiffy.selfspec.oracle import oracle_graph_from_records, record_trajectory
from spiffy.selfspec.ssd import ssd_graph

__all__ = ["dllm_captured_markdown", "dllm_captured_timings"]

#: (report name, config fixture, cache mode of the runs, mask id when the config has none: it lives in the tokenizer)
MODELS: tuple[tuple[str, str, str, int | None], ...] = (
    ("LLaDA-8B", "GSAI-ML--LLaDA-8B-Instruct", "prefix", None),
    ("SDAR-8B", "JetLM--SDAR-8B-Chat", "prefix", 151669),
    ("LLaDA2.0-mini", "inclusionAI--LLaDA2.0-mini", "none", 156895),
)

#: states per forward of the speculative methods (Spiffy: 1 + D* with D* = 3)
STATES = 4


def _config(fixture: str, small: bool, mask_id: int | None) -> dict[str, Any]:
    config = gpu_costs.real_config(fixture)
    if mask_id is not None:
        config.setdefault("mask_token_id", mask_id)
    if not small:
        return config
    config = gpu_costs.shrink_config(config)
    if config.get("model_type") == "llada2_moe":  # the MoE grouping and partial RoPE must agree at toy size
        config.update(family_spec("llada2").tiny_config)
        config["rotary_dim"] = int(config["head_dim"] * config["partial_rotary_factor"])
    return config


def _graphs(model: torch.nn.Module, prompt: torch.Tensor, kw: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(method, graph, budget)`` of the four methods."""
    session = make_session(model, prompt, **kw)
    oracle = oracle_graph_from_records(record_trajectory(session), session.mask_id)
    cfg = make_session(model, prompt, **kw).config
    return [("baseline", None, None), ("spiffy", oracle, STATES - 1),
            ("freedave", freedave_graph(model, cfg, STATES), STATES),
            ("ssd", ssd_graph(model, cfg, STATES), STATES)]


def _row(model: torch.nn.Module, prompt: torch.Tensor, kw: dict[str, Any], method: str, graph: Any,
         budget: Any, mode: bool, device: torch.device) -> dict[str, Any]:
    call = dict(graph=graph, budget=budget, compile=mode, **kw)
    first, first_s = timed(device, lambda: generate(model, prompt, **call))  # builds every bucket, runs it eagerly
    second_s = timed(device, lambda: generate(model, prompt, **call))[1] if mode else None  # records them
    res, seconds = timed(device, lambda: generate(model, prompt, **call))
    row = {"method": method, "compile": mode, "nfe": res.nfe, "steps": res.steps,
           "ms_per_forward": 1e3 * seconds / max(res.nfe, 1),
           "ms_per_token": 1e3 * seconds / max(len(res.tokens[0]), 1), "first_call_s": first_s,
           "second_call_s": second_s, "tokens": res.tokens[0], "same_tokens_as_first_call": first.tokens == res.tokens}
    if mode:
        row["capture"] = res.stats.get("capture")
    return row


@torch.inference_mode()
def _forward_alone(model: torch.nn.Module, prompt: torch.Tensor, kw: dict[str, Any],
                   device: torch.device) -> list[dict[str, Any]]:
    """ms of one ``forward_states`` over the block-0 state repeated 1 and ``STATES`` times, eager and static."""
    rows = []
    for mode in (False, True):
        session = make_session(model, prompt, **kw)
        if mode:
            session.use_static(capture=True)
        session.begin_block(0)
        for n in (1, STATES):
            x = session.x.expand(n, -1).contiguous()
            rows.append({"compile": mode, "states": n,
                         "ms": gpu_costs.time_ms(lambda: session.forward_states(x), device, warmup=3, reps=10)})
    return rows


def dllm_captured_timings(device: torch.device, dtype: torch.dtype, small: bool) -> dict[str, Any]:
    """Per model: eager and static rows of every method, the forward alone (LLaDA-8B), the bandwidth limit."""
    prompt_len, gen, block = (6, 16, 8) if small else (256, 64, 32)
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "gen_length": gen, "block_length": block,
                           "states_per_forward": STATES,
                           "label": "MEASURED: random weights, greedy, one token per step (the cost of a step)"}
    bandwidth = read_bandwidth(device, 0.0625 if small else 2.0)
    out["read_bandwidth_gb_s"] = bandwidth / 1e9
    for name, fixture, cache, mask_id in MODELS:
        entry: dict[str, Any] = {"cache": cache, "rows": []}
        try:
            model = gpu_costs.build_random(_config(fixture, small, mask_id), device, dtype)
        except Exception as exc:  # noqa: BLE001  (a model that cannot be built is a result to report)
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        vocab = int(model.get_input_embeddings().weight.shape[0])
        weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        entry["parameters"] = gpu_costs.count_parameters(model)
        entry["bandwidth_limit_ms_per_forward"] = 1e3 * weight_bytes / bandwidth
        prompt = torch.randint(0, min(vocab, 1000), (1, prompt_len), generator=torch.Generator().manual_seed(0))
        prompt = prompt.to(device)
        kw = {"gen_length": gen, "block_length": block, "steps": gen, "cache": cache, "temperature": 0.0}
        try:
            methods = _graphs(model, prompt, kw)
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            methods = [("baseline", None, None)]
        for method, graph, budget in methods:
            eager_tokens = None
            for mode in (False, True):
                try:
                    row = _row(model, prompt, kw, method, graph, budget, mode, device)
                except Exception as exc:  # noqa: BLE001  (a refused or failed row is a result to report)
                    entry["rows"].append({"method": method, "compile": mode,
                                          "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                tokens = row.pop("tokens")
                eager_tokens = tokens if not mode else eager_tokens
                row["same_tokens_as_eager"] = None if eager_tokens is None else tokens == eager_tokens
                entry["rows"].append(row)
        if name == "LLaDA-8B":
            try:
                entry["forward_alone"] = _forward_alone(model, prompt, kw, device)
            except Exception as exc:  # noqa: BLE001
                entry["forward_alone"] = [{"error": f"{type(exc).__name__}: {exc}"[:300]}]
        out[name] = entry
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def dllm_captured_markdown(res: dict[str, Any]) -> list[str]:
    """The section's GPU_RESULTS.md lines: per model a table of methods eager / static, and the forward alone."""
    lines = [f"**{res['label']}**; {res['states_per_forward']} states per speculative forward; read bandwidth "
             f"{res['read_bandwidth_gb_s']:.0f} GB/s", ""]
    for name, *_ in MODELS:
        entry = res.get(name)
        if not entry:
            continue
        if "rows" not in entry:
            lines += [f"### {name}: {entry.get('error', '')}", ""]
            continue
        lines += [f"### {name} (cache {entry['cache']}): bandwidth limit {entry['bandwidth_limit_ms_per_forward']:.2f} "
                  "ms per forward", "", "| method | compile | NFE | ms/forward | ms/token | same tokens as eager | "
                  "capture s |", "|---|---|---|---|---|---|---|"]
        for r in entry["rows"]:
            if "error" in r:
                lines.append(f"| {r['method']} | {r['compile']} | {r['error'][:90]} | | | | |")
                continue
            cap = (r.get("capture") or {}).get("capture_seconds", "")
            lines.append(f"| {r['method']} | {r['compile']} | {r['nfe']} | {r['ms_per_forward']:.2f} | "
                         f"{r['ms_per_token']:.2f} | {r['same_tokens_as_eager']} | {cap} |")
        alone = [r for r in entry.get("forward_alone", []) if "ms" in r]
        if alone:
            lines += ["", "forward_states over one block alone: " + "; ".join(
                f"{'static' if r['compile'] else 'eager'} {r['states']} state(s) {r['ms']:.2f} ms" for r in alone)]
        lines.append("")
    return lines
