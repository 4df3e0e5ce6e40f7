"""Run the official Fast-dLLM v2 generators on a spiffy tiny checkpoint and record their tokens.

Run in an environment with the official code's transformers (not spiffy's; this script imports no spiffy code)::

    python -m venv /work/envs/fdllm_v2 && /work/envs/fdllm_v2/bin/pip install transformers==4.53.1 einops  # + torch
    PYTHONPATH=$PWD python -m spiffy tiny fast_dllm_v2 /tmp/fdv2 --seed 0
    /work/envs/fdllm_v2/bin/python scripts/fast_dllm_v2_official_parity.py --official DIR --ckpt /tmp/fdv2 \\
        --out tests/data/fast_dllm_v2/expected.json

``--official DIR`` holds the official files, unmodified:

* ``modeling.py`` and ``configuration.py`` of the checkpoints' Hub repository (Efficient-Large-Model/Fast_dLLM_v2_7B;
  the 1.5B repository ships the same code), taken from a public snapshot of the repository's files:
  github.com/Satgoy152/DualDiffusion, commit d3a3470094c767d8b4d6fa92a2704a7feec4e64c,
  ``FastDLLM_inferencing/Fast_dLLM_v2_7B/`` (the snapshot's ``generate`` was already edited: it keeps the
  sub-block cache across blocks, so only its ``use_block_cache=False`` path is compared);
* ``generation_functions.py`` of github.com/NVlabs/Fast-dLLM ``v2/`` at commit
  6cf27228858eb57c445e1fad764003543e72a0db (``batch_sample``, bound to the model as ``v2/eval.py`` binds it).

For every case (prompt lengths inside / equal to / over one block, aligned and not; block sizes 4, 8, 16 and 24;
sub-blocks; thresholds; T = 0 and seeded T > 0; the sub-block cache on and off; the stop token on and off), both
dtypes (float32, bfloat16), it records the output of ``batch_sample`` and of ``generate`` (when comparable), each cut
after its first stop token past the prompt, and checks the official loader's strict report (no missing or unexpected
keys). A case where the model proposes the mask id forever spins the official loop: the cases avoid it.
``tests/test_fast_dllm_v2.py`` checks spiffy against the file without the official code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import types

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

#: (prompt length, block, sub-block, threshold, temperature, use_block_cache, stop on) per case and dtype
CASES = [
    (3, 8, 4, 0.9, 0.0, False, True), (8, 8, 4, 0.5, 0.0, False, True), (11, 8, 2, 0.7, 0.0, True, False),
    (16, 8, 8, 1.0, 0.0, False, False), (21, 8, 4, 0.3, 0.0, True, True), (5, 24, 8, 0.6, 0.0, False, False),
    (13, 8, 4, 0.9, 0.8, False, False), (16, 8, 4, 0.5, 1.0, True, True), (7, 4, 2, 0.8, 0.7, False, False),
    (40, 16, 4, 0.6, 0.0, False, False), (4, 4, 4, 0.2, 0.0, True, False), (9, 8, 4, 0.95, 0.9, True, False),
]
#: the bfloat16 model proposes the mask id forever at case 1's settings (the official loop would spin): these instead
BF16_CASE_1 = dict(small_block_size=2, threshold=0.9, temperature=0.6)


def weights_digest(ckpt: str) -> str:
    """sha256 over the checkpoint's tensors (sorted names, float32 bytes): spiffy's make_tiny must rebuild them."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(ckpt, f)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def cases(config: dict) -> list[dict]:
    rng = random.Random(0)
    out = []
    for dtype in ("float32", "bfloat16"):
        for i, (p, bs, sb, thr, temp, ubc, stop) in enumerate(CASES):
            case = dict(dtype=dtype, prompt=[rng.randrange(0, config["pad_token_id"]) for _ in range(p)],
                        block_size=bs, small_block_size=sb, threshold=thr, temperature=temp, top_p=0.95,
                        use_block_cache=ubc, seed=rng.randrange(1000), max_new_tokens=3 * bs,
                        mask_id=config["mask_token_id"], pad=config["pad_token_id"],
                        stop=config["eos_token_id"] if stop else -1)
            if dtype == "bfloat16" and i == 1:
                case.update(BF16_CASE_1)
            out.append(case)
    return out


def load(official: str, ckpt: str, dtype: torch.dtype):
    d = tempfile.mkdtemp()
    for f in os.listdir(ckpt):
        if f.endswith((".json", ".safetensors")):
            shutil.copy(os.path.join(ckpt, f), d)
    for f in ("modeling.py", "configuration.py"):
        shutil.copy(os.path.join(official, f), d)
    model, info = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True, torch_dtype=dtype,
                                                       output_loading_info=True)
    if any(info.values()):
        raise SystemExit(f"the official loader reports {info}")
    model.eval()
    sys.path.insert(0, official)
    import generation_functions  # the official file, as v2/eval.py imports it

    model.batch_sample = types.MethodType(generation_functions.Fast_dLLM_QwenForCausalLM.batch_sample, model)
    return model


def cut(ids: torch.Tensor, start: int, stop: int) -> list[int]:
    row = ids.tolist()
    for i in range(start, len(row)):
        if row[i] == stop:
            return row[: i + 1]
    return row


class _Tokenizer:  # batch_sample reads pad_token_id only
    def __init__(self, pad: int) -> None:
        self.pad_token_id = pad


def run_case(model, case: dict) -> dict:
    ids = torch.tensor([case["prompt"]], dtype=torch.long)
    p = ids.shape[1]
    torch.manual_seed(case["seed"])
    res = model.batch_sample(ids.clone(), _Tokenizer(case["pad"]), case["block_size"], case["max_new_tokens"],
                             case["small_block_size"], p, torch.tensor([p]), mask_id=case["mask_id"],
                             threshold=case["threshold"], stop_token=case["stop"],
                             use_block_cache=case["use_block_cache"], top_p=case["top_p"],
                             temperature=case["temperature"])
    row = {"batch_sample": cut(res[0], p, case["stop"])}
    if not case["use_block_cache"]:
        torch.manual_seed(case["seed"])
        g = model.generate(ids.clone(), case["max_new_tokens"], mask_id=case["mask_id"], threshold=case["threshold"],
                           small_block_size=case["small_block_size"], block_size=case["block_size"],
                           stop_token=case["stop"], top_p=case["top_p"], temperature=case["temperature"],
                           use_block_cache=False)
        row["generate"] = cut((g[0] if isinstance(g, tuple) else g)[0], p, case["stop"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--official", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    config = json.load(open(os.path.join(args.ckpt, "config.json")))
    todo = cases(config)
    models: dict[str, torch.nn.Module] = {}
    for case in todo:
        if case["dtype"] not in models:
            models[case["dtype"]] = load(args.official, args.ckpt, getattr(torch, case["dtype"]))
        case["official"] = run_case(models[case["dtype"]], case)
    import transformers

    record = {"weights_sha256": weights_digest(args.ckpt), "transformers": transformers.__version__,
              "torch": torch.__version__, "cases": todo}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
