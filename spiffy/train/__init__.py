"""Training utilities for the tiny demo checkpoints shipped with spiffy.

Modules: :mod:`corpus` (Python standard-library source corpus), :mod:`tokenizer_train` (byte-level BPE per model
family), :mod:`ar` (Qwen3 causal-LM target), :mod:`dllm` (LLaDA masked-diffusion model), :mod:`drafter`
(DFlash block-diffusion drafter on a frozen target), :mod:`common` (seeding, schedules, checkpoints, batching).
These are for demos and tests, not for model quality.
"""

from __future__ import annotations

__all__ = ["common", "corpus", "tokenizer_train", "ar", "dllm", "drafter"]
