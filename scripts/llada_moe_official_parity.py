"""Run the OFFICIAL LLaDA-MoE modeling code and LLaDA's official ``generate()`` on spiffy's tiny LLaDA-MoE checkpoints
and record the tokens, for ``tests/test_llada_moe.py`` (which checks spiffy against them without the official code).

Run in an environment of its own (the official remote code needs transformers 4.x; this script imports no spiffy
code)::

    python3 -m venv /work/envs/lmoe && /work/envs/lmoe/bin/pip install torch==2.13.0 transformers==4.57.6
    # the official files: modeling_lladamoe.py + configuration_lladamoe.py of inclusionAI/LLaDA-MoE-7B-A1B-Base
    # (or their copy in ZHZisZZ/dllm, dllm/pipelines/llada/models/, commit 03270de7) in DIR/lladamoe_official/
    # with an empty __init__.py; ML-GSAI/LLaDA's generate.py (commit b7e6c356) as DIR/llada_generate.py
    PYTHONPATH=$PWD python -m spiffy tiny llada_moe /tmp/lmoe-a --seed 0
    PYTHONPATH=$PWD python -m spiffy tiny llada_moe /tmp/lmoe-b --seed 1 <overrides of tests/test_llada_moe.py VARIANT>
    /work/envs/lmoe/bin/python scripts/llada_moe_official_parity.py --official DIR \\
        --checkpoint a=/tmp/lmoe-a --checkpoint b=/tmp/lmoe-b --out tests/data/llada_moe/expected.json

For each checkpoint it loads the official ``LLaDAMoEModelLM`` (``from_pretrained``: the load report must list no
missing or unexpected key) in float32 and bfloat16 and, for each case, runs ``generate`` (the LLaDA-MoE model
card's sampler is LLaDA's ``generate`` with ``mask_id=156895``; here the tiny tokenizer's mask id) after
``torch.manual_seed(seed)``, recording the output ids, a digest of the checkpoint's tensors and a digest of the
logits of one forward (:func:`logits_probe`: spiffy's must be bit for bit the same).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

#: (name, prompt length, gen_length, block_length, steps, temperature, remasking, seed); batch of 2 prompts
CASES: tuple[tuple[str, int, int, int, int, float, str, int], ...] = (
    ("greedy-1block", 5, 8, 8, 8, 0.0, "low_confidence", 0),
    ("greedy-2blocks", 7, 16, 8, 8, 0.0, "low_confidence", 0),
    ("greedy-2perstep", 4, 16, 8, 4, 0.0, "low_confidence", 0),
    ("sampled", 6, 16, 8, 16, 0.8, "low_confidence", 3),
    ("random-remask", 5, 16, 8, 8, 0.0, "random", 5),
    ("sampled-random", 5, 8, 4, 8, 1.0, "random", 9),
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def tensor_digest(path: Path) -> str:
    """sha256 over the checkpoint's tensors (sorted names, float32 bytes): spiffy's make_tiny must reproduce it."""
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def logits_probe(vocab: int, mask_id: int) -> torch.Tensor:
    """The fixed input whose logits are recorded bit for bit: 3 rows of 6 random tokens and 7 masks."""
    x = torch.randint(0, vocab - 16, (3, 13), generator=torch.Generator().manual_seed(0))
    x[:, 6:] = mask_id
    return x


def logits_digest(logits: torch.Tensor) -> str:
    """sha256 of the logits' bytes in their own dtype (bit-for-bit equality)."""
    return hashlib.sha256(logits.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def prompts(vocab: int, mask_id: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed * 31 + length)
    ids = torch.randint(0, vocab - 16, (2, length), generator=gen)
    ids[ids == mask_id] = 0
    return ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--official", required=True, type=Path)
    ap.add_argument("--checkpoint", action="append", required=True, help="NAME=DIR")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(args.official))
    modeling = importlib.import_module("lladamoe_official.modeling_lladamoe")
    configuration = importlib.import_module("lladamoe_official.configuration_lladamoe")
    generate = importlib.import_module("llada_generate").generate
    config_cls = next(v for k, v in vars(configuration).items() if k.startswith("LLaDA") and k.endswith("Config"))
    import transformers

    record: dict = {"transformers": transformers.__version__, "torch": torch.__version__, "checkpoints": {}}
    for item in args.checkpoint:
        name, _, directory = item.partition("=")
        path = Path(directory)
        raw = json.loads((path / "config.json").read_text())
        mask_id = int(raw["mask_token_id"])
        entry: dict = {"digest": tensor_digest(path), "mask_id": mask_id, "runs": {}}
        for dname, dtype in DTYPES.items():
            cfg = config_cls(**{k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "architectures")})
            model, info = modeling.LLaDAMoEModelLM.from_pretrained(
                str(path), config=cfg, torch_dtype=dtype, output_loading_info=True
            )
            bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            if bad:
                raise SystemExit(f"{name} {dname}: official load report {bad}")
            model.eval()
            entry["attn_implementation"] = model.config._attn_implementation
            with torch.no_grad():
                logits = model(logits_probe(raw["vocab_size"], mask_id)).logits
            entry.setdefault("logits", {})[dname] = logits_digest(logits)
            for case, plen, gen_length, block, steps, temp, remasking, seed in CASES:
                ids = prompts(raw["vocab_size"], mask_id, plen, seed)
                torch.manual_seed(seed)
                out = generate(model, ids, steps=steps, gen_length=gen_length, block_length=block,
                               temperature=temp, cfg_scale=0.0, remasking=remasking, mask_id=mask_id)
                entry["runs"][f"{dname}/{case}"] = {"prompt": ids.tolist(), "output": out.tolist()}
                print(name, dname, case, out[:, plen:].tolist(), flush=True)
        record["checkpoints"][name] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
