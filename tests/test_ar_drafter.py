"""DFlash drafter: checkpoint layout, strict loading, mismatch errors, forward semantics, context cache, hooks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spiffy.arspec import ddtree_generate
from spiffy.models import load_target, make_tiny_dflash, make_tiny_target, save_drafter
from spiffy.models.dflash import DFlashDraftModel, TargetFeatureHooks, default_target_layer_ids, load_drafter
from spiffy.errors import CheckpointError, CheckpointKeyError, DrafterMismatchError, MissingTokenError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ar_drafter")
    target = make_tiny_target(root / "target", seed=1, num_layers=3, with_tokenizer=False)
    drafter = make_tiny_dflash(root / "drafter", target, seed=2, num_layers=2, block_size=8)
    return target, drafter


def _expected_keys(n_layers: int) -> set[str]:
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(n_layers):
        keys |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
        keys |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        keys |= {f"layers.{i}.self_attn.q_norm.weight", f"layers.{i}.self_attn.k_norm.weight"}
        keys |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return keys


def test_checkpoint_layout_and_keys(pair):
    target, drafter_dir = pair
    cfg = json.loads((drafter_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert set(cfg["dflash_config"]) >= {"target_layer_ids", "mask_token_id"}
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 3
    index = json.loads((drafter_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert set(index["weight_map"]) == _expected_keys(2)
    m = load_drafter(drafter_dir, dtype=torch.float64)
    assert set(m.state_dict()) == _expected_keys(2)
    tcfg = json.loads((target / "config.json").read_text())
    h = tcfg["hidden_size"]
    assert tuple(m.fc.weight.shape) == (h, len(m.target_layer_ids) * h)
    assert m.fc.bias is None
    assert m.dtype == torch.float64


def test_single_file_and_sharded_load_identically(pair, tmp_path):
    _, drafter_dir = pair
    a = load_drafter(drafter_dir, dtype="float64")
    save_drafter(a, tmp_path / "single", num_shards=1)
    assert (tmp_path / "single" / "model.safetensors").is_file()
    b = load_drafter(tmp_path / "single")
    assert b.dtype == torch.float64  # stored dtype kept when dtype is None
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])


def test_tiny_drafter_is_deterministic(pair, tmp_path):
    target, _ = pair
    d1 = make_tiny_dflash(tmp_path / "a", target, seed=5)
    d2 = make_tiny_dflash(tmp_path / "b", target, seed=5)
    d3 = make_tiny_dflash(tmp_path / "c", target, seed=6)
    files = sorted(p.name for p in d1.glob("*.safetensors"))
    assert files and all((d1 / f).read_bytes() == (d2 / f).read_bytes() for f in files)
    assert any((d1 / f).read_bytes() != (d3 / f).read_bytes() for f in files)


def _rewrite_single(src: Path, dst: Path, edit) -> Path:
    m = load_drafter(src)
    save_drafter(m, dst, num_shards=1)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_strict_loading_names_bad_keys(pair, tmp_path):
    _, drafter_dir = pair

    def rename(s):
        s["layers.0.self_attn.q_proj.weights"] = s.pop("layers.0.self_attn.q_proj.weight")

    with pytest.raises(CheckpointKeyError) as exc:
        load_drafter(_rewrite_single(drafter_dir, tmp_path / "renamed", rename))
    assert "layers.0.self_attn.q_proj.weight" in exc.value.missing
    assert "layers.0.self_attn.q_proj.weights" in exc.value.unexpected
    assert "layers.0.self_attn.q_proj.weight" in str(exc.value)

    with pytest.raises(CheckpointKeyError, match="embed_tokens"):
        load_drafter(_rewrite_single(drafter_dir, tmp_path / "extra", lambda s: s.update({"embed_tokens.weight": torch.zeros(3, 3)})))
    with pytest.raises(CheckpointKeyError, match="hidden_norm.weight"):
        load_drafter(_rewrite_single(drafter_dir, tmp_path / "missing", lambda s: s.pop("hidden_norm.weight")))

    def reshape(s):
        s["fc.weight"] = s["fc.weight"][:, :-1].contiguous()

    with pytest.raises(CheckpointKeyError, match="fc.weight"):
        load_drafter(_rewrite_single(drafter_dir, tmp_path / "shape", reshape))


def test_loader_errors_for_wrong_directories(pair, tmp_path):
    target, drafter_dir = pair
    with pytest.raises(CheckpointError, match="config.json"):
        load_drafter(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not a DFlash drafter"):
        load_drafter(target)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((drafter_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="safetensors"):
        load_drafter(bare)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    nomask = tmp_path / "nomask"
    nomask.mkdir()
    (nomask / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MissingTokenError, match="mask_token_id"):
        load_drafter(nomask)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(28, 1) == [14]
    ids = default_target_layer_ids(40, 3)
    assert ids == [round(1 + i * 36 / 2) for i in range(3)]


def test_mismatch_errors(pair, tmp_path):
    target_dir, drafter_dir = pair
    target = load_target(target_dir, torch.float64, "cpu")
    other = make_tiny_target(tmp_path / "other", seed=0, hidden_size=32, num_layers=3, with_tokenizer=False)
    wrong_hidden = load_drafter(make_tiny_dflash(tmp_path / "dh", other, seed=0), dtype=torch.float64)
    with pytest.raises(DrafterMismatchError, match="hidden_size"):
        ddtree_generate(target, wrong_hidden, [1, 2, 3], max_new_tokens=4)
    # a drafter made for a deeper target (the maker refuses ids outside the target it is made for)
    deeper = make_tiny_target(tmp_path / "deeper", seed=1, num_layers=8, with_tokenizer=False)
    too_deep = load_drafter(make_tiny_dflash(tmp_path / "dl", deeper, seed=0, target_layer_ids=[0, 7]), dtype=torch.float64)
    with pytest.raises(DrafterMismatchError, match="target_layer_ids"):
        ddtree_generate(target, too_deep, [1, 2, 3], max_new_tokens=4)
    other_vocab = make_tiny_target(tmp_path / "ov", seed=0, vocab_size=200, num_layers=3, with_tokenizer=False)
    wrong_vocab = load_drafter(make_tiny_dflash(tmp_path / "dv", other_vocab, seed=0), dtype=torch.float64)
    with pytest.raises(DrafterMismatchError, match="vocab"):
        ddtree_generate(target, wrong_vocab, [1, 2, 3], max_new_tokens=4)
    # plain AR does not need (nor check) a drafter
    assert len(ddtree_generate(target, wrong_vocab, [1, 2, 3], method="ar", max_new_tokens=4).tokens) == 4


def _reference_block(m: DFlashDraftModel, feats, emb, pos, window: int | None = None, causal: bool = False,
                     scale: float = 1.0):
    """Straightforward reading of SPEC §7: block queries, [ctx ; block] keys/values, RoPE, no mask; or, as the
    official package reads ``is_causal`` / ``sliding_window``, keys after the query hidden (``causal``) and keys
    ``window`` or more positions away hidden (behind; also ahead unless causal); block embeddings times ``scale``."""
    ctx = m.hidden_norm(m.fc(feats))
    x = emb * scale
    cos, sin = m.rotary_emb(x, pos)

    def rope(t, c, s):
        half = t.shape[-1] // 2
        rot = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * c + rot * s

    n = ctx.shape[1]
    for layer in m.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        both = torch.cat([ctx, h], dim=1)[0]
        q = a.q_norm(a.q_proj(h[0]).view(-1, a.num_heads, a.head_dim))
        k = a.k_norm(a.k_proj(both).view(-1, a.num_kv_heads, a.head_dim))
        v = a.v_proj(both).view(-1, a.num_kv_heads, a.head_dim)
        heads = []
        for hh in range(a.num_heads):
            kv = hh // (a.num_heads // a.num_kv_heads)
            qh = rope(q[:, hh], cos[0, n:], sin[0, n:])
            kh = rope(k[:, kv], cos[0], sin[0])
            scores = qh @ kh.T / math.sqrt(a.head_dim)
            behind = pos[0, n:].view(-1, 1) - pos[0].view(1, -1)
            if causal:
                scores = scores.masked_fill(behind < 0, float("-inf"))
            if window is not None:
                scores = scores.masked_fill(behind.abs() >= window, float("-inf"))
            w = torch.softmax(scores, dim=-1)
            heads.append(w @ v[:, kv])
        x = x + a.o_proj(torch.cat(heads, dim=-1)).unsqueeze(0)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return m.norm(x)


def test_forward_matches_reference_and_context_cache(pair):
    target_dir, drafter_dir = pair
    target = load_target(target_dir, torch.float64, "cpu")
    m = load_drafter(drafter_dir, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    nf = len(m.target_layer_ids) * target.config.hidden_size
    feats = torch.randn(1, 9, nf, generator=g, dtype=torch.float64)
    ids = torch.tensor([[5] + [m.mask_token_id] * 7])
    emb = target.get_input_embeddings()(ids)
    full = m(feats, emb, torch.arange(0, 17).view(1, -1))
    ref = _reference_block(m, feats, emb, torch.arange(0, 17).view(1, -1))
    assert torch.allclose(full, ref, atol=1e-10)
    # context arrives over rounds through the K/V cache: same result as the full context at once
    cache = m.new_cache()
    m(feats[:, :4], target.get_input_embeddings()(torch.tensor([[7] + [m.mask_token_id] * 3])), torch.arange(0, 8), past_key_values=cache)
    assert cache.get_seq_length() == 4  # committed context only, never the block
    inc = m(feats[:, 4:], emb, torch.arange(4, 17).view(1, -1), past_key_values=cache)
    assert cache.get_seq_length() == 9
    assert torch.allclose(inc, full, atol=1e-10)
    # a batch of two equals two separate calls
    emb2 = target.get_input_embeddings()(torch.tensor([[9] + [m.mask_token_id] * 7]))
    batch = m(torch.cat([feats, feats.flip(1)]), torch.cat([emb, emb2]), torch.arange(0, 17).view(1, -1))
    assert torch.allclose(batch[1:], m(feats.flip(1), emb2, torch.arange(0, 17)), atol=1e-10)


def test_feature_hooks_equal_hidden_states(pair):
    target_dir, _ = pair
    target = load_target(target_dir, torch.float64, "cpu")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    layer_ids = [2, 0, 1]  # the last layer's entry is reported after the final norm, as transformers does
    with torch.no_grad(), TargetFeatureHooks(target, layer_ids) as hooks:
        out = target(ids, output_hidden_states=True)
        feats = hooks.features()
    h = target.config.hidden_size
    for j, lid in enumerate(layer_ids):
        assert torch.equal(feats[..., j * h : (j + 1) * h], out.hidden_states[lid + 1])
    assert not hooks._handles  # removed on exit
    with pytest.raises(DrafterMismatchError, match="out of range"):
        TargetFeatureHooks(target, [3])


@pytest.mark.parametrize("is_causal", [None, False])
def test_sliding_window_drafter_layers(pair, is_causal):
    """Drafters whose config declares sliding-attention layers (newer DFlash configs) limit keys to the window, and
    are causal unless ``is_causal`` is false (the official package's reading)."""
    target_dir, drafter_dir = pair
    target = load_target(target_dir, torch.float64, "cpu")
    base = load_drafter(drafter_dir, dtype=torch.float64)
    cfg = base.config
    cfg_sw = type(cfg).from_dict({**cfg.to_dict(), "layer_types": ["sliding_attention"] * 2, "sliding_window": 5,
                                  "use_sliding_window": True, "is_causal": is_causal})
    m = DFlashDraftModel(cfg_sw).to(torch.float64)
    m.load_state_dict(base.state_dict())
    assert m.sliding_layers == [True, True]
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 9, base.fc.weight.shape[1], generator=g, dtype=torch.float64)
    emb = target.get_input_embeddings()(torch.tensor([[5] + [m.mask_token_id] * 7]))
    pos = torch.arange(0, 17).view(1, -1)
    out = m(feats, emb, pos)
    causal = is_causal is None
    assert torch.allclose(out, _reference_block(m, feats, emb, pos, window=5, causal=causal), atol=1e-10)
    assert not torch.allclose(out, _reference_block(m, feats, emb, pos, window=5, causal=not causal), atol=1e-6)
    assert not torch.allclose(out, base(feats, emb, pos), atol=1e-6)
    cache = m.new_cache()
    m(feats[:, :4], emb[:, :4], torch.arange(0, 8), past_key_values=cache)
    assert torch.allclose(m(feats[:, 4:], emb, torch.arange(4, 17).view(1, -1), past_key_values=cache), out, atol=1e-10)
