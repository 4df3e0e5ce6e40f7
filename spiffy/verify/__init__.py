"""The shared verification backend (SPEC §8): compile draft structures into one forward, then walk them."""

from spiffy.verify.backend import (
    CompiledDraft,
    DraftStructure,
    compile_batched,
    compile_packed,
    compile_tree,
    compile_tree_rows,
    follow,
    tree_ancestor_mask,
)

__all__ = [
    "CompiledDraft",
    "DraftStructure",
    "compile_batched",
    "compile_packed",
    "compile_tree",
    "compile_tree_rows",
    "follow",
    "tree_ancestor_mask",
]
