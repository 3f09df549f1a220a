"""How long steps run for the user: a progress bar when asked for, and the cyclic garbage
collector paused while a step builds many small objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

__all__ = ["collector_paused", "progress_bar"]


def progress_bar(
    total: int, description: str, enabled: bool
) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A byte-counting progress bar (tqdm, imported only when enabled): returns the function
    that advances it (``None`` when disabled) and the one that closes it."""
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, desc=description, leave=False)
    return bar.update, bar.close


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building or decoding many small objects.

    A state of 20,000 tensors creates about 100,000 short-lived containers; without the pause,
    repeated full collections scanning them cost more than the work itself. Nothing created
    here forms a reference cycle, and the collector is resumed even on error.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
