"""Figures for the reliability report: tests record what they measured, and
``bench/reliability.py`` prints the table.

``SHARDKEEP_RELIABILITY=full`` selects the full-size runs (the CI-sized ones otherwise);
``SHARDKEEP_FIGURES=<file>`` makes :func:`record` append one JSON line per figure to that file.
"""

from __future__ import annotations

import json
import os
from typing import Any

FULL = os.environ.get("SHARDKEEP_RELIABILITY") == "full"


def scale(ci: int, full: int) -> int:
    """The CI-sized number, or the full-size one."""
    return full if FULL else ci


def record(prop: str, trials: int, failures: int, detail: str = "", **extra: Any) -> None:
    """Record one measured figure: ``trials`` run for property ``prop``, ``failures`` found."""
    target = os.environ.get("SHARDKEEP_FIGURES")
    if not target:
        return
    line = {"property": prop, "trials": trials, "failures": failures, "detail": detail, **extra}
    with open(target, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(line) + "\n")
