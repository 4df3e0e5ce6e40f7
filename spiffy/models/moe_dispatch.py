"""How a mixture-of-experts block of spiffy's dLLM families (LLaDA-MoE, SDAR-MoE, LLaDA2.0) runs its experts on the
tokens routed to them: :func:`run_experts`, in one of two ways that give the same bits.

* **per expert** (the default, the official grouping): each chosen expert runs one matrix product over the rows
  routed to it, picked on the host (``torch.unique(...).tolist()``, ``nonzero``). Simple and cheap on a CPU, but
  the shapes are known only after a host read, so a CUDA graph cannot hold it.
* **grouped** (inside :func:`grouped_experts`, which the static dLLM forward turns on:
  :mod:`spiffy.decoding.captured`): the ``N x k`` (token, slot) pairs are sorted by expert (stably, so each
  expert's rows keep the family's order), and each projection is one ``torch._grouped_mm`` over the sorted rows
  with the per-expert row counts as device offsets: static shapes, no host read. ``torch._grouped_mm`` computes
  each group as the matrix product of exactly those rows (on a CPU: bitwise the per-expert product, tested in
  float32 and bfloat16; it takes no float64, which therefore keeps the per-expert path), so the two ways agree bit
  for bit wherever both run.

The grouped path needs each projection's weights as one ``[E, out, in]`` tensor: :func:`stack_experts` (called when
a model's static path is set up) stacks the experts' ``gate_proj`` / ``up_proj`` / ``down_proj`` weights once per
block and re-points every expert's ``nn.Linear`` to its slice (same values, same parameter names, no second copy).
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

__all__ = ["capture_unsupported", "grouped_experts", "grouped_unsupported", "run_experts", "stack_experts",
           "sum_by_expert"]

#: projections of a gated expert MLP, in the order :func:`_stacked` returns them
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: dtypes ``torch._grouped_mm`` takes, per device type (CUDA: bfloat16, what its grouped kernels are built for)
GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16,)}

_MODE = threading.local()
_STACKS: "weakref.WeakKeyDictionary[nn.ModuleList, tuple[torch.Tensor, ...]]" = weakref.WeakKeyDictionary()


@contextmanager
def grouped_experts(on: bool = True) -> Iterator[None]:
    """MoE blocks called inside run their experts grouped (static shapes) where :func:`grouped_unsupported` allows."""
    before = getattr(_MODE, "grouped", False)
    _MODE.grouped = bool(on)
    try:
        yield
    finally:
        _MODE.grouped = before


def grouped_unsupported(experts: nn.ModuleList) -> str | None:
    """``None`` when ``experts`` can run grouped, else why not (torch too old, a dtype ``torch._grouped_mm`` does
    not take on this device, quantized or offloaded projections)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (torch >= 2.9 has)"
    first = getattr(experts[0], PROJECTIONS[0], None)
    if first is None:
        return f"the experts ({type(experts[0]).__name__}) have no {'/'.join(PROJECTIONS)} projections"
    weight = first.weight
    allowed = GROUPED_DTYPES.get(weight.device.type, ())
    if weight.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed) or "nothing"
        return (f"the experts are {str(weight.dtype).replace('torch.', '')} on {weight.device.type}, where grouped "
                f"expert products take {names}")
    for expert in experts:
        for name in PROJECTIONS:
            lin = getattr(expert, name, None)
            if (type(lin) is not nn.Linear or lin.bias is not None or type(lin.weight.data) is not torch.Tensor
                    or lin.weight.dtype != weight.dtype or lin.weight.device != weight.device
                    or hasattr(lin, "_hf_hook")):
                return (f"expert projection {name} is {type(lin).__name__} (quantized, offloaded or biased "
                        "projections run per expert)")
    return None


def _expert_lists(model: nn.Module) -> Iterator[nn.ModuleList]:
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.ModuleList) and len(experts):
            yield experts


def capture_unsupported(model: nn.Module) -> str | None:
    """``None`` when every MoE block of ``model`` runs grouped (a CUDA graph can hold its forward), else why not."""
    for experts in _expert_lists(model):
        why = grouped_unsupported(experts)
        if why is not None:
            return why
    return None


def stack_experts(model: nn.Module) -> None:
    """Stack the expert weights of every MoE block of ``model`` that can run grouped (once; see :func:`_stacked`).

    Done before a model's first static forward, so that its eager and static forwards read the same weight memory
    from then on: on a CPU a float32 product can round differently when a weight lies at another memory alignment
    (a checkpoint's tensors sit at arbitrary offsets of the file), so eager outputs computed *before* the stacking
    may differ from later ones in the last bits; the values of the weights do not change."""
    for experts in _expert_lists(model):
        if grouped_unsupported(experts) is None:
            _stacked(experts)


def run_experts(h: torch.Tensor, chosen: torch.Tensor, experts: nn.ModuleList,
                act: Callable[[torch.Tensor], torch.Tensor], pair_order: str) -> torch.Tensor:
    """Every (token, slot) pair's expert output.

    Args:
        h: ``[N, H]`` token inputs; chosen: ``[N, k]`` long, the experts of each token (distinct within a row).
        experts: gated MLPs ``down_proj(act(gate_proj(x)) * up_proj(x))``; act: their activation.
        pair_order: the order an expert's rows are stacked in its product: ``"slot"`` (slot, then token: SDAR-MoE
            and LLaDA-MoE, the official ``where(mask[e])``) or ``"token"`` (token, then slot: LLaDA2.0's flat
            ``token * k + slot``). The bits of a row can depend on its neighbours in a product, so it is kept.
    Returns:
        ``[N, k, H]`` in ``h``'s dtype.
    """
    if pair_order not in ("slot", "token"):
        raise ValueError(f"pair_order must be 'slot' or 'token', not {pair_order!r}")
    n, k = int(chosen.shape[0]), int(chosen.shape[1])
    # pair p's expert and token: slot order p = slot * N + token; token order p = token * k + slot
    pair_expert = (chosen.t() if pair_order == "slot" else chosen).reshape(-1)
    tokens = torch.arange(n, device=h.device)
    pair_token = tokens.repeat(k) if pair_order == "slot" else tokens.repeat_interleave(k)
    if getattr(_MODE, "grouped", False) and grouped_unsupported(experts) is None:
        out = _grouped(h, pair_expert, pair_token, experts, act)
    else:
        out = torch.empty(n * k, h.shape[1], dtype=h.dtype, device=h.device)
        for e in torch.unique(pair_expert).tolist():  # one host read per call: the experts some token chose
            pick = (pair_expert == e).nonzero()[:, 0]  # ascending pair index: the family's row order
            out[pick] = experts[e](h[pair_token[pick]])
    return out.view(k, n, -1).transpose(0, 1) if pair_order == "slot" else out.view(n, k, -1)


def sum_by_expert(contributions: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``[N, H]``: each token's ``contributions [N, k, H]`` added to zeros in increasing expert index
    (``chosen [N, k]``), one addition at a time in their dtype: the bits of the official per-expert ``index_add_``."""
    rank = chosen.argsort(dim=1)  # the slots by expert index (distinct within a token)
    picked = contributions.gather(1, rank.unsqueeze(-1).expand_as(contributions))
    out = torch.zeros_like(picked[:, 0])
    for j in range(int(chosen.shape[1])):
        out = out + picked[:, j]
    return out


def _grouped(h: torch.Tensor, pair_expert: torch.Tensor, pair_token: torch.Tensor, experts: nn.ModuleList,
             act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[N * k, H]`` pair outputs (pair order) from three grouped products over the pairs sorted by expert."""
    gate, up, down = _stacked(experts)
    order = torch.sort(pair_expert, stable=True).indices  # each expert's pairs stay in ascending pair order
    x = h.index_select(0, pair_token.index_select(0, order))
    counts = torch.zeros(len(experts), dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, pair_expert, torch.ones_like(pair_expert, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)  # on the device: no host read
    inner = act(torch._grouped_mm(x, gate.transpose(1, 2), offs=offsets)) * torch._grouped_mm(
        x, up.transpose(1, 2), offs=offsets)
    y = torch._grouped_mm(inner, down.transpose(1, 2), offs=offsets)
    return torch.empty_like(y).index_copy_(0, order, y)


def _stacked(experts: nn.ModuleList) -> tuple[torch.Tensor, ...]:
    """``(gate [E, I, H], up [E, I, H], down [E, H, I])``; the experts' weights become views of them (stacked on
    first use, and again if any expert's weight was replaced since: a stale stack would compute with old weights)."""
    have = _STACKS.get(experts)
    if have is not None and torch.compiler.is_compiling():
        # traced as a captured step (spiffy.capture.trace_steps): the static path stacked the weights when it was
        # set up (stack_experts); the pointer check is host-side Python a graph neither holds nor needs
        return have
    if have is not None and all(getattr(expert, name).weight.data_ptr() == stack[e].data_ptr()
                                for name, stack in zip(PROJECTIONS, have) for e, expert in enumerate(experts)):
        return have
    stacks = []
    for name in PROJECTIONS:
        with torch.no_grad():
            stack = torch.stack([getattr(expert, name).weight.detach() for expert in experts])
        for e, expert in enumerate(experts):
            lin = getattr(expert, name)
            lin.weight = nn.Parameter(stack[e], requires_grad=lin.weight.requires_grad)
        stacks.append(stack)
    made = _STACKS[experts] = tuple(stacks)
    return made
