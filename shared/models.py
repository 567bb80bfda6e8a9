"""Which model a decode node serves: one matcher for the router and the coordinator (pure).

A model is known by several names: the name vLLM serves it under, its checkpoint path, and that
path's directory name (what a decode node advertises by default). A node advertising
``node_model`` serves a model when that name, or its directory name, is one of the model's names.
A claim carries the served name (``ClaimRequest.model``) and the other names
(``ClaimRequest.model_aliases``), so the coordinator matches exactly as the router does.
"""

from __future__ import annotations

import os
from collections.abc import Collection


def model_aliases(name: str, root: str = "") -> frozenset[str]:
    """Every name of a model served as ``name`` from checkpoint ``root`` ("" when unknown)."""
    root = root.rstrip("/")
    return frozenset(n for n in (name, root, os.path.basename(root)) if n)


def serves(node_model: str, aliases: Collection[str]) -> bool:
    """Whether a node advertising ``node_model`` serves the model known by ``aliases``."""
    return node_model in aliases or os.path.basename(node_model.rstrip("/")) in aliases
