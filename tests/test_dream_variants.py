"""Dream-Coder-7B and DiffuCoder-7B: ``model_type`` ``Dream`` checkpoints decoded as spiffy's Dream family.

Their real ``config.json``, ``generation_config.json`` and ``added_tokens.json`` are fixtures in
``tests/data/real_configs`` (provenance, and which ones are reconstructed, in its SOURCES.md). Checked here: the
family and the real size on the meta device (7,615,616,512 parameters: the Qwen2.5(-Coder)-7B shape, 15.23 GB of
bf16 shards in both Hugging Face repositories), the special tokens (the published ``added_tokens.json`` sizes are
reproduced byte for byte), every generation-config field honoured or refused, and the model cards' recommended
calls decoding exactly with Spiffy, alone and in batches.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_real_architectures import CONFIGS, LAYOUTS, _config, _meta_model

from spiffy.decoding.dream_generation import dream_generation_options, official_call_defaults
from spiffy.errors import ConfigError
from spiffy.models import load_config
from spiffy.models.loading import special_token_ids

#: fixture name -> (published added_tokens.json size in bytes, the pad token of its tokenizer)
VARIANTS = {
    "Dream-org--Dream-Coder-v0-Instruct-7B": 656,
    "apple--DiffuCoder-7B-Instruct": 681,
}
QWEN25_7B_PARAMETERS = 7_615_616_512  # Qwen2.5-7B's bf16 index total_size 15,231,233,024 / 2


@pytest.mark.parametrize("name", list(VARIANTS))
def test_real_size_on_meta(name: str, tmp_path: Path) -> None:
    family, model = _meta_model(name, tmp_path)
    assert family == "dream"
    layout = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert layout == LAYOUTS["dream"](_config(name))
    count = sum(p.numel() for p in model.parameters())
    print(f"\n{name.replace('--', '/')}: {count:,} parameters (published 7.6B)")
    assert count == QWEN25_7B_PARAMETERS


@pytest.mark.parametrize("name", list(VARIANTS))
def test_special_tokens(name: str, tmp_path: Path) -> None:
    path = CONFIGS / f"{name}.added_tokens.json"
    assert path.stat().st_size == VARIANTS[name]  # the size the Hugging Face file listing shows
    added = json.loads(path.read_text())
    assert added["<|mask|>"] == 151666 and added["<|beginoftext|>"] == 151665 and added["<|im_end|>"] == 151645
    assert ("<|dlm_pad|>" in added) == name.startswith("apple--")
    if "<|dlm_pad|>" in added:
        assert added["<|dlm_pad|>"] == 151667
    ckpt = tmp_path / name
    ckpt.mkdir()
    shutil.copy(CONFIGS / f"{name}.config.json", ckpt / "config.json")
    ids = special_token_ids(load_config(ckpt))
    assert (ids.family, ids.mask, ids.eos, ids.pad) == ("dream", 151666, 151643, 151643)
    assert max(added.values()) < load_config(ckpt).vocab_size


@pytest.mark.parametrize("name", [*VARIANTS, "Dream-org--Dream-v0-Instruct-7B"])
def test_generation_config_fields_are_honoured(name: str) -> None:
    path = CONFIGS / f"{name}.generation_config.json"
    data = json.loads(path.read_text())
    options = dream_generation_options(path)
    assert options == {k: data[k] for k in data if k in options}
    assert set(data) - set(options) <= {"_from_model_config", "transformers_version", "bos_token_id", "eos_token_id",
                                         "pad_token_id"}
    if "alg" in data:  # Dream's and DiffuCoder's: the class defaults, written out
        assert options["alg"] == "origin" and options["steps"] == 512 and options["eps"] == 1e-3


@pytest.mark.parametrize("field, value, message", [
    ("eos_penalty", 3.0, "eos_penalty"),
    ("num_return_sequences", 2, "num_return_sequences"),
    ("alg", "transition_10", "transition"),
    ("alg", "confidence", "unknown"),
    ("generation_kwargs", {"x": 1}, "generation_kwargs"),
    ("do_sample", True, "do_sample"),
])
def test_generation_config_refusals(field: str, value, message: str) -> None:
    data = json.loads((CONFIGS / "Dream-org--Dream-v0-Instruct-7B.generation_config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        dream_generation_options({**data, field: value})
    assert dream_generation_options({**data, "eos_penalty": 0.0, "num_return_sequences": 1})["alg"] == "origin"


def test_official_call_defaults_come_from_the_model_config(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    shutil.copy(CONFIGS / "apple--DiffuCoder-7B-Instruct.config.json", ckpt / "config.json")
    got = official_call_defaults(load_config(ckpt))
    assert got == {"steps": 512, "eps": 1e-3, "alg": "origin", "alg_temp": None, "temperature": 1.0, "top_k": 50,
                   "top_p": 1.0, "mask_token_id": 151666}
    assert official_call_defaults({"temperature": 0.5}, transformers4=False)["top_k"] is None


def test_card_calls_match_the_wrapper() -> None:
    """card_decode_options is the DecodeConfig of the official call (the wrapper with official_defaults resolves
    the same fields)."""
    from spiffy.decoding.dream_generation import MODEL_CARD_CALLS, card_decode_options

    for name, call in MODEL_CARD_CALLS.items():
        opts = card_decode_options(name, 256, 2)
        assert opts["steps"] == 128 and opts["top_k"] == 50 and opts["alg"] == "entropy"
        assert opts["temperature"] == call["temperature"] and opts["top_p"] == 0.95
    with pytest.raises(ConfigError, match="divide"):
        card_decode_options("apple/DiffuCoder-7B-Instruct", 256, 3)
    with pytest.raises(ConfigError, match="no model-card call"):
        card_decode_options("apple/DiffuCoder-14B", 256)


def test_generation_config_drives_the_wrapper(tiny_dream: Path, tmp_path: Path) -> None:
    """A checkpoint carrying DiffuCoder's generation_config.json: the drop-in wrapper reads it (as a path, the
    checkpoint directory or a dict) the way the official code reads a generation-config object; explicit keywords
    win; a refused field raises before decoding."""
    import torch

    from conftest import load_f64
    from spiffy.compat import dream_diffusion_generate

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dream, ckpt)
    shutil.copy(CONFIGS / "apple--DiffuCoder-7B-Instruct.generation_config.json", ckpt / "generation_config.json")
    model = load_f64(ckpt)
    ids = torch.tensor([[40, 41, 42]])
    data = json.loads((ckpt / "generation_config.json").read_text())
    runs = [dream_diffusion_generate(model, ids, generation_config=g, max_new_tokens=8, steps=8, seed=3).tolist()
            for g in (ckpt, ckpt / "generation_config.json", data)]
    assert runs[0] == runs[1] == runs[2]
    # the file's alg (origin), eps and temperature are the ones used: the same call spelled out
    assert runs[0] == dream_diffusion_generate(model, ids, max_new_tokens=8, steps=8, seed=3, alg="origin",
                                               eps=1e-3, temperature=0.0).tolist()
    entropy = dream_diffusion_generate(model, ids, generation_config=data, max_new_tokens=8, steps=8, seed=3,
                                       alg="entropy").tolist()
    assert entropy == dream_diffusion_generate(model, ids, max_new_tokens=8, steps=8, seed=3, alg="entropy").tolist()
    with pytest.raises(ConfigError, match="eos_penalty"):
        dream_diffusion_generate(model, ids, generation_config={**data, "eos_penalty": 3.0}, max_new_tokens=8)
    # Dream-Coder's file names no rule field: the official code then starts from DreamGenerationConfig's class
    # defaults (temperature 0, no top_k), not from the model config's, even with official_defaults
    coder = CONFIGS / "Dream-org--Dream-Coder-v0-Instruct-7B.generation_config.json"
    kw = dict(max_new_tokens=8, steps=8, seed=3, alg="entropy")
    with_file = dream_diffusion_generate(model, ids, generation_config=coder, official_defaults=True, **kw).tolist()
    assert with_file == dream_diffusion_generate(model, ids, temperature=0.0, top_k=None, **kw).tolist()
    assert dream_diffusion_generate(model, ids, official_defaults=True, **kw).tolist() == \
        dream_diffusion_generate(model, ids, temperature=1.0, top_k=50, top_p=1.0, **kw).tolist()


def test_sliding_window_is_refused(tmp_path: Path) -> None:
    """use_sliding_window=true is refused by name (the released configs say false; sliding_window 131072 is then
    unused, as in the official SDPA attention)."""
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    data = _config("apple--DiffuCoder-7B-Instruct")
    (ckpt / "config.json").write_text(json.dumps({**data, "use_sliding_window": True}))
    config = load_config(ckpt)
    from spiffy.models.dream import DreamModel

    with pytest.raises(ConfigError, match="use_sliding_window"):
        import torch

        with torch.device("meta"):
            DreamModel(config)
