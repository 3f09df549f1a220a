"""Shared by the benchmark scripts: reading this process's memory figures, touching memory
before a timed step, medians with min-max, growth exponents, byte, count and time units, and
plain-text tables."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

__all__ = [
    "fmt_bytes",
    "fmt_count",
    "fmt_range",
    "fmt_seconds",
    "growth",
    "median",
    "status_kib",
    "table",
    "touch_memory",
]


def status_kib(field_name: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmHWM``, ``VmRSS`` ...); 0 where there is none."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def touch_memory(nbytes: int) -> None:
    """Touch and free ``nbytes``: memory this VM handed back to its host is slow on first touch
    (/work/shared/BENCHMARKING.md)."""
    if nbytes > 0:
        buffer = bytearray(nbytes)
        buffer[::4096] = b"\x01" * len(range(0, nbytes, 4096))
        del buffer


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def growth(m1: float, m2: float, r1: int, r2: int) -> float:
    """The growth exponent log(m2/m1)/log(r2/r1) (NaN when it is not defined)."""
    if not (m1 > 0 and m2 > 0) or r1 == r2:
        return float("nan")
    return math.log(m2 / m1) / math.log(r2 / r1)


def fmt_bytes(n: float) -> str:
    if math.isnan(n):
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    if math.isnan(n):
        return "-"
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k" if n >= 1e4 else f"{n:.0f}"


def fmt_seconds(n: float) -> str:
    if math.isnan(n):
        return "-"
    return f"{n * 1e3:.3g} ms" if n < 1 else f"{n:.3g} s"


def fmt_range(samples: Sequence[float], render: Callable[[float], str] = fmt_seconds) -> str:
    """median (min-max), or the one sample."""
    if not samples:
        return "-"
    if len(samples) == 1:
        return render(samples[0])
    return f"{render(median(samples))} ({render(min(samples))}-{render(max(samples))})"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)
