"""No hidden host synchronisation from host-to-device copies in the code a decoding step runs.

A blocking copy of host values to a GPU (``torch.tensor(values, device=...)``, ``host.to(device)``) makes PyTorch
wait for every kernel queued before it: a host synchronisation that :class:`~spiffy.bench.syncs.SyncCounter` (which
counts reads) cannot see, and that a CPU run cannot show at all. Step code builds such tensors with
:func:`spiffy.torch_utils.device_tensor` / :func:`~spiffy.torch_utils.on_device` (``non_blocking=True``); this test
keeps it so, by reading the source (constructors run once per generation and may copy as they like).
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from spiffy.torch_utils import device_tensor, on_device

ROOT = Path(__file__).resolve().parents[1] / "spiffy"
#: packages whose functions run inside decoding steps and rounds (bench, train, cli and calibration are drivers)
STEP_PACKAGES = ("arspec", "capture", "decoding", "models", "selfspec", "verify")


def _blocking_copies(path: Path) -> list[str]:
    """``function:line`` of each ``torch.tensor`` / ``torch.as_tensor`` call with a ``device=`` outside ``__init__``."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name == "__init__":
            continue
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("tensor", "as_tensor") and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch" and any(k.arg == "device" for k in node.keywords)):
                found.append(f"{fn.name}:{node.lineno}")
    return found


def test_step_code_builds_no_device_tensor_with_a_blocking_copy() -> None:
    offenders = {str(p.relative_to(ROOT)): hits for pkg in STEP_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
                 if (hits := _blocking_copies(p))}
    offenders = {k: v for k, v in offenders.items() if k != "selfspec/calibrate.py"}  # offline calibration
    assert not offenders, f"use spiffy.torch_utils.device_tensor (non-blocking) instead: {offenders}"


class _Moves(TorchFunctionMode):
    """Records the keyword arguments of every ``Tensor.to`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "to":
            self.calls.append(dict(kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_host_values_go_to_another_device_without_blocking() -> None:
    """``on_device`` copies a host tensor to another device with ``non_blocking=True`` (the meta device stands in
    for a GPU here) and makes no call when the tensor is there already; ``device_tensor`` goes through it."""
    host = torch.arange(4)
    with _Moves() as moves:
        moved = on_device(host, torch.device("meta"))
        same = on_device(host, "cpu")
        made = device_tensor([1, 2, 3], torch.long, "meta")
    assert moved.device.type == "meta" and same is host and made.device.type == "meta" and made.dtype == torch.long
    assert [c.get("non_blocking") for c in moves.calls] == [True, True]
    assert torch.equal(device_tensor([3, 1], torch.long, "cpu"), torch.tensor([3, 1]))
