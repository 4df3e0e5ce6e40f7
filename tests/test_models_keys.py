"""Checkpoint-key compatibility, strict loading, file layouts, Auto-class registration, dispatch and errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import spiffy
from spiffy.errors import CheckpointError, CheckpointKeyError, MissingTokenError, UnknownModelTypeError
from spiffy.models import family_of, load_model, load_tokenizer, mask_token_id, special_token_ids
from spiffy.models.loading import INDEX_FILE, SINGLE_FILE, load_state_dict, save_checkpoint

# ---- expected official parameter names (SPEC section 3), written out independently of the model code ----


def llada_keys(n_layers: int, tied: bool = False) -> set[str]:
    keys = {"model.transformer.wte.weight", "model.transformer.ln_f.weight"}
    if not tied:
        keys.add("model.transformer.ff_out.weight")
    for i in range(n_layers):
        p = f"model.transformer.blocks.{i}."
        keys |= {p + "attn_norm.weight", p + "ff_norm.weight"}
        keys |= {p + f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")}
    return keys


def qwen_keys(n_layers: int, qkv_bias: bool, qk_norm: bool, head: bool = True) -> set[str]:
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if head:
        keys.add("lm_head.weight")
    for i in range(n_layers):
        p = f"model.layers.{i}."
        keys |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        if qkv_bias:
            keys |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"}
        if qk_norm:
            keys |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        keys |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    return keys


EXPECTED = {
    "llada": lambda n: llada_keys(n),
    "dream": lambda n: qwen_keys(n, qkv_bias=True, qk_norm=False),
    "sdar": lambda n: qwen_keys(n, qkv_bias=False, qk_norm=True),
    "qwen3": lambda n: qwen_keys(n, qkv_bias=False, qk_norm=True),
}

CLASS_NAMES = {"llada": "LLaDAModelLM", "dream": "DreamModel", "sdar": "SDARForCausalLM", "qwen3": "Qwen3ForCausalLM"}
MODEL_TYPES = {"llada": "llada", "dream": "Dream", "sdar": "sdar", "qwen3": "qwen3"}


@pytest.fixture(params=["llada", "dream", "sdar", "qwen3"])
def tiny_any(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(f"tiny_{request.param}")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_state_dict_keys_are_the_official_names(tiny_any: tuple[str, Path]) -> None:
    family, path = tiny_any
    model = load_model(path)
    assert type(model).__name__ == CLASS_NAMES[family]
    assert set(model.state_dict().keys()) == EXPECTED[family](2)
    stored = set(load_state_dict(path).keys())
    assert stored == EXPECTED[family](2)


def test_layout_config_and_shards(tiny_any: tuple[str, Path]) -> None:
    family, path = tiny_any
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == MODEL_TYPES[family]
    assert cfg["architectures"] == [CLASS_NAMES[family]]
    if family == "qwen3":
        assert "auto_map" not in cfg
    else:
        assert cfg["auto_map"] == spiffy.models.FAMILIES[family].auto_map
        assert cfg["auto_map"]["AutoConfig"].startswith("configuration_")
    index = json.loads((path / INDEX_FILE).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((path / s).is_file() for s in shards)
    assert not (path / SINGLE_FILE).exists()
    assert (path / "generation_config.json").is_file() and (path / "tokenizer.json").is_file()


def test_official_8b_shapes_llada() -> None:
    """LLaDA-8B facts from SPEC section 3, built on the meta device (no memory)."""
    from spiffy.models.llada import LLaDAConfig, LLaDAModelLM

    with torch.device("meta"):
        model = LLaDAModelLM(LLaDAConfig())
    sd = model.state_dict()
    assert set(sd) == llada_keys(32)
    assert tuple(sd["model.transformer.wte.weight"].shape) == (126464, 4096)
    assert tuple(sd["model.transformer.blocks.0.ff_proj.weight"].shape) == (12288, 4096)
    assert tuple(sd["model.transformer.ff_out.weight"].shape) == (126464, 4096)
    assert model.config.mask_token_id == 126336 and model.config.rope_theta == 500000.0


def test_official_shapes_dream_sdar() -> None:
    from spiffy.models.dream import DreamConfig, DreamModel
    from spiffy.models.sdar import SDARConfig, SDARForCausalLM

    with torch.device("meta"):
        dream = DreamModel(DreamConfig())
        sdar = SDARForCausalLM(SDARConfig())
    d = dream.state_dict()
    assert set(d) == qwen_keys(28, qkv_bias=True, qk_norm=False)
    assert tuple(d["model.layers.0.self_attn.k_proj.weight"].shape) == (512, 3584)  # 4 KV heads x 128
    assert tuple(d["model.layers.0.self_attn.q_proj.bias"].shape) == (3584,)
    s = sdar.state_dict()
    assert set(s) == qwen_keys(36, qkv_bias=False, qk_norm=True)
    assert tuple(s["model.layers.0.self_attn.q_proj.weight"].shape) == (4096, 4096)
    assert tuple(s["model.layers.0.self_attn.k_norm.weight"].shape) == (128,)
    assert tuple(s["lm_head.weight"].shape) == (151936, 4096)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_auto_classes_load_without_remote_code(family: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    path = request.getfixturevalue(f"tiny_{family}")
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == MODEL_TYPES[family]
    ref = load_model(path, dtype=torch.float64)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    assert type(lm).__name__ == CLASS_NAMES[family]
    ref_state = ref.state_dict()
    for name, tensor in lm.state_dict().items():  # the same weights, bit for bit
        assert torch.equal(tensor, ref_state[name]), name
    ids = torch.arange(3, 13)[None]
    # two loads allocate the weights differently: equal to rounding, not bitwise
    torch.testing.assert_close(lm(ids).logits, ref(ids).logits, rtol=0, atol=1e-12)
    base = AutoModel.from_pretrained(path)
    expected_base = "SDARModel" if family == "sdar" else CLASS_NAMES[family]
    assert type(base).__name__ == expected_base


def test_single_file_checkpoint_loads_identically(tiny_llada: Path, tmp_path: Path) -> None:
    model = load_model(tiny_llada, dtype=torch.float64)
    out = save_checkpoint(model, tmp_path / "single", max_shard_bytes=1 << 40)
    assert (out / SINGLE_FILE).is_file() and not (out / INDEX_FILE).exists()
    again = load_model(out, dtype=torch.float64)
    # what loading produces is compared bit for bit
    loaded, original = again.state_dict(), model.state_dict()
    assert set(loaded) == set(original)
    for name, tensor in original.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    # logits computed from differently aligned tensors (safetensors reads need not sit on a 64-byte boundary, so
    # BLAS may take another kernel path) agree to rounding, not bitwise
    ids = torch.arange(5, 20)[None]
    torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=1e-12)


def test_logits_shape_and_dtype(tiny_any: tuple[str, Path]) -> None:
    family, path = tiny_any
    model = load_model(path, dtype="float64")
    tok = load_tokenizer(path)
    ids = torch.tensor([tok("def add(a, b):\n    return a + b")["input_ids"]] * 2)
    out = model(ids)
    assert out.logits.shape == (2, ids.shape[1], len(tok))
    assert out.logits.dtype == torch.float64
    assert torch.isfinite(out.logits).all()


# ---- strict loading ----


def _rewrite_shard(path: Path, edit) -> None:  # noqa: ANN001
    """Apply ``edit(dict) -> dict`` to every shard and rewrite the index to match."""
    index_path = path / INDEX_FILE
    index = json.loads(index_path.read_text())
    new_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = edit(load_file(str(path / shard)))
        save_file(tensors, str(path / shard), metadata={"format": "pt"})
        new_map.update({k: shard for k in tensors})
    index["weight_map"] = new_map
    index_path.write_text(json.dumps(index))


def test_strict_rejects_renamed_key(tiny_sdar: Path, tmp_path: Path) -> None:
    path = _copy(tiny_sdar, tmp_path / "ckpt")
    old = "model.layers.1.self_attn.q_norm.weight"

    def edit(t: dict) -> dict:
        if old in t:
            t["model.layers.1.self_attn.query_norm.weight"] = t.pop(old)
        return t

    _rewrite_shard(path, edit)
    with pytest.raises(CheckpointKeyError) as err:
        load_model(path)
    assert old in err.value.missing
    assert "model.layers.1.self_attn.query_norm.weight" in err.value.unexpected
    assert old in str(err.value) and "query_norm" in str(err.value)


def test_strict_rejects_missing_and_extra_key(tiny_llada: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llada, tmp_path / "ckpt")
    gone = "model.transformer.blocks.0.up_proj.weight"

    def edit(t: dict) -> dict:
        t.pop(gone, None)
        if "model.transformer.ln_f.weight" in t:
            t["model.transformer.extra.weight"] = torch.zeros(3)
        return t

    _rewrite_shard(path, edit)
    with pytest.raises(CheckpointKeyError) as err:
        load_model(path)
    assert err.value.missing == [gone]
    assert err.value.unexpected == ["model.transformer.extra.weight"]


def test_strict_rejects_shape_mismatch(tiny_dream: Path, tmp_path: Path) -> None:
    path = _copy(tiny_dream, tmp_path / "ckpt")
    key = "model.layers.0.self_attn.q_proj.bias"

    def edit(t: dict) -> dict:
        if key in t:
            t[key] = torch.zeros(t[key].numel() + 1)
        return t

    _rewrite_shard(path, edit)
    with pytest.raises(CheckpointKeyError) as err:
        load_model(path)
    assert any(key in s for s in err.value.shape_mismatch)


def test_strict_qwen3_missing_key(tiny_qwen3: Path, tmp_path: Path) -> None:
    path = _copy(tiny_qwen3, tmp_path / "ckpt")
    gone = "model.layers.0.mlp.up_proj.weight"
    _rewrite_shard(path, lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(CheckpointKeyError) as err:
        load_model(path)
    assert err.value.missing == [gone]


def test_tied_qwen3_roundtrip(tmp_path: Path) -> None:
    from spiffy.models.tiny import make_tiny

    path = make_tiny("qwen3", tmp_path / "tied", tie_word_embeddings=True)
    keys = set(load_state_dict(path))
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    model = load_model(path, dtype=torch.float64)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


# ---- errors and dispatch ----


def test_missing_directory_and_files(tmp_path: Path, tiny_llada: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path / "empty")
    path = _copy(tiny_llada, tmp_path / "noweights")
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="shard files"):
        load_model(path)
    (path / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path)
    (tmp_path / "notok").mkdir()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "notok")


def test_unknown_model_type_lists_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnknownModelTypeError) as err:
        load_model(tmp_path)
    msg = str(err.value)
    for name in ("'llada'", "'Dream'", "'sdar'", "'qwen3'", "gpt2"):
        assert name in msg


def test_family_of_and_dflash_dispatch(tiny_llada: Path, tiny_dream: Path, tiny_sdar: Path, tiny_qwen3: Path) -> None:
    assert [family_of(p) for p in (tiny_llada, tiny_dream, tiny_sdar, tiny_qwen3)] == ["llada", "dream", "sdar", "qwen3"]
    assert family_of({"model_type": "qwen3", "dflash_config": {"mask_token_id": 7}}) == "dflash"
    assert family_of({"model_type": "qwen3", "architectures": ["DFlashDraftModel"]}) == "dflash"
    assert family_of(load_model(tiny_dream)) == "dream"


def test_dtype_argument_forms(tiny_sdar: Path) -> None:
    assert load_model(tiny_sdar, dtype="bf16").model.embed_tokens.weight.dtype == torch.bfloat16
    assert load_model(tiny_sdar, dtype=torch.float64).lm_head.weight.dtype == torch.float64
    assert load_model(tiny_sdar, dtype="auto").lm_head.weight.dtype == torch.float32
    with pytest.raises(spiffy.ConfigError, match="unknown dtype"):
        load_model(tiny_sdar, dtype="float8")


# ---- special tokens ----


def test_special_token_ids_come_from_config_and_tokenizer(tiny_any: tuple[str, Path]) -> None:
    family, path = tiny_any
    tok = load_tokenizer(path)
    cfg = json.loads((path / "config.json").read_text())
    ids = special_token_ids(path)
    assert ids.eos == cfg["eos_token_id"] == tok.eos_token_id
    assert ids.pad == tok.pad_token_id
    eot = {"llada": "<|eot_id|>"}.get(family, "<|im_end|>")
    assert ids.eot == tok.convert_tokens_to_ids(eot)
    if family == "qwen3":
        assert ids.mask is None
        with pytest.raises(MissingTokenError):
            mask_token_id(path)
    else:
        mask_tok = {"llada": "<|mdm_mask|>", "dream": "<|mask|>", "sdar": "<|MASK|>"}[family]
        assert ids.mask == cfg["mask_token_id"] == tok.convert_tokens_to_ids(mask_tok) == mask_token_id(load_model(path))


def test_mask_id_falls_back_to_tokenizer_then_errors(tiny_sdar: Path, tmp_path: Path) -> None:
    """Official SDAR configs carry no mask_token_id: the tokenizer's <|MASK|> is used."""
    path = _copy(tiny_sdar, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    expected = cfg.pop("mask_token_id")
    (path / "config.json").write_text(json.dumps(cfg))
    assert mask_token_id(path) == expected
    assert mask_token_id(load_model(path), load_tokenizer(path)) == expected
    with pytest.raises(MissingTokenError, match="mask"):
        mask_token_id(load_model(path))
