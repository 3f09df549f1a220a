"""``load_slice``: a box of one saved tensor, reading and verifying only the digest blocks that
hold it (:func:`shardkeep.reads.read_needs`, one ranged read per file), from whichever chunks
and files hold it.

The plan is the load's: the manifest is read and checked, a format 2.x checkpoint expands only
the rank indexes listing chunks that overlap the box (:func:`shardkeep.indexes.needed_ranks`),
each overlapping entry contributes its part of the box (:mod:`shardkeep.tensors.ranges`
says which blocks), and the parts are copied into one new tensor.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from shardkeep.config import ManifestLimits
from shardkeep.errors import ConfigError, IntegrityError, UnsupportedValueError
from shardkeep.indexes import expand, needed_ranks
from shardkeep.integrity import SignaturePolicy
from shardkeep.io import DigestChoice
from shardkeep.manifest import FileRecord, IndexedManifest, Manifest, TensorEntry
from shardkeep.progress import collector_paused
from shardkeep.reads import Need, Piece, read_entries, read_needs
from shardkeep.storage import StoreOperations
from shardkeep.tensors.convert import NAME_TO_TORCH
from shardkeep.tensors.ranges import box_runs, byte_runs
from shardkeep.tensors.regions import overlap
from shardkeep.tensors.shardfile import STALE
from shardkeep.verification import FileResolver, TierLocations, locate, read_checked_manifest

if TYPE_CHECKING:
    from shardkeep.options import PublicKey

__all__ = ["load_slice"]

Box = tuple[list[int], list[int]]


def load_slice(
    path: str | os.PathLike[str],
    key: str,
    index: Any = (),
    *,
    digest: Literal["fast", "cryptographic"] | None = None,
    public_key: PublicKey | None = None,
    require_signature: bool | None = None,
    storage: StoreOperations | None = None,
    storage_options: Mapping[str, Any] | None = None,
    tier_locations: TierLocations | None = None,
    limits: ManifestLimits | None = None,
) -> torch.Tensor:
    """The part ``index`` of the saved tensor ``key`` of the checkpoint at ``path``, as a new
    tensor, read and verified without reading the rest of the tensor where the checkpoint
    records block digests (format 2.1/1.4).

    ``index`` is an int, a slice, or a tuple of them (missing trailing dimensions are whole),
    over the tensor's global shape, as in ``tensor[index]``: ints drop their dimension,
    negative values count from the end, and a slice's step must be 1 (anything else is an
    :class:`~shardkeep.errors.UnsupportedValueError` naming the key). A sharded tensor is read
    from the chunks that overlap the box, whichever ranks wrote them; in format 2.x only the
    rank indexes listing those chunks are read.

    What is read: the file headers and, for each overlapping entry, the digest blocks holding
    the box's bytes, each hashed once and compared with the recorded block digest before it is
    used. A box of whole rows (``index`` on the first dimension) is one byte run, so it reads at
    most one block more than it needs at each end. A slice of the last dimension is one run per
    row: once a row is shorter than a block, it reads every block of the rows it spans. Entries
    without block digests (format 2.0/1.x, compressed files) are read whole and checked with
    their own digest, or the whole file with the file's digest.

    ``digest``, ``public_key`` and ``require_signature`` are those of :func:`shardkeep.load`:
    the fast digests by default, the cryptographic ones under a key or with
    ``digest="cryptographic"``. A mismatch raises :class:`~shardkeep.errors.IntegrityError`
    naming the file and the key; an unknown key :class:`~shardkeep.errors.UnsupportedValueError`.
    """
    choice = _digest_choice(digest, public_key)
    policy = SignaturePolicy.of(public_key, require_signature)
    location = locate(path, storage, storage_options)
    with collector_paused():
        manifest = read_checked_manifest(location, policy, limits, expand=False)
    dtype_name, global_shape = _describe(manifest, key)
    offset, size, kept = _box(key, index, global_shape)
    dtype = NAME_TO_TORCH.get(dtype_name)
    if dtype is None:
        raise UnsupportedValueError(f"load_slice({key!r}): dtype {dtype_name} is not supported by this torch")
    # Filled as bytes (one trailing dimension of itemsize): no dtype-specific operator runs.
    result = torch.empty([*size, dtype.itemsize], dtype=torch.uint8)
    if 0 not in size:
        if isinstance(manifest, IndexedManifest) and manifest.find(key) is not None:
            ranks = needed_ranks(manifest, {key: (offset, size)}, {key})
            manifest = expand(location.store, location.name, manifest, ranks, limits=limits)
        resolver = FileResolver(location, manifest, tier_locations=tier_locations, storage_options=storage_options)
        _fill(result, manifest, resolver, key, (offset, size), choice)
    return result.view(dtype).reshape([n for n, keep in zip(size, kept, strict=True) if keep])


def _digest_choice(digest: str | None, public_key: object) -> DigestChoice:
    if digest not in (None, "fast", "cryptographic"):
        raise ConfigError(f"digest={digest!r}: choose 'fast', 'cryptographic' or None")
    if digest == "fast" and public_key is not None:
        raise ConfigError(
            "digest='fast' with public_key=: the signature covers the data only through the cryptographic "
            "digests; use digest=None or 'cryptographic'"
        )
    if digest is None:
        digest = "cryptographic" if public_key is not None else "fast"
    return "fast" if digest == "fast" else "strong"


def _describe(manifest: Manifest, key: str) -> tuple[str, list[int]]:
    """The dtype name and global shape of tensor ``key``."""
    if not isinstance(key, str):
        raise UnsupportedValueError(f"load_slice: key {key!r} must be a string")
    if isinstance(manifest, IndexedManifest):
        tensor = manifest.find(key)
        if tensor is not None:
            return tensor.dtype, list(tensor.global_shape)
    for _, entry in manifest.iter_tensors():
        if entry.key == key:
            return entry.dtype, list(entry.shape if entry.global_shape is None else entry.global_shape)
    raise UnsupportedValueError(f"load_slice: the checkpoint has no tensor {key!r}")


def _box(key: str, index: Any, shape: Sequence[int]) -> tuple[list[int], list[int], list[bool]]:
    """``(offset, size, kept)`` of ``tensor[index]``: ``kept`` is false for dimensions an int
    index drops."""
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape):
        raise UnsupportedValueError(
            f"load_slice({key!r}): index {index!r} has {len(items)} entries for a tensor of {len(shape)} dimensions"
        )
    offset: list[int] = []
    size: list[int] = []
    kept: list[bool] = []
    for dim, item in zip(shape, (*items, *[slice(None)] * (len(shape) - len(items))), strict=True):
        if isinstance(item, slice):
            try:
                start, stop, step = item.indices(dim)
            except TypeError as exc:
                raise UnsupportedValueError(f"load_slice({key!r}): index {item!r} is not a slice of ints") from exc
            if step != 1:
                raise UnsupportedValueError(f"load_slice({key!r}): slice {item!r} has step {step}; only step 1 is read")
            offset.append(start)
            size.append(max(0, stop - start))
            kept.append(True)
        elif isinstance(item, int) and not isinstance(item, bool):
            position = item + dim if item < 0 else item
            if not 0 <= position < dim:
                raise UnsupportedValueError(f"load_slice({key!r}): index {item} is out of range for size {dim}")
            offset.append(position)
            size.append(1)
            kept.append(False)
        else:
            raise UnsupportedValueError(
                f"load_slice({key!r}): index {item!r} is not an int or a slice (tuples of ints and slices only)"
            )
    return offset, size, kept


def _fill(
    result: torch.Tensor,
    manifest: Manifest,
    resolver: FileResolver,
    key: str,
    box: Box,
    choice: DigestChoice,
) -> None:
    """Copy every overlap of the box with an entry of ``key`` into ``result``, reading each
    file once (its blocks, or its entries whole)."""
    offset, size = box
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    by_file: dict[int, list[tuple[int, Box, Box]]] = {}
    for number, record in enumerate(manifest.files):
        for position, entry in enumerate(record.tensors):
            if entry.key != key:
                continue
            origin = [0] * len(entry.shape) if entry.global_offset is None else list(entry.global_offset)
            chunk = (tuple(origin), tuple(entry.shape))
            common = overlap(origin, list(entry.shape), offset, size) if entry.nbytes else None
            if common is None or chunk in seen:
                continue  # outside the box, or a replica of a chunk already read
            seen.add(chunk)
            start, extent = common
            local = ([s - o for s, o in zip(start, origin, strict=True)], extent)
            target = ([s - o for s, o in zip(start, offset, strict=True)], extent)
            by_file.setdefault(number, []).append((position, local, target))
    filled = sum(math.prod(target[1]) for parts in by_file.values() for _, _, target in parts)
    if filled != math.prod(size):
        raise IntegrityError(f"tensor {key!r}: the chunks the manifest lists do not cover the box ({offset}, {size})")
    for number, parts in by_file.items():
        _fill_from_file(result, manifest.files[number], resolver, parts, choice)


def _fill_from_file(
    result: torch.Tensor,
    record: FileRecord,
    resolver: FileResolver,
    parts: list[tuple[int, Box, Box]],
    choice: DigestChoice,
) -> None:
    """Copy ``parts`` (entry position, box in the entry, box in ``result``) from one file. A
    file whose header is older than the record's (a cache or replica behind) is read once more."""
    try:
        _fill_once(result, record, resolver, parts, choice)
    except IntegrityError as exc:
        if not any(STALE in problem for problem in exc.problems):
            raise
        _fill_once(result, record, resolver, parts, choice)


def _fill_once(
    result: torch.Tensor,
    record: FileRecord,
    resolver: FileResolver,
    parts: list[tuple[int, Box, Box]],
    choice: DigestChoice,
) -> None:
    store, where = resolver(record)
    needs = [Need(position, local) for position, local, _ in parts]
    read = read_needs(store, where, record, needs, choice, where=resolver.describe(record))
    if read is not None:
        for position, local, target in parts:
            _place(result[_slices(target)], record.tensors[position], local, read.get(position, []))
        return
    data = read_entries(store, where, record, sorted({position for position, _, _ in parts}), choice)
    for position, local, target in parts:
        entry = record.tensors[position]
        _place(result[_slices(target)], entry, local, [Piece(0, data[entry.offset : entry.offset + entry.nbytes])])


def _place(target: torch.Tensor, entry: TensorEntry, local: Box, pieces: list[Piece]) -> None:
    """Copy the box ``local`` of ``entry`` from ``pieces`` (its bytes that were read) into
    ``target``, the box's bytes in the result (a trailing dimension of itemsize)."""
    itemsize = target.shape[-1]
    offset, size = local
    strides = [math.prod(entry.shape[d + 1 :]) * itemsize for d in range(len(entry.shape))]
    first = sum(o * s for o, s in zip(offset, strides, strict=True))
    if len(pieces) == 1:
        flat = torch.frombuffer(pieces[0].data, dtype=torch.uint8)
        target.copy_(flat.as_strided([*size, itemsize], [*strides, 1], first - pieces[0].start))
        return
    k, _, run = box_runs(entry.shape, itemsize, offset, size)
    rows = itertools.product(*(range(n) for n in size[:k]))
    at = 0
    for row, start in zip(rows, byte_runs(entry.shape, itemsize, offset, size), strict=True):
        while pieces[at].start + len(pieces[at].data) < start + run:
            at += 1
        piece = pieces[at]
        begin = start - piece.start
        flat = torch.frombuffer(piece.data, dtype=torch.uint8)
        target[row].copy_(flat[begin : begin + run].view([*size[k:], itemsize]))


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(*box, strict=True))
