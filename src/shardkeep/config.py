"""Frozen option objects: how a save writes its bytes, how a load reads them, and the limits of
the manifest parser.

Each object checks its fields when it is built, so a bad value raises an error naming the field
and the value. The other public option groups of a save (tiers, incremental, manifest fields)
are in :mod:`shardkeep.options`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from shardkeep.errors import ConfigError

__all__ = [
    "BLOCK_SIZES",
    "LOAD_DIGESTS",
    "LOCAL",
    "DIGEST_ALGORITHMS",
    "LoadOptions",
    "ManifestLimits",
    "SaveOptions",
    "SIZE_UNITS",
    "parse_size",
    "WriteOptions",
]

MiB = 1 << 20

#: ``process_group=LOCAL``: this process alone, even when ``torch.distributed`` is initialized
#: (a save that one rank makes on its own: Lightning's and Accelerate's rank-zero saves, a batch
#: worker's result). No collective runs; the save is that of a single process.
LOCAL: Final = "local"

#: Digest algorithms that can be recorded in a manifest. The first is the default.
DIGEST_ALGORITHMS: tuple[str, ...] = ("blake3", "xxh3-128", "sha256")

#: The block sizes a data file's block digests may use (``WriteOptions.block_size``, the
#: manifest's ``FileRecord.block_size``): the powers of two from 16 KiB to 16 MiB.
BLOCK_SIZES: tuple[int, ...] = tuple(1 << exponent for exponent in range(14, 25))

#: The digests a load may check (``LoadOptions.digest``): ``"fast"`` (xxh3-128) or
#: ``"cryptographic"`` (the save's algorithm).
LOAD_DIGESTS: tuple[str, ...] = ("fast", "cryptographic")


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"option {name}={value!r} must be a positive integer")


#: The units of a size string, matched without regard to case: none or ``B`` for bytes;
#: ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB``, ``P``/``PB`` in powers of 1000 (as
#: ``save_pretrained`` and disk vendors read them); ``KiB``, ``MiB``, ``GiB``, ``TiB``, ``PiB`` in
#: powers of 1024. A tier's ``size_budget`` and an export's ``max_shard_size`` both read these.
SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15},
    **{"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15},
    **{"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50},
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(value: str | int | float, *, where: str, positive: bool = False) -> int:
    """Bytes from a number or a string such as ``"40GB"``, ``"1.5MiB"`` or ``"1000"`` (units:
    :data:`SIZE_UNITS`; a fraction of a byte is dropped). Anything else, a negative size, or with
    ``positive`` a size of 0, is a :class:`ConfigError` naming ``where`` (the option)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where}={value!r} must be a size such as '40GB', '1.5MiB' or a number of bytes")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{where}={value!r} must be a size such as '40GB', '1.5MiB' or a number of bytes")
        size = int(value)
    else:
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in SIZE_UNITS:
            raise ConfigError(
                f"{where}={value!r} is not a size: use a number of bytes, or a number with B, KB, MB, GB, TB, PB "
                "(powers of 1000) or KiB, MiB, GiB, TiB, PiB (powers of 1024)"
            )
        size = int(float(match.group(1)) * SIZE_UNITS[unit])
    if size < 0 or (positive and size == 0):
        raise ConfigError(f"{where}={value!r} " + ("must be positive" if positive else "must not be negative"))
    return size


@dataclass(frozen=True, kw_only=True)
class ManifestLimits:
    """Bounds enforced before and while a manifest is parsed, so that a hostile or damaged
    manifest costs a bounded time and memory to refuse (or to read).

    The defaults keep reading a manifest at the limit within about 5 s and 1 GiB on a 2-core
    machine, in the worst case (the smallest possible entries, through the strict slow path);
    ``bench/manifest_limits.py`` measures it. A manifest over 40 MiB (about 150,000 tensor
    entries of a typical size) or with more than 500,000 tensor entries needs larger limits:
    ``limits=`` for ``load``, ``verify``, ``read_manifest`` and ``CheckpointManager``,
    ``--manifest-limit-mib`` for the CLI.
    """

    max_bytes: int = 40 * MiB
    max_depth: int = 32
    max_files: int = 500_000
    max_tensors: int = 500_000
    max_key_bytes: int = 4096
    max_ndim: int = 64
    max_path_components: int = 64

    @classmethod
    def scaled(cls, max_mib: int) -> ManifestLimits:
        """Limits for manifests of up to ``max_mib`` MiB, with the file and tensor counts scaled
        from the defaults in proportion (the CLI's ``--manifest-limit-mib``)."""
        defaults = cls()
        factor = max_mib * MiB / defaults.max_bytes
        return cls(
            max_bytes=max_mib * MiB,
            max_files=max(1, round(defaults.max_files * factor)),
            max_tensors=max(1, round(defaults.max_tensors * factor)),
        )

    def __post_init__(self) -> None:
        for name in (
            "max_bytes",
            "max_depth",
            "max_files",
            "max_tensors",
            "max_key_bytes",
            "max_ndim",
            "max_path_components",
        ):
            _require_positive_int(name, getattr(self, name))


@dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How a save writes its bytes: the ``options=`` of :func:`shardkeep.save`,
    :func:`shardkeep.async_save`, :class:`shardkeep.CheckpointManager` and the integrations.

    ``digest`` is the algorithm recorded for every file (:data:`DIGEST_ALGORITHMS`; signing needs
    ``blake3`` or ``sha256``). ``byte_budget`` bounds the memory a save holds beyond the caller's
    own tensors (contiguous copies, device-to-host copies and the buffer that coalesces small
    tensors); a local store writing a file with ``O_DIRECT`` also holds two aligned buffers of
    :data:`~shardkeep.storage.local.DIRECT_IO_BLOCK` bytes for it, outside the budget.
    ``io_threads`` bounds concurrent file writes (backpressure). A data file is closed and a new
    one started once it holds ``file_size_target`` bytes, so large states are written as several
    files in parallel. ``compression`` (``None`` or ``"zstd"``, at ``compression_level`` from -7
    to 22) compresses each data file. ``progress`` draws a progress bar (``save`` only).
    ``storage_options`` go to fsspec when the path is a URL (credentials, endpoint; the AWS
    environment variables are used otherwise).

    ``block_size`` is the bytes per block of the block digests that let a load read and check
    part of a chunk (:data:`BLOCK_SIZES`): ``None`` lets each rank choose from its chunks (and
    gives files of whole tensors 16 MiB blocks, so only larger tensors have blocks), a size
    forces it for every file, and ``0`` writes no block digests and no fast digests (a format
    2.0/1.3 checkpoint, which older readers read). A compressed file is read whole and has no
    blocks, so a size is refused with ``compression``.
    """

    digest: str = "blake3"
    byte_budget: int = 256 * MiB
    io_threads: int = 2
    file_size_target: int = 512 * MiB
    compression: str | None = None
    compression_level: int = 3
    progress: bool = False
    storage_options: Mapping[str, Any] | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.compression not in (None, "zstd"):
            raise ConfigError(f"option compression={self.compression!r} must be None or 'zstd'")
        if (
            isinstance(self.compression_level, bool)
            or not isinstance(self.compression_level, int)
            or not (-7 <= self.compression_level <= 22)
        ):
            raise ConfigError(f"option compression_level={self.compression_level!r} must be an integer from -7 to 22")
        if self.digest not in DIGEST_ALGORITHMS:
            raise ConfigError(
                f"option digest={self.digest!r} is not supported; choose one of " + ", ".join(DIGEST_ALGORITHMS)
            )
        _require_positive_int("byte_budget", self.byte_budget)
        _require_positive_int("io_threads", self.io_threads)
        _require_positive_int("file_size_target", self.file_size_target)
        if self.byte_budget < 1 * MiB:
            raise ConfigError(f"option byte_budget={self.byte_budget!r} is below the 1 MiB minimum")
        if not isinstance(self.progress, bool):
            raise ConfigError(f"option progress={self.progress!r} must be True or False")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ConfigError(
                f"option storage_options={self.storage_options!r} must be a mapping of fsspec options or None"
            )
        self._check_block_size()

    def _check_block_size(self) -> None:
        size = self.block_size
        valid = size is None or (isinstance(size, int) and (size == 0 or size in BLOCK_SIZES))
        if isinstance(size, bool) or not valid:
            raise ConfigError(
                f"option block_size={size!r} must be None (chosen per rank), 0 (no block digests) or a power of "
                f"two from {BLOCK_SIZES[0]} (16 KiB) to {BLOCK_SIZES[-1]} (16 MiB)"
            )
        if size and self.compression is not None:
            raise ConfigError(
                f"option block_size={size!r} cannot be used with compression={self.compression!r}: a compressed "
                "file is read whole and has no block digests (use block_size=None or 0)"
            )


#: The name :class:`WriteOptions` had before the other option groups existed; the same class.
SaveOptions = WriteOptions


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a load reads its files.

    ``verify`` checks the file set, every size and every digest while reading; ``mmap`` maps
    files into memory instead of copying them, so tensors share the page cache.

    ``digest`` chooses which recorded digest a verifying load checks (:data:`LOAD_DIGESTS`):
    ``"fast"``, the xxh3-128 digests, which detect accidental damage; ``"cryptographic"``, the
    save's own algorithm (blake3 by default), which also binds the bytes to a signature;
    ``None``, cryptographic when the load checks a signature and fast otherwise. A checkpoint
    without fast digests (format 2.0/1.3) is checked with the digest it records. ``load()``
    resolves ``None`` before building these options (docs/trust.md).
    """

    verify: bool = True
    mmap: bool = True
    io_threads: int = 2
    digest: Literal["fast", "cryptographic"] | None = None

    def __post_init__(self) -> None:
        _require_positive_int("io_threads", self.io_threads)
        if self.digest is not None and (not isinstance(self.digest, str) or self.digest not in LOAD_DIGESTS):
            raise ConfigError(
                f"option digest={self.digest!r} must be None (cryptographic under a signature, else fast), "
                "'fast' or 'cryptographic'"
            )
        if self.digest == "cryptographic" and not self.verify:
            raise ConfigError(
                "option digest='cryptographic' checks digests, which verify=False skips: pass verify=True"
            )
