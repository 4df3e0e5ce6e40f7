"""Shared pytest fixtures: tiny random checkpoints of every family, built once per test session.

Fixtures (session-scoped, each a ``pathlib.Path`` of a checkpoint directory in the real layout: config.json with
the official auto_map, >= 2 safetensors shards + index, tokenizer files, generation_config.json):

* ``tiny_llada``, ``tiny_llada_moe``, ``tiny_dream``, ``tiny_sdar``, ``tiny_sdar_moe``, ``tiny_llada2``, ``tiny_qwen3``,
  ``tiny_fast_dllm_v2`` (seed 0, hidden 64, 2 layers, vocab 512).

Helper: :func:`load_f64` loads a checkpoint in float64 (``from conftest import load_f64``), the precision every
equality test uses. Loaded models are cached per path, so tests must not modify their weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import spiffy  # noqa: F401  (registers the families with transformers)
from spiffy.models.loading import load_model
from spiffy.models.tiny import make_tiny

_F64_CACHE: dict[str, torch.nn.Module] = {}


def load_f64(path: str | Path, cached: bool = False) -> torch.nn.Module:
    """Load the checkpoint at ``path`` in float64 on CPU (eval mode). ``cached=True`` reuses one instance per
    path for the session (do not modify it)."""
    key = str(Path(path).resolve())
    if cached and key in _F64_CACHE:
        return _F64_CACHE[key]
    model = load_model(path, dtype=torch.float64)
    if cached:
        _F64_CACHE[key] = model
    return model


def _tiny(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    base = tmp_path_factory.mktemp(f"tiny_{family}")
    return make_tiny(family, base / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_llada(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random LLaDA checkpoint directory (seed 0)."""
    return _tiny(tmp_path_factory, "llada")


@pytest.fixture(scope="session")
def tiny_llada_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random LLaDA-MoE checkpoint directory (seed 0: 8 experts, 2 per token)."""
    return _tiny(tmp_path_factory, "llada_moe")


@pytest.fixture(scope="session")
def tiny_dream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Dream checkpoint directory (seed 0)."""
    return _tiny(tmp_path_factory, "dream")


@pytest.fixture(scope="session")
def tiny_sdar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random SDAR checkpoint directory (seed 0)."""
    return _tiny(tmp_path_factory, "sdar")


@pytest.fixture(scope="session")
def tiny_llada2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random LLaDA2.0 (llada2_moe) checkpoint directory (seed 0)."""
    return _tiny(tmp_path_factory, "llada2")


@pytest.fixture(scope="session")
def tiny_sdar_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random SDAR-MoE checkpoint directory (seed 0; 8 experts, 2 per token)."""
    return _tiny(tmp_path_factory, "sdar_moe")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen3 (transformers-native) checkpoint directory (seed 0)."""
    return _tiny(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_fast_dllm_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Fast-dLLM v2 checkpoint directory (seed 0)."""
    return _tiny(tmp_path_factory, "fast_dllm_v2")


@pytest.fixture(scope="module")
def one_thread_per_module():
    """One intra-op thread for a module's tests: tiny models on a shared 2-core machine run ~10x faster with one
    thread than with two contending ones (use with ``pytestmark = pytest.mark.usefixtures(...)``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


#: the CPU kind (:func:`cpu_kind`) of the machines that wrote the official-code fixtures under ``tests/data`` (the
#: ``scripts/*_official_parity.py`` outputs). Inferred, not recorded then: every fixture holds bit for bit on the
#: machines where they were written and in CI; three of them do not on an AVX2 machine, whose float32/bfloat16 matmul
#: kernels reduce in another order than AVX-512's, nor on an AVX-512 machine with AMX tiles (a Sapphire Rapids Xeon,
#: 2026-11-29: other bfloat16 and float32 kernels again).
FIXTURE_CPU_CAPABILITY = "AVX512"


def cpu_kind() -> str:
    """torch's CPU capability (``torch.backends.cpu.get_cpu_capability()``), ``+AMX`` where the CPU has AMX tiles
    (their kernels round otherwise than plain AVX-512's)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.backends.cpu.get_cpu_capability() + ("+AMX" if amx else "")


def expect_official(ok: bool, message: str, script: str) -> None:
    """Assert a comparison with an official-code fixture: on a CPU of another kind (:func:`cpu_kind`) than the fixtures' a
    mismatch is a skip naming the script that re-records them here (the kernels differ, not the logic); on the
    fixtures' own kind of CPU it fails."""
    if ok:
        return
    here = cpu_kind()
    if here != FIXTURE_CPU_CAPABILITY:
        pytest.skip(f"{message}: the fixture was recorded on a {FIXTURE_CPU_CAPABILITY} CPU and this one is {here} "
                    f"(other matmul kernels, other rounding); rerun `{script}` on this machine to compare here")
    pytest.fail(message)
