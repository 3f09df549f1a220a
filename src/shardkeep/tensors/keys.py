"""The key grammar: which components of a flattened state key name a layer, an expert or a
router, and which manifest section (model, optimizer, router) a key belongs to.

Placement rules, the file layout of a save and section loads all read keys through these
patterns, so a key means the same thing everywhere. No torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

__all__ = ["EXPERT_KEY", "LAYER_KEY", "ROUTER_KEY", "section_of"]

#: ``experts.<n>``, ``layers.<n>`` (or ``layer``/``blocks``/``h``) and ``router`` components of a key.
EXPERT_KEY = re.compile(r"(?:^|\.)experts\.(\d+)(?:\.|$)")
LAYER_KEY = re.compile(r"(?:^|\.)(?:layers|layer|blocks|h)\.(\d+)(?:\.|$)")
ROUTER_KEY = re.compile(r"(?:^|\.)router(?=\.|$)")


def section_of(
    key: str, optim_prefixes: Iterable[str], router_prefixes: Iterable[str]
) -> Literal["model", "optim", "router"]:
    """The manifest section of a tensor key: ``"optim"`` or ``"router"`` when it lies under one
    of that section's key prefixes, else ``"model"``."""
    if any(key == prefix or key.startswith(f"{prefix}.") for prefix in optim_prefixes):
        return "optim"
    if any(key == prefix or key.startswith(f"{prefix}.") for prefix in router_prefixes):
        return "router"
    return "model"
