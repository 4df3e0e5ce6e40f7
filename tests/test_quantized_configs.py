"""The quantized Qwen3-8B releases people download, restated from their published ``config.json`` files, built at
full size on the meta device by transformers' own quantizer (:func:`spiffy.models.quantized_meta.quantized_skeleton`),
with the bytes their published layout holds; or refused, naming the missing kernel package; and refused for running
on a CPU where their kernels do not run (never dequantized silently)."""

from __future__ import annotations

import json

import pytest
import torch

from spiffy.errors import QuantizationError
from spiffy.models.quantize import check_checkpoint_quantization
from spiffy.models.quantized_meta import quantized_skeleton

#: Qwen/Qwen3-8B's config.json (the shape every release below shares)
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
#: Qwen/Qwen3-8B-FP8: fine-grained FP8 (e4m3 weights, one inverse scale per 128 x 128 block, dynamic activations)
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
#: Qwen/Qwen3-8B-AWQ: AWQ 4-bit GEMM, groups of 128, zero points
AWQ = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
       "zero_point": True}
#: RedHatAI/Qwen3-8B-quantized.w4a16: compressed-tensors W4A16 (packed symmetric int4, groups of 128), head kept
W4A16 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 128, "dynamic": False, "observer": "minmax"}}},
}
#: Qwen3-8B's published parameter count (8.19B)
QWEN3_8B_PARAMS = 8_190_735_360
#: (out, in) of the seven linear layers of one Qwen3-8B decoder layer (q, k, v, o, gate, up, down)
LINEARS = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096), (4096, 12288)]
LAYERS, VOCAB, HIDDEN = 36, 151936, 4096
#: bf16 bytes of what every release keeps unquantized: embedding, head, the norms (2 per layer, q/k norms, final)
DENSE_BF16 = 2 * (2 * VOCAB * HIDDEN + LAYERS * (2 * HIDDEN + 2 * 128) + HIDDEN)


def _params(model: torch.nn.Module) -> tuple[int, int]:
    """(elements, bytes) of the parameters: what the checkpoint's safetensors hold."""
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() * p.element_size() for p in model.parameters()))


def test_qwen3_8b_fp8_builds_at_full_size_on_meta() -> None:
    model, total = quantized_skeleton({**QWEN3_8B, "quantization_config": FP8})
    up = model.model.layers[0].mlp.up_proj
    assert type(up).__name__ == "FP8Linear" and up.weight.dtype == torch.float8_e4m3fn and up.weight.is_meta
    assert tuple(up.weight_scale_inv.shape) == (12288 // 128, 4096 // 128)
    blocks = LAYERS * sum(-(-o // 128) * -(-i // 128) for o, i in LINEARS)
    elements, stored = _params(model)
    assert elements == QWEN3_8B_PARAMS + blocks  # every weight of Qwen3-8B, plus one scale per block
    # 1 byte per FP8 weight, 4 per float32 block scale, bf16 elsewhere: 9.44 GB, about 58% of the bf16 release
    assert stored == LAYERS * sum(o * i for o, i in LINEARS) + 4 * blocks + DENSE_BF16 == 9_437_399_040
    assert total >= stored  # plus the rotary buffer


def test_qwen3_8b_w4a16_compressed_tensors_builds_at_full_size_on_meta() -> None:
    pytest.importorskip("compressed_tensors")
    model, _ = quantized_skeleton({**QWEN3_8B, "quantization_config": W4A16})
    up = model.model.layers[0].mlp.up_proj
    assert up.weight_packed.dtype == torch.int32 and tuple(up.weight_packed.shape) == (12288, 4096 // 8)
    assert tuple(up.weight_scale.shape) == (12288, 4096 // 128)
    packed = LAYERS * sum(o * i // 2 + 2 * o * (i // 128) + 2 * 8 for o, i in LINEARS)  # int4 + bf16 scales + shape
    assert _params(model)[1] == packed + DENSE_BF16 == 6_071_351_232  # 6.07 GB, 37% of bf16
    assert type(model.lm_head.weight) is torch.nn.Parameter and model.lm_head.weight.dtype == torch.bfloat16


def test_qwen3_8b_awq_is_refused_naming_the_missing_kernel() -> None:
    try:
        import gptqmodel  # noqa: F401
    except ImportError:
        with pytest.raises(QuantizationError, match="gptqmodel"):
            quantized_skeleton({**QWEN3_8B, "quantization_config": AWQ})
    else:  # pragma: no cover - a machine with AWQ kernels builds it
        quantized_skeleton({**QWEN3_8B, "quantization_config": AWQ})


@pytest.mark.parametrize("quantization_config", [FP8, AWQ], ids=["fp8", "awq"])
def test_releases_whose_kernels_need_a_gpu_are_refused_on_a_cpu(quantization_config) -> None:
    raw = json.loads(json.dumps({**QWEN3_8B, "quantization_config": quantization_config}))
    with pytest.raises(QuantizationError, match="do not run on cpu") as err:
        check_checkpoint_quantization(raw, "cpu", "Qwen/Qwen3-8B")
    assert "\n" not in str(err.value) and "--quantize int8" in str(err.value)
    check_checkpoint_quantization({**QWEN3_8B, "quantization_config": W4A16}, "cpu")  # integer W4A16 decompresses
