"""Run the Dream-Coder repository's own Dream modeling and generation code on a tiny checkpoint and record its tokens.

Dream-Coder-7B (Dream-org) and DiffuCoder-7B (apple) are ``model_type`` ``Dream`` checkpoints whose remote code is
Dream's (DiffuCoder's model cards: "we reuse Dream's modeling architecture and generation utils"). Their Hugging
Face files cannot be fetched here, so the official code is taken from github.com/DreamLM/Dream-Coder (a git mirror
made by the ``fetch`` tool), which vendors it:

* ``instruct/src/inference/fast_dllm/configuration_dream.py`` and ``modeling_dream.py``: Dream's ``DreamConfig`` and
  ``DreamModel`` (the Fast-dLLM edition: the same forward without a cache);
* ``instruct/code_eval/lcb/diffusion_utils/dream_utils.py``: Dream's ``DreamGenerationMixin`` (``diffusion_generate``
  with ``alg`` in origin / maskgit_plus / topk_margin / entropy, plus a ``transition_N`` schedule), installed as the
  package's ``generation_utils``.

Run it in an environment with the transformers version those files were written for (this script imports no
spiffy code)::

    python3 -m venv /work/envs/dream_ref
    echo "import site; site.addsitedir('/work/venv/lib/python3.11/site-packages')" \\
        > /work/envs/dream_ref/lib/python3.11/site-packages/zz_work_venv.pth     # torch 2.13 from spiffy's venv
    /work/envs/dream_ref/bin/pip install transformers==4.46.2
    PYTHONPATH=$PWD /work/venv/bin/python -m spiffy tiny dream /tmp/dream-tiny --seed 0
    /work/envs/dream_ref/bin/python scripts/dream_official_parity.py --checkpoint /tmp/dream-tiny \\
        --mirror /work/.mirror/DreamLM+Dream-Coder/repo --out tests/data/dream_official/expected.json

``expected.json`` records the repository commit and files, the transformers / torch versions, a hash of the
checkpoint's weights, the strict-load report and, per case (prompt rows, ``diffusion_generate`` keywords, dtype,
seed of ``torch.manual_seed``), the official output tokens or the error it raised. ``tests/test_dream_official.py``
checks spiffy's ``dream_diffusion_generate`` against it without the official code.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file

FILES = {
    "configuration_dream.py": "instruct/src/inference/fast_dllm/configuration_dream.py",
    "modeling_dream.py": "instruct/src/inference/fast_dllm/modeling_dream.py",
    "generation_utils.py": "instruct/code_eval/lcb/diffusion_utils/dream_utils.py",
}
GEN = 16
PROMPTS = {"one": [[40, 41, 42, 43, 44, 45]], "batch": [[40, 41, 42, 43, 44, 45], [70, 71, 72]]}
#: (name, keywords) of every case; the settings the model cards recommend are named after the model
CASES: list[tuple[str, dict]] = []
for _alg in ("origin", "maskgit_plus", "topk_margin", "entropy"):
    for _tag, _samp in (("greedy", dict(temperature=0.0)), ("t07_p95", dict(temperature=0.7, top_p=0.95)),
                        ("t1_k20", dict(temperature=1.0, top_k=20))):
        for _steps in (GEN, GEN // 2):
            CASES.append((f"{_alg}-{_tag}-s{_steps}", dict(alg=_alg, steps=_steps, **_samp)))
CASES += [
    # DiffuCoder's model cards: alg entropy, alg_temp 0, top_p 0.95, T 0.2 (Base) / 0.3 (Instruct, cpGRPO),
    # steps = max_new_tokens // TOKEN_PER_STEP
    ("diffucoder-base-tps1", dict(alg="entropy", alg_temp=0.0, temperature=0.2, top_p=0.95, steps=GEN)),
    ("diffucoder-instruct-tps1", dict(alg="entropy", alg_temp=0.0, temperature=0.3, top_p=0.95, steps=GEN)),
    ("diffucoder-instruct-tps2", dict(alg="entropy", alg_temp=0.0, temperature=0.3, top_p=0.95, steps=GEN // 2)),
    ("diffucoder-instruct-tps4", dict(alg="entropy", alg_temp=0.0, temperature=0.3, top_p=0.95, steps=GEN // 4)),
    # Dream-Coder-v0-Instruct-7B's model card: alg entropy, alg_temp 0, T 0.1, top_p 0.95, steps = max_new_tokens
    ("dream-coder-instruct", dict(alg="entropy", alg_temp=0.0, temperature=0.1, top_p=0.95, steps=GEN)),
    # the generation_config.json defaults (alg origin, eps 1e-3, steps as given, T 0)
    ("generation-config-defaults", dict(steps=GEN)),
    # alg_temp > 0: this vendored copy samples from the untempered confidences (see the test)
    ("maskgit_plus-alg_temp", dict(alg="maskgit_plus", alg_temp=0.5, steps=GEN // 2)),
    ("entropy-alg_temp", dict(alg="entropy", alg_temp=0.5, steps=GEN // 2)),
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _install_official(mirror: Path, commit: str, root: Path) -> str:
    """Write the official files as the package ``dream_official`` under ``root``; returns the package name."""
    pkg = root / "dream_official"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    for name, path in FILES.items():
        text = subprocess.run(["git", "--git-dir", str(mirror), "show", f"{commit}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        (pkg / name).write_text(text, encoding="utf-8")
    sys.path.insert(0, str(root))
    return "dream_official"


def _state(checkpoint: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    return state


def _weights_hash(checkpoint: Path) -> str:
    """sha256 over the checkpoint's tensors (name, dtype, shape, bytes) in name order: the same for any sharding."""
    state = _state(checkpoint)
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _batch(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def dumps(record: dict) -> str:
    """JSON with one line per list of token ids (readable diffs, a small file)."""
    text = json.dumps(record, indent=1)
    return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--mirror", type=Path, required=True, help="git dir of github.com/DreamLM/Dream-Coder")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    commit = subprocess.run(["git", "--git-dir", str(args.mirror), "rev-parse", args.commit], check=True,
                            capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        name = _install_official(args.mirror, commit, Path(tmp))
        modeling = importlib.import_module(f"{name}.modeling_dream")
        cfg = json.loads((args.checkpoint / "config.json").read_text(encoding="utf-8"))
        mask_id, pad_id = int(cfg["mask_token_id"]), int(cfg["pad_token_id"])
        record: dict = {
            "repo": "github.com/DreamLM/Dream-Coder", "commit": commit, "files": FILES,
            "transformers": version("transformers"), "torch": torch.__version__,
            "checkpoint": {"family": "dream", "seed": 0, "weights_sha256": _weights_hash(args.checkpoint)},
            "gen_length": GEN, "mask_token_id": mask_id, "prompts": PROMPTS, "dtypes": {}, "load": {},
        }
        for dname, dtype in DTYPES.items():
            # the official from_pretrained override cannot return loading info: compare the key sets instead
            model = modeling.DreamModel.from_pretrained(str(args.checkpoint), torch_dtype=dtype)
            model.eval()
            stored = set(_state(args.checkpoint))
            own = set(model.state_dict())
            record["load"][dname] = {"missing_keys": sorted(own - stored), "unexpected_keys": sorted(stored - own)}
            results = {}
            for case_name, kw in CASES:
                for pname, rows in PROMPTS.items():
                    ids, mask = _batch(rows, pad_id)
                    seed = 1000 + len(results)
                    torch.manual_seed(seed)
                    entry: dict = {"case": case_name, "prompt": pname, "seed": seed, "kwargs": kw}
                    try:
                        out = model.diffusion_generate(ids, attention_mask=mask if pname == "batch" else None,
                                                       max_new_tokens=GEN, mask_token_id=mask_id,
                                                       return_dict_in_generate=True, **kw)
                        entry["sequences"] = out.sequences.tolist()
                    except Exception as exc:  # noqa: BLE001 - the official code's own failure is the record
                        entry["error"] = f"{type(exc).__name__}: {exc}"
                    results[f"{case_name}/{pname}"] = entry
            record["dtypes"][dname] = results
            print(dname, sum("error" in e for e in results.values()), "errors of", len(results), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(record), encoding="utf-8")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
