"""The rounds of a generation on the captured path (``compile=True``): :class:`CapturedRounds` over a
:class:`~spiffy.arspec.captured.StaticTarget`.

:class:`CapturedRounds` runs the loop's rounds on the static target. When every row's tree is built from its draft
alone (plain AR, the DFlash chain, DDTree, the drafts sampled from the drafter: DEER and DFlash under the rejection
rule at T > 0, SpecDiff-2; DFlash2's DDTree, greedy chain and drafts walked through its selector), a round is draft
-> every row's tree in one captured step (:meth:`~spiffy.arspec.captured.StaticTarget.build_trees`; a sampled row
draws from host uniforms or exponentials keyed as the eager draws, merges its drafts and writes their proposals
``q`` for the walk) -> captured verify -> the target's token at every row -> the walk -> the kept rows moved in the
cache (one fused step: :meth:`~spiffy.arspec.captured.StaticTarget.walk_round`), and ONE host read (accepted lengths,
node counts, kept rows and tokens, bonus). The walk is the coupled rule's, or under the rejection rule at T > 0
:func:`~spiffy.arspec.device_rejection.rejection_walk` (the eager rule's own program) over point-mass children
(DDTree, the chain) or over the sampled drafts' draws. A round whose trees
:func:`~spiffy.arspec.captured_trees.tree_plan` does not know (a method of another kind) builds them by eager kernels
(:func:`~spiffy.arspec.captured_trees.round_tree`) and walks them in the same fused step. Under the rejection rule,
rows of point-mass children (DDTree, the chains) beside rows of sampled drafts each walk by their own kind's rule in
the same program (:attr:`~spiffy.arspec.captured_walk.WalkPlan.mixed`); rows that mix the rules run both walks in
the round's step and each keeps its own rule's (rule ``"mixed"``). Only a round whose trees are built by eager
kernels and whose rows mix the rules, or mix point-mass and sampled proposals under the rejection rule, builds its
trees on the host as the eager loop does and walks them on the captured step's hidden states (the verification
captured).

When every row drafts with one plain DFlash or DFlash2 model, the drafter's block forward is captured too: a
:class:`~spiffy.arspec.captured_drafter.StaticDrafter` (its own static context cache and buckets; DFlash2's selector
read out in the step) drafts every row in one step, and each round's commit hands it the kept rows' target features
on the device (from the layers the verification step records). When every row drafts with one plain dLLM model
(DEER, SpecDiff-2, DDTree-dLLM: either layout, any number of denoising steps, dense or MoE), a
:class:`~spiffy.arspec.captured_dllm_drafter.StaticDLLMDrafter` does the same for the dLLM's round forward, and each
commit hands it the kept rows' tokens on the device (gathered from the verification's ids). Subclassed drafters keep
their eager drafters.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from spiffy.arspec.captured import SLOT_ROUNDING, StaticTarget, static_unsupported
from spiffy.arspec.captured_dllm_drafter import static_dllm_drafter
from spiffy.arspec.captured_drafter import StaticBlockDrafter, StaticDrafter, static_drafter_model
from spiffy.arspec.captured_trees import draft_length, plain_tree, round_tree, tree_plan, tree_races, tree_uniforms
from spiffy.arspec.captured_walk import WalkPlan, coupled_rows, rule_walk, unpack_walk, walk_inputs, walk_kind
from spiffy.arspec.device_rejection import Proposals
from spiffy.arspec.device_draws import SampledDeviceTree
from spiffy.arspec.device_tree import DeviceTree
from spiffy.arspec.drafter import DFlash2Drafter
from spiffy.arspec.methods import Method
from spiffy.arspec.rules import AcceptanceRule, TargetLogits
from spiffy.arspec.selector import Draft
from spiffy.arspec.stages import StageClock, build_trees
from spiffy.arspec.tree import DraftTree
from spiffy.errors import ConfigError
from spiffy.models.dflash import TargetFeatureHooks
from spiffy.torch_utils import on_device

__all__ = ["CapturedRounds"]


class CapturedRounds:
    """The rounds of :func:`~spiffy.arspec.batch.speculative_generate_batch` on a :class:`StaticTarget`.

    Args:
        static: the target's static target; methods, configs, rules: per live row; depth: the deepest draft of
            any round (the walk's static step count); drafter: the rows' static drafter
            (:mod:`spiffy.arspec.captured_drafter`), ``None`` when the rows draft with their eager drafters.
    """

    def __init__(self, static: StaticTarget, methods: list[Method], configs: list[Any], rules: list[AcceptanceRule],
                 depth: int, drafter: StaticBlockDrafter | None = None) -> None:
        self.static, self.methods, self.configs, self.rules = static, methods, configs, rules
        self.depth = int(depth)
        self.drafter = drafter

    @classmethod
    def start(cls, target: nn.Module, prompts: Sequence[Sequence[int]], configs: list[Any],
              rules: list[AcceptanceRule], widths: Sequence[int], depth: int, capture: bool,
              feature_layers: Sequence[int], drafters: Sequence[Any] = (), fuse: bool = False) -> "CapturedRounds":
        """The captured rounds of one generation (ConfigError when the target cannot run them); ``drafters``: the
        rows' active drafters, drafted from by a :class:`StaticDrafter` when they share one plain DFlash model;
        ``fuse``: the target's and the static drafter's steps compiled by TorchInductor
        (:func:`spiffy.capture.compile_fuses`)."""
        why = static_unsupported(target, capture)
        if why is not None:
            raise ConfigError(f"compile=True cannot run this target: {why}; fix: pass compile=False (eager)")
        width = 1 + max(widths)
        longest = max(len(p) for p in prompts)
        # each round advances the shared context by the longest commit: at most the tokens of every row
        slots = longest + sum(int(c.max_new_tokens) for c in configs) + width + 1
        static = StaticTarget.for_target(target, len(prompts), slots, width, capture, fuse)
        if feature_layers:
            static.record_layers(feature_layers)
        model = static_drafter_model(drafters, target)
        drafter = None
        if model is not None:
            block = max(int(d.block_size) for d in drafters)
            need = longest + max(int(c.max_new_tokens) for c in configs) + 2 * block + 1
            drafter = StaticDrafter.for_model(model, target, len(prompts), -(-need // SLOT_ROUNDING) * SLOT_ROUNDING,
                                              block, capture, fuse, isinstance(drafters[0], DFlash2Drafter))
        else:  # one plain dLLM drafter (root layout, one denoising step): its own static drafter, or None
            drafter = static_dllm_drafter(drafters, target, prompts, max(int(c.max_new_tokens) for c in configs),
                                          capture, fuse)
        return cls(static, [c.spec for c in configs], list(configs), list(rules), depth, drafter)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
        """The target's prefill (:meth:`StaticTarget.prefill`); the static drafter stages the prompts' features."""
        first, pads = self.static.prefill(prompts)
        if self.drafter is not None:  # the prompts' features (DFlash) or tokens (a dLLM drafter)
            self.drafter.stage_first(self.static, prompts, pads)
        return first, pads

    def draft(self, roots: Sequence[tuple[int, int]], depths: Sequence[int]) -> list[Draft | None]:
        """Every row's draft from the static drafter (one block forward: a bucket's replay)."""
        assert self.drafter is not None
        # one bucket for every round: the last rounds' shorter drafts are masked inside the generation's block
        return list(self.drafter.draft(roots, depths, 1 + self.depth))

    def keep_rows(self, kept: Sequence[int]) -> None:
        self.static.keep_rows(kept)
        if self.drafter is not None:
            self.drafter.keep_rows(kept)
        for name in ("methods", "configs", "rules"):
            setattr(self, name, [getattr(self, name)[i] for i in kept])

    def round(self, roots: Sequence[tuple[int, int]], drafts: Sequence[Draft | None], clock: StageClock,
              drafter_hooks: Sequence[TargetFeatureHooks]) -> list[tuple[list[int], list[int], int]]:
        """One round of every live row: per row ``(new tokens, kept verification rows, draft nodes)``."""
        static, rows = self.static, len(roots)
        plan, by_rule = tree_plan(self.methods, self.configs, drafts, self.depth), rule_walk(self.rules)
        if plan is not None and by_rule is not None:  # trees built in a captured step, from the drafts
            width = static.width if max(plan.counts()) else 1
            depth = self.depth if width > 1 else 0
            self._fill_roots(roots, width)
            proposals = None
            if width > 1:
                lengths = [draft_length(d) for d in drafts]
                uniforms = tree_uniforms(plan, self.configs, roots, lengths) if plan.drafts_of("sampled") else None
                races = (tree_races(plan, self.configs, roots, lengths) if plan.drafts_of("selector_sampled")
                         else None)
                proposals = static.build_trees(rows, width, plan, drafts, uniforms, races)
            clock.lap("tree_build")
            clock.lap("compile")
            sampled = by_rule != "coupled" and proposals is not None
            # under the rejection rule, rows of point-mass children beside sampled rows walk by their own rule
            points = plan.point_rows() if sampled and plan.point_mass else []
            done = self._walk_device(roots, [None] * rows, by_rule, width, depth, drafter_hooks,
                                     proposals if sampled else None, points)
            clock.lap("verify")
            return done
        trees = [round_tree(m, c, d, pos) for m, c, d, (_tok, pos) in zip(self.methods, self.configs, drafts, roots)]
        walk = walk_kind(self.rules, trees, drafts)
        host_trees: list[DraftTree] = []
        if walk is None:
            host_trees = build_trees(self.methods, self.configs, drafts, roots)
        clock.lap("tree_build")
        # node counts: exact for host trees, DDTree and the chains; an upper bound for sampled trees and DFlash2's tree
        # (their real counts ride in the round's one host read)
        counts = ([t.num_nodes for t in host_trees] if host_trees
                  else [0 if t is None else plain_tree(t).count for t in trees])
        width = 1 + max(counts) if max(counts) == 0 else static.width
        depth = 0 if width == 1 else self.depth
        self._fill(roots, trees, host_trees, width)
        clock.lap("compile")
        if walk is None:
            hidden = static.verify(rows, width, depth)
            static.share_features(drafter_hooks)
            out = self._walk_host(roots, hidden, host_trees, drafts, depth)
            done = [(new, keep, n) for (new, keep), n in zip(out, counts)]
        else:
            done = self._walk_device(roots, trees, walk, width, depth, drafter_hooks)
        clock.lap("verify")
        return done

    def _fill(self, roots: Sequence[tuple[int, int]], trees: list[DeviceTree | SampledDeviceTree | None],
              host_trees: list[DraftTree], width: int) -> None:
        """Write the round's rows into the static buffers (host values as one copy each; device trees on device)."""
        s, rows = self.static, len(roots)
        self._fill_roots(roots, width)
        nodes = width - 1
        if nodes == 0:
            return
        s.parents[:rows, :nodes] = -1
        s.depths[:rows, :nodes] = 1
        s.ids[:rows, 1:width] = 0
        if host_trees:
            s.counts[:rows] = on_device(torch.tensor([t.num_nodes for t in host_trees], dtype=torch.long), s.device)
            for b, t in enumerate(host_trees):
                n = t.num_nodes
                if n:
                    packed = on_device(torch.stack([t.tokens, t.parents, t.depths]), s.device)
                    s.ids[b, 1 : 1 + n], s.parents[b, :n], s.depths[b, :n] = packed[0], packed[1], packed[2]
        else:
            s.counts[:rows] = on_device(torch.tensor([0 if t is None else plain_tree(t).count for t in trees],
                                                     dtype=torch.long), s.device)
            for b, t in enumerate(trees):
                tree = None if t is None else plain_tree(t)
                # a data-dependent node count (sampled trees, DFlash2's tree): the real nodes come first, the rest is
                # padding, and the count stays on the device
                if isinstance(t, SampledDeviceTree):
                    s.counts[b] = t.real
                elif tree is not None and tree.real is not None:
                    s.counts[b] = tree.real
                if tree is not None and tree.tokens.numel():
                    n = int(tree.tokens.numel())
                    s.ids[b, 1 : 1 + n], s.parents[b, :n], s.depths[b, :n] = tree.tokens, tree.parents, tree.depths
        s.positions[:rows, 1:width] += s.depths[:rows, :nodes]

    def _fill_roots(self, roots: Sequence[tuple[int, int]], width: int) -> None:
        """The roots' tokens and positions into column 0 (and their positions into every column: one copy)."""
        s, rows = self.static, len(roots)
        root_t = on_device(torch.tensor([[tok, pos] for tok, pos in roots], dtype=torch.long), s.device)
        s.ids[:rows, 0] = root_t[:, 0]
        s.positions[:rows, :width] = root_t[:, 1:2]

    def _commit(self, rows: int, keep: torch.Tensor, accepted: torch.Tensor) -> None:
        """The round's kept rows into the target's cache and, as the next draft's new context, the static drafter's."""
        self.static.commit(rows, keep, accepted)
        if self.drafter is not None:  # the kept rows' features (DFlash) or tokens (a dLLM drafter)
            self.drafter.stage_round(self.static, rows, keep, accepted)

    def _walk_device(self, roots: Sequence[tuple[int, int]], trees: Sequence[DeviceTree | SampledDeviceTree | None],
                     kind: str, width: int, depth: int, drafter_hooks: Sequence[TargetFeatureHooks],
                     proposals: Proposals | None = None, point_rows: Sequence[bool] = ()
                     ) -> list[tuple[list[int], list[int], int]]:
        """Verify, walk (``kind``: the coupled or the rejection rule) and commit every row on the device (one
        bucket's step: :meth:`StaticTarget.walk_round`), stage the drafter's next context, and read the round once
        (``proposals``: the sampled drafts' draws and ``q`` a tree step wrote, walked by the rejection rule;
        ``point_rows``: beside them, the rows whose children are point masses)."""
        s, rows = self.static, len(roots)
        samplings = [c.sampling for c in self.configs]
        sampled = kind != "coupled" and (proposals is not None
                                         or any(isinstance(t, SampledDeviceTree) for t in trees))
        plan = WalkPlan.of(kind, samplings, sampled, any(point_rows), coupled_rows(self.rules))
        vocab = int(getattr(s.lm_head, "out_features", 0) or s.target.config.vocab_size)
        inputs = walk_inputs(plan, samplings, [pos for _tok, pos in roots], trees, s.ids[:rows, :width],
                             s.parents[:rows, : width - 1], s.counts[:rows], s.depths[:rows, : width - 1], depth,
                             vocab, s.dtype, proposals, point_rows)
        keep, accepted, packed = s.walk_round(rows, width, depth, plan, inputs)
        s.share_features(drafter_hooks)
        if self.drafter is not None:  # the kept rows' features (DFlash) or tokens (a dLLM drafter)
            self.drafter.stage_round(s, rows, keep, accepted)
        return unpack_walk(packed.tolist(), depth)  # the round's one host read

    def _walk_host(self, roots: Sequence[tuple[int, int]], hidden: torch.Tensor, trees: list[DraftTree],
                   drafts: Sequence[Draft | None], depth: int) -> list[tuple[list[int], list[int]]]:
        s, rows = self.static, len(roots)
        outcomes = [rule.accept(t, TargetLogits(hidden[b, : 1 + t.num_nodes], s.lm_head), d, pos)
                    for b, (rule, t, d, (_tok, pos)) in enumerate(zip(self.rules, trees, drafts, roots))]
        keeps = [[0] + [a + 1 for a in o.accepted] for o in outcomes]
        span = max(depth, max(len(k) for k in keeps) - 1) + 1
        keep_t = on_device(torch.tensor([k + [0] * (span - len(k)) for k in keeps], dtype=torch.long), s.device)
        accepted = on_device(torch.tensor([len(k) - 1 for k in keeps], dtype=torch.long), s.device)
        self._commit(rows, keep_t, accepted)
        out = []
        for t, o, keep in zip(trees, outcomes, keeps):
            node_tokens = t.tokens.tolist() if o.accepted else []
            out.append(([node_tokens[a] for a in o.accepted] + [o.bonus], keep))
        return out
