"""The full matrix of quantized exactness (slow tier): every quantization x every AR method x DFlash and dLLM
drafters x T = 0 and seeded T = 1, and every dLLM family x int8 / int4 x every cache mode, each equal to the
quantized model's own baseline (float32, CPU, tiny random checkpoints; the fast subset is ``test_quantized.py``)."""

from __future__ import annotations

import pytest
import torch

from spiffy.models import load_model, load_target
from test_quantized import INT4, check_ar_equals_generate, check_dllm_methods, check_methods_equal_ar, pair  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_per_module")]

AR_QUANTS = ["int8", INT4, "bnb-nf4", "bnb-fp4", "bnb-int8"]


@pytest.mark.parametrize("quantization", AR_QUANTS)
def test_every_method_equals_ar_on_a_quantized_target(pair, quantization: str) -> None:  # noqa: F811
    if quantization.startswith("bnb"):
        pytest.importorskip("bitsandbytes")
    target = load_target(pair.target, torch.float32, "cpu", quantization=quantization)
    check_ar_equals_generate(target)
    drafters = None if quantization.startswith("bnb") else quantization  # bitsandbytes: AR targets only
    for temperature in (0.0, 1.0):
        check_methods_equal_ar(target, pair, drafters, temperature)


@pytest.mark.parametrize("quantization", ["int8", INT4])
@pytest.mark.parametrize(("family", "cache"), [("llada", "none"), ("llada", "prefix"), ("llada", "dual"),
                                               ("dream", "none"), ("dream", "prefix"), ("dream", "dual"),
                                               ("sdar", None)])
def test_quantized_dllms_in_every_cache_mode(request, family: str, cache: str | None, quantization: str) -> None:
    model = load_model(request.getfixturevalue(f"tiny_{family}"), dtype="float32", quantization=quantization)
    check_dllm_methods(model, family, cache)
