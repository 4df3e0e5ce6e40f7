"""Write DFlash2 checkpoints WITH z-lab's ``dflash`` package and record what its generation loop does on them.

Run in the package's own environment (not spiffy's; this script imports no spiffy code)::

    python -m venv /tmp/dflash-venv
    /tmp/dflash-venv/bin/pip install dflash==0.1.0 torch==2.13.0 transformers==5.15.0 safetensors
    PYTHONPATH=$PWD python -m spiffy tiny dflash2 /tmp/spiffy-dflash2 --target tests/data/dflash2/target \\
        --seed 7 --set num_layers=2 --set "target_layer_ids=[0,1]" --set block_size=8 --set selector_top_k=6 \\
        --set selector_rank=8 --set conv_kernel_size=3 --set conv_group_size=16     # (after the first run)
    /tmp/dflash-venv/bin/python scripts/dflash2_official_parity.py --out tests/data/dflash2 \\
        --spiffy-tiny /tmp/spiffy-dflash2

It writes, under ``--out``:

* ``target/``: a tiny random ``Qwen3ForCausalLM`` (transformers' ``save_pretrained``; embeddings and head with a
  large spread, small layer weights, so the greedy continuation of a token is mostly a function of that token);
* ``planted/``: a ``DFlash2DraftModel`` (the package's class, ``save_pretrained``, then the selector's codebooks
  renamed without ``.weight`` as released checkpoints store them) whose DFlash layers and convolutions are small
  random weights and whose selector is planted: its bilinear term predicts the target's one-token continuation, so
  the drafts are often accepted and acceptance lengths vary from round to round;
* ``random/``: a ``DFlash2DraftModel`` with random weights everywhere and every optional field the package reads set
  to a non-default value (``is_causal``, a ``sliding_attention`` layer with ``sliding_window``,
  ``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping``), kept in ``save_pretrained``'s own
  spelling (codebooks with ``.weight``);
* ``expected.json``: for each checkpoint (and for ``--spiffy-tiny``, a checkpoint spiffy's ``spiffy tiny dflash2``
  wrote: the package must load it strictly too) the package's strict-load report, and per prompt the greedy
  generation of ``dflash.model.dflash_generate`` (float64, CPU): output tokens, acceptance length of every round, the
  drafted block of every round (recorded by wrapping the model's ``propose``), and one sampled proposal
  (``propose`` at ``T = 0.8`` on the first round's hidden states: the sampled path, the candidates and the ``q`` rows).

``tests/test_dflash2_parity.py`` checks spiffy against ``expected.json`` without the package.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash
import dflash.model
from dflash import DFlash2DraftModel
from dflash.model import dflash_generate

# ``dflash_generate(return_stats=True)`` (the only way it reports acceptance lengths) times itself with
# ``torch.cuda.synchronize``; on a CPU-only build the clock is the host's (timing only: nothing it computes changes)
dflash.model._cuda_time = time.perf_counter

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
VOCAB = 64
HIDDEN = 64
MASK = VOCAB - 1
SAMPLED_TEMPERATURE = 0.8


def make_target(out: Path) -> Path:
    cfg = Qwen3Config(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
                      tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.09 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(out))
    return out


def drafter_config(**fields) -> Qwen3Config:
    layer_types = fields.pop("layer_types", None)
    top = fields.pop("top", {})
    cfg = Qwen3Config(hidden_size=HIDDEN, intermediate_size=fields.pop("intermediate_size", 128),
                      num_hidden_layers=fields.pop("num_layers", 2), num_attention_heads=fields.pop("heads", 4),
                      num_key_value_heads=fields.pop("kv_heads", 2), head_dim=fields.pop("head_dim", 16),
                      vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      **({"layer_types": layer_types} if layer_types else {}), **top)
    cfg.num_target_layers = 2
    cfg.architectures = ["DFlash2DraftModel"]
    cfg.dflash_config = dict(fields)
    return cfg


def fill(model: torch.nn.Module, seed: int, std: float) -> torch.Generator:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith("base_kernel"):
                p.copy_(std * torch.randn(p.shape, generator=gen))
                p[:, 0] += 1.0
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return gen


def one_token_continuation(target: Qwen3ForCausalLM) -> list[int]:
    with torch.no_grad():
        return [int(target(torch.tensor([[a]])).logits[0, -1].argmax()) for a in range(VOCAB)]


def make_planted(out: Path, target: Qwen3ForCausalLM) -> Path:
    cfg = drafter_config(target_layer_ids=[0, 1], mask_token_id=MASK, block_size=8, conv_kernel_size=3,
                         conv_group_size=16, selector_rank=VOCAB, selector_top_k=VOCAB)
    model = DFlash2DraftModel(cfg).double()
    fill(model, 5, 0.02)
    nxt = one_token_continuation(target.double())
    with torch.no_grad():
        # the drafter's final hidden state of a MASK row (its layers are small, so every MASK row is close to it)
        ctx = torch.zeros(1, 1, 2 * HIDDEN, dtype=torch.float64)
        emb = target.get_input_embeddings().weight[[MASK, MASK]].unsqueeze(0)
        h = model(position_ids=torch.arange(3).view(1, -1), noise_embedding=emb, target_hidden=ctx)[0, -1]
        sel = model.candidate_selector
        sel.hidden_projection.weight.copy_(torch.outer(torch.ones(VOCAB, dtype=torch.float64), h / h.dot(h)))
        sel.predecessor_codebook.weight.copy_(40.0 * torch.nn.functional.one_hot(torch.tensor(nxt), VOCAB).double())
        sel.successor_codebook.weight.copy_(torch.eye(VOCAB, dtype=torch.float64))
    model.float().save_pretrained(str(out))
    state = load_file(str(out / "model.safetensors"))
    state = {(k[: -len(".weight")] if k[: -len(".weight")] in CODEBOOKS else k): v for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})  # the released spelling
    return out


def make_random(out: Path) -> Path:
    cfg = drafter_config(target_layer_ids=[1], mask_token_id=MASK - 1, block_size=6, conv_kernel_size=2,
                         conv_group_size=8, selector_rank=6, selector_top_k=5, input_embedding_scale=1.7,
                         output_multiplier=0.6, final_logit_softcapping=3.0, intermediate_size=64, heads=2,
                         kv_heads=1, head_dim=32, layer_types=["sliding_attention", "full_attention"],
                         top={"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
                              "is_causal": True})
    model = DFlash2DraftModel(cfg)
    fill(model, 9, 0.25)
    model.save_pretrained(str(out))  # the package's own spelling: codebooks with .weight
    return out


def weights_digest(path: Path) -> str:
    """sha256 over every stored tensor (name, dtype, shape, bytes), in name order, whatever the shard layout."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def record(model: DFlash2DraftModel, target: Qwen3ForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    rows = []
    original = model.propose
    for prompt in prompts:
        drafts: list[list[int]] = []
        sampled: dict = {}

        def recording(hidden, anchor, head, temperature, _sampled=sampled, _drafts=drafts):  # noqa: ANN001
            if not _sampled:
                torch.manual_seed(0)
                path, candidates, q = original(hidden, anchor, head, SAMPLED_TEMPERATURE)
                _sampled.update(temperature=SAMPLED_TEMPERATURE, path=path[0].tolist(),
                                candidates=candidates[0].tolist(), q=q[0].tolist())
            out = original(hidden, anchor, head, temperature)
            _drafts.append(out[0][0].tolist())
            return out

        model.propose = recording
        try:
            res = dflash_generate(model, target, torch.tensor([prompt]), max_new_tokens, None, temperature=0.0,
                                  return_stats=True)
        finally:
            model.propose = original
        rows.append({"prompt": prompt, "tokens": res.output_ids[0, len(prompt):].tolist(),
                     "acceptance_lengths": [int(a) for a in res.acceptance_lengths], "drafts": drafts,
                     "sampled": sampled})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--spiffy-tiny", type=Path, default=None, help="a checkpoint `spiffy tiny dflash2` wrote")
    parser.add_argument("--spiffy-tiny-args", default="", help="how it was written (recorded in expected.json)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("target", "planted", "random"):
        shutil.rmtree(args.out / name, ignore_errors=True)
    torch.manual_seed(0)
    make_target(args.out / "target")
    target = Qwen3ForCausalLM.from_pretrained(str(args.out / "target"), dtype=torch.float64,
                                              attn_implementation="sdpa").eval()
    make_planted(args.out / "planted", target)
    make_random(args.out / "random")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 2, (n,), generator=gen).tolist() for n in (3, 5, 8, 11, 6)]
    cases = {"planted": (args.out / "planted", 40, "official save_pretrained, codebooks renamed without .weight"),
             "random": (args.out / "random", 24, "official save_pretrained (codebooks with .weight)")}
    if args.spiffy_tiny is not None:
        cases["spiffy_tiny"] = (args.spiffy_tiny, 24, f"spiffy tiny dflash2 {args.spiffy_tiny_args}".strip())
    out: dict = {
        "official": {"package": "dflash", "version": dflash.__version__ if hasattr(dflash, "__version__") else
                     version("dflash"), "transformers": version("transformers"), "torch": torch.__version__,
                     "read": ["dflash/model.py: DFlash2DraftModel, DFlashDraftModel, GroupedDynamicCausalConv, "
                              "CandidateSelector, dflash_generate, _sampling_probs"],
                     "dtype": "float64", "device": "cpu",
                     "patched": "dflash.model._cuda_time = time.perf_counter (CPU torch has no cuda.synchronize)"},
        "target": "target",
        "cases": {},
    }
    for name, (path, max_new, how) in cases.items():
        model, info = DFlash2DraftModel.from_pretrained(str(path), dtype=torch.float64, output_loading_info=True)
        strict = {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        assert not any(strict.values()), (name, strict)
        keys = sorted(k for f in path.glob("*.safetensors") for k in load_file(str(f)))
        out["cases"][name] = {
            "checkpoint": path.name if path.parent == args.out else None, "written_by": how,
            "weights_sha256": weights_digest(path), "strict_load": strict,
            "codebooks_with_weight_suffix": all(c + ".weight" in keys for c in CODEBOOKS),
            "max_new_tokens": max_new, "rows": record(model.eval(), target, prompts, max_new),
        }
    (args.out / "expected.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, case in out["cases"].items():
        print(name, [r["acceptance_lengths"] for r in case["rows"]])


if __name__ == "__main__":
    main()
