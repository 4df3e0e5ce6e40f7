"""Tests of the SDAR trainer's teacher corpus (spiffy.train.teacher): corpus prefixes continued greedily by an AR
model, cached by their settings, mixed into batches."""

from __future__ import annotations

import pytest
import torch

from spiffy.errors import ConfigError
from spiffy.models.loading import load_model
from spiffy.models.tiny import make_tiny
from spiffy.train import teacher
from spiffy.train.common import TokenStream, step_generator

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def stream() -> TokenStream:
    ids = torch.randint(5, 500, (400,), generator=torch.Generator().manual_seed(3))
    return TokenStream(ids, [0])


def _occurs(row: torch.Tensor, ids: torch.Tensor) -> bool:
    return bool(ids.unfold(0, row.numel(), 1).eq(row).all(1).any())


def test_windows_are_stream_prefixes_continued_by_the_teachers_argmax(tiny_qwen3, stream):
    model = load_model(tiny_qwen3, dtype="float32").eval()
    windows = teacher.generate_teacher_windows(model, stream, 5, 24, 4, 10, seed=0, batch=2)
    assert windows.shape == (5, 24) and windows.dtype == torch.int64
    again = teacher.generate_teacher_windows(model, stream, 5, 24, 4, 10, seed=0, batch=2)
    assert torch.equal(windows, again)  # deterministic given the seed
    with torch.no_grad():
        logits = model(input_ids=windows).logits.float()  # [5, 24, V], row p predicts token p + 1
    greedy_rows = 0
    for row, lg in zip(windows, logits):
        # some prefix length P in [4, 10] makes row[:P] a stream window and row[P:] the argmax continuation
        # (compared with a tolerance: the cached and the full forward lay the computation out differently)
        picked = lg[:-1].gather(1, row[1:, None]).squeeze(1)
        is_greedy = picked >= lg[:-1].max(-1).values - 1e-4
        fits = [p for p in range(4, 11) if _occurs(row[:p], stream.ids) and bool(is_greedy[p - 1:].all())]
        greedy_rows += bool(fits)
        # a random tiny model is not the stream's author: its continuation is not the stream's next tokens
        assert not _occurs(row, stream.ids)
    assert greedy_rows == 5


def test_cache_key_and_errors(tiny_qwen3, stream, tmp_path):
    w1, info = teacher.load_or_generate(tmp_path, str(tiny_qwen3), stream, 3, 16, (4, 8), 0, vocab_size=512)
    assert w1.shape == (3, 16) and info["count"] == 3 and info["greedy"]
    cached = tmp_path / "data" / teacher.TEACHER_FILE
    stamp = cached.stat().st_mtime_ns
    w2, _ = teacher.load_or_generate(tmp_path, str(tiny_qwen3), stream, 3, 16, (4, 8), 0, vocab_size=512)
    assert torch.equal(w1, w2) and cached.stat().st_mtime_ns == stamp  # reused, not regenerated
    w3, _ = teacher.load_or_generate(tmp_path, str(tiny_qwen3), stream, 4, 16, (4, 8), 0, vocab_size=512)
    assert w3.shape == (4, 16)  # other settings: regenerated
    with pytest.raises(ConfigError, match="vocabulary"):
        teacher.load_or_generate(tmp_path / "x", str(tiny_qwen3), stream, 3, 16, (4, 8), 0, vocab_size=4096)
    model = load_model(tiny_qwen3, dtype="float32")
    with pytest.raises(ConfigError, match="prefix range"):
        teacher.generate_teacher_windows(model, stream, 3, 16, 4, 16, seed=0)
    with pytest.raises(ConfigError, match="positive"):
        teacher.generate_teacher_windows(model, stream, 0, 16, 4, 8, seed=0)


def test_mix_batch_and_prefix_parsing():
    corpus_rows = torch.zeros(8, 6, dtype=torch.long)
    teacher_windows = torch.arange(1, 1 + 5 * 6).view(5, 6)
    mixed = teacher.mix_batch(corpus_rows, teacher_windows, 0.75, step_generator(0, 0))
    assert mixed.shape == (8, 6)
    assert bool((mixed[:6] > 0).all()) and not bool(mixed[6:].any())
    assert all(_occurs(r, teacher_windows.flatten()) for r in mixed[:6])
    assert torch.equal(teacher.mix_batch(corpus_rows, teacher_windows, 0.0, step_generator(0, 0)), corpus_rows)
    assert teacher.parse_prefix_range("16,160") == (16, 160) and teacher.parse_prefix_range("32") == (32, 32)
    for bad in ("a,b", "9,3", "1,2,3"):
        with pytest.raises(ConfigError):
            teacher.parse_prefix_range(bad)


def test_min_distinct_drops_looping_windows(tiny_qwen3, stream):
    ratios = teacher.tail_distinct_ratio(torch.tensor([[1, 1, 1, 1], [1, 2, 3, 4], [5, 1, 2, 1]]), 3)
    assert torch.allclose(ratios, torch.tensor([1 / 3, 1.0, 2 / 3]))
    model = load_model(tiny_qwen3, dtype="float32").eval()
    plain = teacher.generate_teacher_windows(model, stream, 12, 24, 4, 8, seed=0, batch=4)
    tail = teacher.tail_distinct_ratio(plain, 16)
    threshold = float(tail.median())
    assert bool((tail < threshold).any())  # the unfiltered windows include some below the threshold
    kept = teacher.generate_teacher_windows(model, stream, 6, 24, 4, 8, seed=0, batch=4, min_distinct=threshold)
    assert kept.shape == (6, 24) and bool((teacher.tail_distinct_ratio(kept, 16) >= threshold).all())
    with pytest.raises(ConfigError, match="min-distinct"):
        teacher.generate_teacher_windows(model, stream, 2, 24, 4, 8, seed=0, batch=4, min_distinct=1.01,
                                         max_batches=2)
