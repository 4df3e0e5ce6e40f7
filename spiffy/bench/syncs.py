"""Count the calls that would block the host on a GPU (device -> host synchronisations).

On a GPU, kernels are queued asynchronously; the host only waits when it needs a value back: ``.item()``,
``.tolist()``, ``bool(t)`` / ``int(t)`` / ``float(t)`` / ``operator.index(t)``, ``nonzero`` (its output size depends
on the data), ``.cpu()`` / ``.to("cpu")`` / ``.numpy()``, ``torch.equal``, ``masked_select`` / ``unique`` /
``repeat_interleave`` with tensor repeats, and indexing with a boolean mask (a hidden ``nonzero``).
:class:`SyncCounter` is a :class:`torch.overrides.TorchFunctionMode` that sees every such call made from Python while
it is active and counts them by name.

On a CPU run every tensor lives on the host, so the counter cannot tell a call on a would-be device tensor from one on
a tensor that stays on the host anyway (the tree's bookkeeping tensors, for instance): the counts are an upper bound
of the synchronisations the same code makes on a GPU. They are exact integers, independent of the machine.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SyncCounter", "SYNC_CALLS"]

#: Tensor methods / torch functions that always wait for the device
SYNC_CALLS: tuple[str, ...] = (
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "cpu", "numpy",
    "equal", "masked_select", "unique", "unique_consecutive",
)


def _is_bool_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) and obj.dtype == torch.bool


def _bool_index(index: Any) -> bool:
    """Whether a ``__getitem__`` / ``__setitem__`` index holds a boolean mask tensor (a data-dependent shape)."""
    if isinstance(index, tuple):
        return any(_is_bool_tensor(i) for i in index)
    return _is_bool_tensor(index)


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call targets the CPU device."""
    targets = list(args[1:]) + [kwargs.get("device")]
    for t in targets:
        if isinstance(t, torch.device) and t.type == "cpu":
            return True
        if isinstance(t, str) and t.split(":")[0] == "cpu":
            return True
    return False


class SyncCounter(TorchFunctionMode):
    """``with SyncCounter() as c: ...`` then ``c.total`` / ``c.counts`` (``{call name: count}``).

    Counted: every name in :data:`SYNC_CALLS`, ``Tensor.to`` towards the CPU, ``repeat_interleave`` with tensor
    repeats and no ``output_size``, and boolean-mask indexing (as ``"bool_index"``). Calls made inside torch's own
    implementation of a counted call are not counted twice.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNC_CALLS:
            self.counts[name] += 1
        elif name == "to" and _to_cpu(args, kwargs):
            self.counts["to_cpu"] += 1
        elif name == "repeat_interleave" and "output_size" not in kwargs and len(args) > 1 and isinstance(args[1], torch.Tensor):
            self.counts["repeat_interleave"] += 1
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _bool_index(args[1]):
            self.counts["bool_index"] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        """All counted calls."""
        return int(sum(self.counts.values()))

    def reset(self) -> None:
        self.counts.clear()
