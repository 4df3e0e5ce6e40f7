"""compressed-tensors checkpoints (the format of LLM Compressor's W4A16 / W8A16 releases) on a CPU.

transformers' compressed-tensors quantizer loads the packed integer weights and decompresses them on the first
forward (a CPU has no kernel that multiplies packed weights): the model is then the dequantized one, and every
spiffy method must equal its AR baseline on it, as on any model. Checked here: the layout as saved (packed weights,
scales, ``quantization_config``), spiffy's AR == transformers' ``generate(do_sample=False)`` on the same loaded
checkpoint, every AR method == AR, batched rows == alone, and loading by path, by Hub id from an offline cache and
through ``spiffy generate --target ID``.
"""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import constants as hf_constants

from hf_cache import add_snapshot
from spiffy.arspec import as_drafter, speculative_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.cli.main import main
from spiffy.models import load_target
from spiffy.models.ar_drafters import load_ar_drafter
from spiffy.models.quantize import quantization_label
from test_quantized import PROMPTS, ar_config, check_ar_equals_generate, check_methods_equal_ar, pair  # noqa: F401

compressed = pytest.importorskip("compressed_checkpoints")  # needs compressed-tensors (the test extra)

HUB_ID = "RedHatAI/Qwen3-8B-quantized.w4a16"


@pytest.fixture(scope="module")
def saved(pair) -> dict:  # noqa: F811
    return {name: compressed.save_compressed_tensors(pair.target, pair.root / name, name)
            for name in compressed.SCHEMES}


@pytest.mark.parametrize("scheme", [s if s == "w4a16" else pytest.param(s, marks=pytest.mark.slow)
                                    for s in compressed.SCHEMES])
def test_compressed_checkpoint_decodes_as_its_own_baseline(pair, saved, scheme: str) -> None:  # noqa: F811
    config = json.loads((saved[scheme] / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == compressed.SCHEMES[scheme][2]
    target = load_target(saved[scheme], torch.float32, "cpu")
    assert quantization_label(target).startswith(f"compressed-tensors {config['format']}")
    dense = load_target(pair.target, torch.float32, "cpu")
    prompt = torch.tensor([PROMPTS[0]])
    assert not torch.equal(target(prompt).logits, dense(prompt).logits)  # quantized: another model
    check_ar_equals_generate(target)
    check_methods_equal_ar(target, pair, None, 0.0, methods=("dflash", "ddtree"), kinds=("dflash",))
    check_methods_equal_ar(target, pair, None, 1.0, methods=("ddtree", "deer"), kinds=("dllm",))


@pytest.mark.slow
def test_compressed_batched_rows_equal_prompts_alone(pair, saved) -> None:  # noqa: F811
    target = load_target(saved["w4a16"], torch.float32, "cpu")
    cfgs = [ar_config("ddtree", 10, 1.0, seed=s) for s in (3, 4, 5)]

    def drafter():  # noqa: ANN202
        return as_drafter(load_ar_drafter(pair.dflash, dtype=torch.float32))

    alone = [speculative_generate(target, drafter(), p, c).tokens for p, c in zip(PROMPTS, cfgs)]
    batch = speculative_generate_batch(target, [drafter() for _ in PROMPTS], PROMPTS, cfgs)
    assert [r.tokens for r in batch] == alone


def test_compressed_checkpoint_by_hub_id_on_the_command_line(pair, saved, tmp_path, monkeypatch, capsys) -> None:  # noqa: F811
    home = tmp_path / "hf_home"
    add_snapshot(home / "hub", HUB_ID, saved["w4a16"])
    for key, value in (("HF_HOME", str(home)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(hf_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    expected = speculative_generate(load_target(saved["w4a16"], torch.float32, "cpu"), None, PROMPTS[0],
                                    ar_config("ar", 10, 0.0)).tokens
    assert speculative_generate(load_target(HUB_ID, torch.float32, "cpu"), None, PROMPTS[0],
                                ar_config("ar", 10, 0.0)).tokens == expected
    common = ["--target", HUB_ID, "--prompt", "a b", "--max-new-tokens", "8", "--no-progress", "--json", "--no-chat",
              "--dtype", "float32"]
    assert main(["generate", *common, "--method", "ar"]) == 0
    assert main(["generate", *common, "--drafter", str(pair.dflash), "--method", "ddtree"]) == 0
    ar, ddtree = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines())
    assert ddtree["tokens"] == ar["tokens"] and len(ar["tokens"]) > 0
