"""Measurement harnesses: ``spiffy bench dllm`` (baseline vs Spiffy) and ``spiffy bench ar`` (AR vs DFlash vs
DDTree), with benchmark prompt loaders and JSON / Markdown / PNG reports (SPEC section 11)."""

from __future__ import annotations

from spiffy.bench.ar import run_ar_bench
from spiffy.bench.datasets import DATASETS, BenchPrompt, default_datasets_dir, load_benchmark_prompts
from spiffy.bench.dllm import run_dllm_bench
from spiffy.bench.report import markdown_report, write_report

__all__ = [
    "BenchPrompt",
    "DATASETS",
    "default_datasets_dir",
    "load_benchmark_prompts",
    "markdown_report",
    "run_ar_bench",
    "run_dllm_bench",
    "write_report",
]
