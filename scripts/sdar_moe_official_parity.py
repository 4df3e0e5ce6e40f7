"""Run SDAR's official generator on the official SDAR-MoE modeling code and record its tokens (a test fixture).

Run in an environment of its own with transformers 4.x (the official modeling code predates transformers 5; this
script imports no spiffy code)::

    python3 -m venv /work/envs/sdarmoe && /work/envs/sdarmoe/bin/pip install transformers==4.57.1 safetensors
    # torch 2.13 (CPU) in that environment as well
    PYTHONPATH=$PWD python -m spiffy tiny sdar_moe /tmp/sdar-moe-tiny --seed 0
    /work/envs/sdarmoe/bin/python scripts/sdar_moe_official_parity.py --checkpoint /tmp/sdar-moe-tiny \\
        --modeling DIR/modeling_sdar_moe.py --generate DIR/generate.py --out tests/data/sdar_moe_official.json

Sources (read, not copied into spiffy): ``--modeling`` is ``modeling_sdar_moe.py`` of the SDAR-30B-A3B-Chat
checkpoint (a public copy: github.com/Xenearkr/DARE ``models/SDAR-30B-A3B-Chat/modeling_sdar_moe.py`` at commit
fd704cf94a3846025329898d41154b37ebfbb045), ``--generate`` is github.com/JetAstra/SDAR ``generate.py`` at commit
c2041a8333333d685f6e15122c84f60f51f85ebd. Two stand-ins make them run on a CPU, both written here at run time:

* ``flash_attn.ops.triton.layer_norm.rms_norm_fn`` (a Triton GPU kernel the modeling file imports for every
  RMSNorm) is replaced by the float32 RMSNorm the file keeps commented out under it (transformers' Qwen3 RMSNorm:
  normalise in float32, cast back, multiply by the weight);
* ``configuration_sdar_moe.SDARMoeConfig`` (not public in any copy found) is transformers' ``Qwen3MoeConfig`` with
  ``model_type = "sdar_moe"``: the modeling file reads only Qwen3-MoE's fields.

For each dtype (float32, bfloat16) and case the script loads the checkpoint with the official class
(``from_pretrained``, every weight used: the load report must be empty), seeds the global generator with
``torch.manual_seed(seed)`` and calls the official ``block_diffusion_generate`` on ``{"input_ids": prompt}``.
It records the weight digest of the checkpoint, the cases and the output ids (``[1, T]`` as a list), or the
exception's type when the official script fails (such cases are not compared).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

RMS_STUB = '''
import torch


def rms_norm_fn(x, weight, bias=None, eps=1e-6, **kwargs):
    """CPU stand-in for flash-attn's Triton RMSNorm: the modeling file's own commented-out float32 formula."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)
'''

CONFIG_STUB = '''
from transformers import Qwen3MoeConfig


class SDARMoeConfig(Qwen3MoeConfig):
    model_type = "sdar_moe"
'''


def weights_digest(checkpoint: Path) -> str:
    """sha256 over the checkpoint's tensors (names sorted, float32 bytes): the fixture's identity."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def official_modules(modeling: Path, generate: Path, work: Path):  # noqa: ANN201
    """Import the official generator and model class (with the two stand-ins) from a scratch package."""
    (work / "flash_attn" / "ops" / "triton").mkdir(parents=True)
    for d in ("flash_attn", "flash_attn/ops", "flash_attn/ops/triton"):
        (work / d / "__init__.py").write_text("")
    (work / "flash_attn" / "ops" / "triton" / "layer_norm.py").write_text(RMS_STUB)
    pkg = work / "sdar_moe_official"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "configuration_sdar_moe.py").write_text(CONFIG_STUB)
    (pkg / "modeling_sdar_moe.py").write_text(modeling.read_text())
    (work / "sdar_generate.py").write_text(generate.read_text())
    sys.path.insert(0, str(work))
    modeling_mod = importlib.import_module("sdar_moe_official.modeling_sdar_moe")
    generate_mod = importlib.import_module("sdar_generate")
    return modeling_mod.SDARMoeForCausalLM, generate_mod.block_diffusion_generate


def cases() -> list[dict]:
    """Prompt length x block x steps x strategy x sampling x seed (T > 0 only: the official script divides by T)."""
    out = []
    grid = itertools.product(
        [3, 8, 11],  # prompt lengths: unaligned, one whole block of 8, a whole block of 4 plus 3
        [(4, 4), (8, 8), (8, 4)],  # (block_length, denoising_steps)
        ["sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded"],
    )
    for n, (plen, (block, steps), strategy) in enumerate(grid):
        temp, top_k, top_p = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 1.0), (0.8, 0, 0.9)][n % 4]
        out.append(dict(prompt_seed=n, prompt_length=plen, gen_length=16, block_length=block,
                        denoising_steps=steps, temperature=temp, top_k=top_k, top_p=top_p,
                        remasking_strategy=strategy, confidence_threshold=0.2, eb_threshold=0.35, seed=100 + n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--modeling", type=Path, required=True)
    ap.add_argument("--generate", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    config = json.loads((args.checkpoint / "config.json").read_text())
    mask_id = int(config["mask_token_id"])
    with tempfile.TemporaryDirectory() as tmp:
        model_cls, generate = official_modules(args.modeling, args.generate, Path(tmp))
        runs = []
        for dtype in ("float32", "bfloat16"):
            model, info = model_cls.from_pretrained(
                str(args.checkpoint), torch_dtype=getattr(torch, dtype), output_loading_info=True
            )
            problems = {k: v for k, v in info.items() if v}
            if problems:
                raise SystemExit(f"the official class did not load the checkpoint strictly: {problems}")
            model.eval()
            for case in cases():
                prompt = torch.randint(5, 250, (1, case["prompt_length"]),
                                       generator=torch.Generator().manual_seed(case["prompt_seed"]))
                kw = {k: case[k] for k in ("gen_length", "block_length", "denoising_steps", "temperature", "top_k",
                                           "top_p", "remasking_strategy", "confidence_threshold", "eb_threshold")}
                torch.manual_seed(case["seed"])
                try:
                    x = generate(model, {"input_ids": prompt}, mask_id, **kw)
                    runs.append(dict(case, dtype=dtype, prompt=prompt[0].tolist(), output=x[0].tolist()))
                except Exception as exc:  # noqa: BLE001 - the official script's failures are recorded, not compared
                    runs.append(dict(case, dtype=dtype, prompt=prompt[0].tolist(), error=type(exc).__name__))
    payload = {
        "weights_sha256": weights_digest(args.checkpoint),
        "checkpoint_config": config,
        "mask_id": mask_id,
        "torch": torch.__version__,
        "transformers": importlib.import_module("transformers").__version__,
        "runs": runs,
    }
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    ok = sum("output" in r for r in runs)
    print(f"{ok}/{len(runs)} official runs recorded in {args.out}")


if __name__ == "__main__":
    main()
