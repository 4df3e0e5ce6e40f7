"""Losslessness on the shipped TRAINED models in float32 (the precision a user runs on a CPU), not only random weights.

Spiffy on the embedded tiny-sdar and tiny-llada with the graphs shipped next to them; DFlash and DDTree on the embedded tiny-qwen3
with its DFlash drafter. Each speculative output must equal its baseline token for token, and, these being trained
models with calibrated graphs, must also save target forwards (so a runtime that silently never accepts fails).
"""

from __future__ import annotations

import pytest
import torch

from spiffy.decoding import DecodeConfig
from spiffy.api import generate
from spiffy.embedded import embedded_model_path, shipped_graphs
from spiffy.models import load_model, load_tokenizer
from spiffy.selfspec.graph import load_graph

CODE_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n",
)


@pytest.fixture(scope="module")
def dllms() -> dict[str, tuple[torch.nn.Module, object, list]]:
    """The shipped dLLMs by embedded kind: the demo's tiny-sdar ("dllm") and the earlier tiny-llada ("dllm-llada")."""
    out = {}
    for kind in ("dllm", "dllm-llada"):
        path = embedded_model_path(kind)
        out[kind] = (load_model(path, dtype="float32"), load_tokenizer(path), shipped_graphs(path))
    return out


@pytest.fixture(scope="module")
def qwen3() -> tuple[torch.nn.Module, object, object]:
    from spiffy.models import load_drafter

    target_dir = embedded_model_path("ar-target")
    target = load_model(target_dir, dtype="float32")
    return target, load_drafter(embedded_model_path("ar-drafter"), dtype="float32"), load_tokenizer(target_dir)


def _graph(graphs: list, stem: str):
    found = [g for g in graphs if g.stem == stem]
    assert found, f"the embedded dLLM ships no graph {stem} (shipped: {[g.stem for g in graphs]})"
    return load_graph(found[0])


@pytest.mark.parametrize(
    ("kind", "stem", "config", "prompts"),
    [
        # one block of the graphs' block length (32) keeps it fast; the rule per block is the calibrated one
        ("dllm", "tiny-sdar-s1", DecodeConfig(gen_length=32, block_length=32, steps=32), CODE_PROMPTS),
        ("dllm", "tiny-sdar-t09", DecodeConfig(gen_length=32, block_length=32, threshold=0.9), CODE_PROMPTS[:1]),
        ("dllm", "tiny-sdar-s1_chat", DecodeConfig(gen_length=32, block_length=32, steps=32), CODE_PROMPTS[:1]),
        ("dllm-llada", "tiny-llada-s1", DecodeConfig(gen_length=32, block_length=32, steps=32), CODE_PROMPTS),
        ("dllm-llada", "tiny-llada-t09", DecodeConfig(gen_length=32, block_length=32, threshold=0.9), CODE_PROMPTS[:1]),
    ],
)
def test_spiffy_on_shipped_dllms_is_lossless(dllms, kind: str, stem: str, config: DecodeConfig,
                                             prompts: tuple[str, ...]) -> None:
    model, tok, graphs = dllms[kind]
    graph = _graph(graphs, stem)
    for text in prompts:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        base = generate(model, ids, config)
        spec = generate(model, ids, config, graph=graph, budget=3)
        assert spec.tokens == base.tokens, text
        assert spec.nfe < base.nfe, text  # the shipped graph accepts drafts on code prompts


@pytest.mark.parametrize(("temperature", "seed", "prompts"), [(0.0, 0, CODE_PROMPTS), (0.8, 3, CODE_PROMPTS[:1])])
def test_dflash_and_ddtree_on_shipped_qwen3_are_lossless(qwen3, temperature: float, seed: int, prompts) -> None:
    from spiffy.arspec import ddtree_generate

    target, drafter, tok = qwen3
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        kw = dict(max_new_tokens=32, temperature=temperature, seed=seed)
        ar = ddtree_generate(target, None, ids, method="ar", **kw)
        for method, budget in (("dflash", None), ("ddtree", 16), ("ddtree", 64)):
            out = ddtree_generate(target, drafter, ids, method=method, budget=budget, **kw)
            assert out.tokens == ar.tokens, (text, method, budget)
            assert out.tau > 1.0, (text, method, budget)  # the trained drafter is accepted beyond the bonus token
