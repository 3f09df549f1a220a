"""The column pass of manifest validation: whether every tensor entry of a manifest passes
the entry-by-entry checks of :mod:`shardkeep.manifest.validate`, decided a column at a time.

Each step maps a C function over a list or runs numpy over an array, so no Python code runs per
entry. Its contract: it never passes what the entry-by-entry checks would refuse (or warn
about). ``False`` means "check entry by entry", which finds and words each problem; it is also
the answer for anything unusual (a wrong type, an integer beyond 62 bits).
``tests/test_manifest_speed_paths.py`` holds the property test that pins the two together.
This module does not import torch; numpy is imported on first use.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from itertools import chain, compress, repeat
from typing import Any

from shardkeep.config import ManifestLimits
from shardkeep.manifest.schema import (
    DTYPE_ITEMSIZE,
    FAST_BLOCK_DIGEST_BYTES,
    MAX_TENSOR_BYTES,
    STRONG_BLOCK_DIGEST_BYTES,
    FileRecord,
    IndexedManifest,
    KeyPath,
    Manifest,
    TensorEntry,
    shape_problem,
)

__all__ = ["TensorTable", "parents_pass", "tensors_pass"]

# Field getters: ``map(_KEY, entries)`` runs in C, with no Python frame per entry.
_TENSORS = operator.attrgetter("tensors")
_KEY = operator.attrgetter("key")
_PATH = operator.attrgetter("path")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_OFFSET = operator.attrgetter("offset")
_NBYTES = operator.attrgetter("nbytes")
_KIND = operator.attrgetter("kind")
_EXPERT_KEY = operator.attrgetter("expert_key")
_GLOBAL_SHAPE = operator.attrgetter("global_shape")
_GLOBAL_OFFSET = operator.attrgetter("global_offset")
_ARRAY_TYPE = operator.attrgetter("array_type")
_DIGEST = operator.attrgetter("digest")
_BLOCKS = operator.attrgetter("blocks")
_SIZE = operator.attrgetter("size")
_PARENT = operator.itemgetter(slice(None, -1))
_IS_NOT_NONE = functools.partial(operator.is_not, None)


class TensorTable:
    """Every tensor entry of a manifest's files, in file order, with the columns that more than
    one check reads: ``counts`` (entries per file), ``keys``, ``paths`` and their lengths."""

    def __init__(self, files: list[FileRecord]) -> None:
        per_file = list(map(_TENSORS, files))
        self.counts: list[int] = list(map(len, per_file))
        self.entries: list[TensorEntry] = list(chain.from_iterable(per_file))
        self.keys: list[str] = list(map(_KEY, self.entries))
        self.paths: list[KeyPath] = list(map(_PATH, self.entries))
        self.path_lengths: list[int] = list(map(len, self.paths))
        #: The set of keys, once a check has built it.
        self.key_set: set[str] | None = None


#: Entry digests, one per line: exactly what :func:`_digest_problem` accepts.
_DIGEST_LINES = re.compile(r"(?:(?:blake3|sha256):[0-9a-f]{64}\n|xxh3-128:[0-9a-f]{32}\n)*")
#: Column checks keep integers below this, so that sums and products of two stay exact in int64.
_EXACT_LIMIT = 2**62


def tensors_pass(files: list[FileRecord], table: TensorTable, limits: ManifestLimits) -> bool:
    """Whether every tensor entry passes every check of :func:`~shardkeep.manifest.validate.check_tensor` and
    :func:`~shardkeep.manifest.validate.check_file_tensors` without an error or a warning, decided a column at a time: each
    step maps a C function over a list or runs numpy over an array, so no Python code runs per
    entry. ``False`` means "check entry by entry", which finds and words each problem; it is
    also the answer for anything unusual (a wrong type, an integer beyond 62 bits), so this
    never passes an entry that the entry-by-entry checks would not."""
    if not table.entries:
        return True
    try:
        return _columns_pass(files, table, limits)
    except (TypeError, ValueError, OverflowError, IndexError):
        return False  # wrong types in a manifest built in Python; the per-entry checks report them


def _columns_pass(files: list[FileRecord], table: TensorTable, limits: ManifestLimits) -> bool:
    """The steps of :func:`tensors_pass`; each keeps only what a later one needs, so that the
    columns of a large manifest are not all held at once."""
    if not _keys_pass(table, limits):
        return False
    itemsizes = _itemsizes(list(map(_DTYPE, table.entries)))
    if itemsizes is None:
        return False
    nbytes = _nbytes_pass(table.entries, itemsizes, limits)
    if nbytes is None:
        return False
    ranges = _ranges_within_files(files, table, nbytes)
    if ranges is None or not _blocks_pass(files, table, nbytes):
        return False
    del nbytes
    return (
        ranges is not None
        and _digests_pass(table.entries)
        and _experts_pass(table.entries)
        and _chunks_pass(table, itemsizes)
        and not _ranges_overlap(*ranges, table.counts)
    )


def _keys_pass(table: TensorTable, limits: ManifestLimits) -> bool:
    """Keys within ``max_key_bytes``, paths within ``max_path_components``, each key its joined path."""
    limit = limits.max_key_bytes
    keys = table.keys
    if max(map(len, keys)) * 4 > limit and any(
        len(key.encode("utf-8", "surrogatepass")) > limit for key in keys if len(key) * 4 > limit
    ):
        return False
    return max(table.path_lengths) <= limits.max_path_components and _keys_are_joined_paths(table)


#: The work on joined strings is done this many entries at a time, to bound its memory.
_BLOCK = 1 << 16


def _keys_are_joined_paths(table: TensorTable) -> bool:
    """Whether every key equals :func:`key_for_path` of its path. The keys are joined with NUL
    after each, and the paths' components (as strings) with ``.`` between the components of a
    path and NUL after its last: when neither side holds a NUL of its own (each has exactly one
    per entry), the two strings are equal exactly when every key equals its joined path."""
    keys, paths, lengths = table.keys, table.paths, table.path_lengths
    if min(lengths) == 0:
        return False  # a key for the root; rare enough to be checked entry by entry
    if max(lengths) == 1:
        parts = list(chain.from_iterable(paths))
        return parts == keys or list(map(str, parts)) == keys
    separators = [(".",) * (length - 1) + ("\0",) for length in range(max(lengths) + 1)]
    for start in range(0, len(keys), _BLOCK):
        block = slice(start, start + _BLOCK)
        joined_keys = "\0".join(keys[block]) + "\0"
        pieces = zip(
            map(str, chain.from_iterable(paths[block])),
            chain.from_iterable(map(separators.__getitem__, lengths[block])),
            strict=True,
        )
        joined_paths = "".join(chain.from_iterable(pieces))
        entries = len(keys[block])
        if joined_keys != joined_paths or joined_keys.count("\0") != entries or joined_paths.count("\0") != entries:
            return False
    return True


def _nbytes_pass(entries: list[TensorEntry], itemsizes: Any, limits: ManifestLimits) -> Any:
    """Each entry's ``nbytes`` (an int64 array) when every shape has at most ``max_ndim``
    dimensions, none negative, and ``nbytes`` is its elements times the itemsize (an empty
    tensor's other dimensions fitting in 64 bits); else ``None``."""
    import numpy  # here, not at the top: ``import shardkeep`` stays light

    shapes = list(map(_SHAPE, entries))
    ndims = numpy.fromiter(map(len, shapes), numpy.int64, len(shapes))
    dims = _int64_array(list(chain.from_iterable(shapes)))
    nbytes = _int64_array(list(map(_NBYTES, entries)))
    if ndims.max() > limits.max_ndim or dims is None or nbytes is None or (dims.size and dims.min() < 0):
        return None
    element_counts, estimate = _products(dims, ndims)
    del dims, ndims
    if not (estimate * itemsizes < _EXACT_LIMIT).all() or not numpy.array_equal(element_counts * itemsizes, nbytes):
        return None  # (an estimate of NaN, from infinity times a zero dimension, fails too)
    for index in numpy.flatnonzero(element_counts == 0).tolist():
        # An empty tensor: its other dimensions must still fit in 64 bits.
        if shape_problem(shapes[index], int(itemsizes if itemsizes.ndim == 0 else itemsizes[index])):
            return None
    return nbytes


def _ranges_within_files(files: list[FileRecord], table: TensorTable, nbytes: Any) -> tuple[Any, Any] | None:
    """Each entry's byte range as (start, end) int64 arrays when every offset is non-negative
    and every range ends within its file; else ``None``."""
    import numpy

    offsets = _int64_array(list(map(_OFFSET, table.entries)))
    sizes = _int64_array(list(map(_SIZE, files)))
    if offsets is None or sizes is None or offsets.min() < 0 or nbytes.min() < 0 or offsets.max() >= _EXACT_LIMIT:
        return None
    ends = offsets + nbytes
    if not (ends <= numpy.repeat(sizes, table.counts)).all():
        return None
    return offsets, ends


def _blocks_pass(files: list[FileRecord], table: TensorTable, nbytes: Any) -> bool:
    """Every entry's ``blocks`` is empty, or its file is uncompressed with a positive
    ``block_size`` ``B`` and the value holds ``ceil(nbytes / B)`` digests of 16 or 48 bytes."""
    import numpy

    held = numpy.fromiter(map(len, map(_BLOCKS, table.entries)), numpy.int64, len(table.entries))
    if not held.any():
        return True
    sizes = [0 if record.compression is not None else record.block_size for record in files]
    block_sizes = _int64_array(sizes)
    if block_sizes is None:
        return False
    block_sizes = numpy.repeat(block_sizes, table.counts)
    with_blocks = held > 0
    if (block_sizes[with_blocks] <= 0).any():
        return False
    counts = -(-nbytes[with_blocks] // block_sizes[with_blocks])
    lengths = held[with_blocks]
    full = FAST_BLOCK_DIGEST_BYTES + STRONG_BLOCK_DIGEST_BYTES
    return bool(((lengths == counts * FAST_BLOCK_DIGEST_BYTES) | (lengths == counts * full)).all())


def _digests_pass(entries: list[TensorEntry]) -> bool:
    """Every digest an entry has is well formed."""
    digests = list(filter(_IS_NOT_NONE, map(_DIGEST, entries)))
    if not digests:
        return True
    lines = "\n".join(digests) + "\n"
    return lines.count("\n") == len(digests) and _DIGEST_LINES.fullmatch(lines) is not None


def _experts_pass(entries: list[TensorEntry]) -> bool:
    """Every expert tensor has an ``expert_key`` (a missing one is a warning)."""
    kinds = list(map(_KIND, entries))
    if kinds.count("dense") == len(kinds):
        return True
    is_expert = map(operator.eq, kinds, repeat("expert"))
    has_no_key = map(operator.is_, map(_EXPERT_KEY, entries), repeat(None))
    return not any(map(operator.and_, is_expert, has_no_key))


def _int64_array(values: list[Any]) -> Any:
    """``values`` as a numpy int64 array, or ``None`` when they are not all integers that fit."""
    import numpy

    array = numpy.array(values) if values else numpy.zeros(0, numpy.int64)
    return array if array.dtype == numpy.int64 else None


def _itemsizes(dtypes: list[str]) -> Any:
    """Bytes per element of each entry's dtype (a scalar when all are equal), or ``None`` when
    a dtype is unknown."""
    import numpy

    if dtypes.count(dtypes[0]) == len(dtypes):
        itemsize = DTYPE_ITEMSIZE.get(dtypes[0])
        return None if itemsize is None else numpy.int64(itemsize)
    if not set(dtypes).issubset(DTYPE_ITEMSIZE):
        return None
    return numpy.fromiter(map(DTYPE_ITEMSIZE.__getitem__, dtypes), numpy.int64, len(dtypes))


def _products(dims: Any, ndims: Any) -> tuple[Any, Any]:
    """The number of elements of each shape, given all dimensions in one array and each shape's
    length: exact modulo 2**64 (int64 arithmetic wraps), and as a float64 estimate that says
    whether the exact value fits."""
    import numpy

    exact = numpy.ones(len(ndims), numpy.int64)
    estimate = numpy.ones(len(ndims), numpy.float64)
    shaped = ndims > 0
    if dims.size:
        starts = (numpy.cumsum(ndims) - ndims)[shaped]
        exact[shaped] = numpy.multiply.reduceat(dims, starts)
        with numpy.errstate(over="ignore", invalid="ignore"):
            estimate[shaped] = numpy.multiply.reduceat(dims.astype(numpy.float64), starts)
    return exact, estimate


def _chunks_pass(table: TensorTable, itemsizes: Any) -> bool:
    """The chunk checks of :func:`~shardkeep.manifest.validate.check_tensor` (both of ``global_shape``/``global_offset``
    or neither; a torch tensor; ranks agreeing; inside a global shape that fits in 64 bits) and
    the key checks of :func:`~shardkeep.manifest.validate.check_file_tensors` (no key, with its chunk offset, twice)."""
    entries, keys = table.entries, table.keys
    global_shapes = list(map(_GLOBAL_SHAPE, entries))
    global_offsets = list(map(_GLOBAL_OFFSET, entries))
    count = len(entries)
    if global_shapes.count(None) == count and global_offsets.count(None) == count:
        table.key_set = set(keys)
        return len(table.key_set) == count
    whole = list(map(operator.is_, global_shapes, repeat(None)))
    if whole != list(map(operator.is_, global_offsets, repeat(None))):
        return False
    chunked = list(map(operator.not_, whole))
    if any(map(operator.ne, compress(map(_ARRAY_TYPE, entries), chunked), repeat("torch"))):
        return False
    chunk_shapes = list(compress(map(_SHAPE, entries), chunked))
    chunk_global_shapes = list(compress(global_shapes, chunked))
    chunk_offsets = list(compress(global_offsets, chunked))
    ranks = list(map(len, chunk_shapes))
    if list(map(len, chunk_global_shapes)) != ranks or list(map(len, chunk_offsets)) != ranks:
        return False
    flat_global = list(chain.from_iterable(chunk_global_shapes))
    flat_offsets = list(chain.from_iterable(chunk_offsets))
    if min(flat_global, default=0) < 0 or min(flat_offsets, default=0) < 0:
        return False
    chunk_itemsizes = list(compress(itemsizes.tolist(), chunked)) if itemsizes.ndim else [int(itemsizes)] * len(ranks)
    if 0 in flat_global:
        if any(map(shape_problem, chunk_global_shapes, chunk_itemsizes)):
            return False
    elif max(map(operator.mul, map(math.prod, chunk_global_shapes), chunk_itemsizes)) > MAX_TENSOR_BYTES:
        return False
    ends = map(operator.add, flat_offsets, chain.from_iterable(chunk_shapes))
    if not all(map(operator.le, ends, flat_global)):
        return False
    identities = set(zip(compress(keys, whole), repeat(())))
    identities.update(zip(compress(keys, chunked), map(tuple, chunk_offsets), strict=True))
    return len(identities) == count


def _ranges_overlap(starts: Any, stops: Any, counts: list[int]) -> bool:
    """Whether, as :func:`~shardkeep.manifest.validate.check_file_tensors` sees it, two byte ranges of one file overlap:
    in the order of (file, start, end), a range starts before its predecessor ends (a range of
    zero bytes overlaps nothing). Ranges are usually listed in that order already."""
    import numpy

    files = numpy.repeat(numpy.arange(len(counts)), counts)
    same_file = files[1:] == files[:-1]
    in_order = ~same_file | (starts[1:] > starts[:-1]) | ((starts[1:] == starts[:-1]) & (stops[1:] >= stops[:-1]))
    if not in_order.all():
        order = numpy.lexsort((stops, starts, files))
        starts, stops = starts[order], stops[order]
    return bool((same_file & (starts[1:] < stops[:-1]) & (stops[:-1] > starts[:-1])).any())


def parents_pass(manifest: Manifest, table: TensorTable, containers: set[tuple[str | int, ...]]) -> bool:
    """Whether every parent is in ``containers``, decided a column at a time (``False`` also for
    an unhashable path component, which the entry-by-entry check then raises on)."""
    try:
        return (
            (
                () in containers
                if max(table.path_lengths, default=0) <= 1
                else containers.issuperset(map(tuple, map(_PARENT, table.paths)))
            )
            and containers.issuperset(map(tuple, map(_PARENT, map(_PATH, manifest.values))))
            and (
                not isinstance(manifest, IndexedManifest)
                or containers.issuperset(map(tuple, map(_PARENT, map(_PATH, manifest.sharded))))
            )
            and containers.issuperset(map(tuple, map(_PARENT, filter(None, map(_PATH, manifest.structure)))))
        )
    except TypeError:
        return False
