"""Watching what the library does inside a test's own process (or a forked rank): the messages
it logs, and the all-gathers its coordinator makes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["counted_all_gathers", "logged_messages"]


def logged_messages(name: str, level: int = logging.WARNING) -> list[str]:
    """The messages logger ``name`` logs at ``level`` or above from now on, collected into the
    returned list (the handler stays: for a forked rank or a test's whole run)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger(name).addHandler(Collect(level))
    return messages


@contextlib.contextmanager
def counted_all_gathers() -> Iterator[list[str]]:
    """The labels of every ``Coordinator.all_gather`` made inside the block, in order (a step's
    agreement included)."""
    from shardkeep.distributed.coordinator import Coordinator

    labels: list[str] = []
    all_gather = Coordinator.all_gather

    def counted(self: Coordinator, value: Any, *, label: str = "") -> Any:
        labels.append(label)
        return all_gather(self, value, label=label)

    Coordinator.all_gather = counted  # type: ignore[method-assign]
    try:
        yield labels
    finally:
        Coordinator.all_gather = all_gather  # type: ignore[method-assign]
