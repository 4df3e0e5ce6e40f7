"""Deprecated import path (one release): the tree builder lives in :mod:`spiffy.arspec.tree`."""

from __future__ import annotations

from spiffy.arspec.tree import DraftTree, build_chain, build_ddtree, empty_tree

__all__ = ["DraftTree", "build_ddtree", "build_chain", "empty_tree"]
