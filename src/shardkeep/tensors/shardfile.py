"""The shard file format: a valid safetensors file (8-byte header length, JSON header, raw bytes).

Tensors are laid out by decreasing element size and the header is padded with spaces to a
multiple of 8 bytes, so every tensor starts at an offset aligned to its own element size and
can be viewed in place from a memory map. Any safetensors reader can open a shard; the manifest
records the absolute offset of each tensor so shardkeep never needs the header to find data, but
every load and verify cross-checks the header against the manifest.

This module does not import torch.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from shardkeep.errors import IntegrityError
from shardkeep.manifest import DTYPE_ITEMSIZE, FileRecord, shape_problem, strict_json_hooks

__all__ = [
    "CARRIED_DTYPES",
    "STALE",
    "VERSION_KEY",
    "HeaderEntry",
    "ShardHeader",
    "build_header",
    "check_header",
    "header_form",
    "built_header_agrees",
    "parse_built_header",
    "parse_header",
]

HEADER_ALIGNMENT = 8
#: safetensors refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000
_LENGTH = struct.Struct("<Q")
_METADATA = {"format": "pt", "writer": "shardkeep"}
#: The metadata key holding the file's version (a decimal string: safetensors metadata is str).
VERSION_KEY = "shardkeep.version"
#: The word that marks a stale-file problem (a header version older than the manifest's).
STALE = "stale:"
_ENCODER = msgspec.json.Encoder()
#: Manifest dtypes that safetensors has no name for, and how a shard's header carries their
#: bytes under a dtype every safetensors reader knows: (header dtype, a trailing dimension of
#: that many elements added to the shape, or 1 for none). A complex128 tensor of shape [3] is
#: ``F64`` [3, 2] in the header (real and imaginary parts, as ``torch.view_as_real`` gives),
#: a float8_e8m0fnu tensor ``U8`` of the same shape. The manifest records the true dtype.
CARRIED_DTYPES: dict[str, tuple[str, int]] = {
    "C128": ("F64", 2),
    "C32": ("F16", 2),
    "F8_E8M0": ("U8", 1),
    "F4_E2M1FN_X2": ("U8", 1),
    "B8": ("U8", 1),
    "B1X8": ("U8", 1),
    "B2X4": ("U8", 1),
    "B4X2": ("U8", 1),
    "B16": ("U16", 1),
}


def header_form(dtype: str, shape: list[int]) -> tuple[str, list[int]]:
    """The (dtype, shape) a shard's safetensors header gives a tensor the manifest records as
    ``dtype`` and ``shape``: the same, except for :data:`CARRIED_DTYPES`."""
    carried = CARRIED_DTYPES.get(dtype)
    if carried is None:
        return dtype, shape
    header_dtype, lanes = carried
    return header_dtype, [*shape, lanes] if lanes > 1 else shape


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as safetensors describes it; offsets are relative to the data section."""

    name: str
    dtype: str
    shape: list[int]
    begin: int
    end: int


class _HeaderSpec(msgspec.Struct, gc=False):
    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]


@dataclass(frozen=True)
class ShardHeader:
    data_start: int
    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]


def build_header(spans: Sequence[tuple[str, str, list[int], int, int]], version: int | None = None) -> bytes:
    """The length prefix and padded JSON header for tensors laid out as ``spans`` describe:
    (name, manifest dtype, shape, begin, end), offsets relative to the data section (a dtype of
    :data:`CARRIED_DTYPES` is written as its carrier). ``version`` (the
    file's version in the manifest) goes into the metadata as ``shardkeep.version``."""
    metadata = dict(_METADATA)
    if version is not None:
        metadata[VERSION_KEY] = str(version)
    header: dict[str, object] = {"__metadata__": metadata}
    for name, dtype, shape, begin, end in spans:
        header_dtype, header_shape = header_form(dtype, shape)
        header[name] = _HeaderSpec(header_dtype, header_shape, (begin, end))
    body = _ENCODER.encode(header)
    padding = (-(len(body) + _LENGTH.size)) % HEADER_ALIGNMENT
    body += b" " * padding
    return _LENGTH.pack(len(body)) + body


def header_length(prefix: bytes | memoryview, file_size: int) -> int:
    """The JSON header's length from the first 8 bytes of a shard, checked against the file size."""
    if len(prefix) < _LENGTH.size:
        raise IntegrityError("shard file is shorter than the 8-byte safetensors length prefix")
    (length,) = _LENGTH.unpack(bytes(prefix[: _LENGTH.size]))
    if length > MAX_HEADER_BYTES or _LENGTH.size + length > file_size:
        raise IntegrityError(f"safetensors header length {length} does not fit in a file of {file_size} bytes")
    return int(length)


_STRICT_HEADER_HOOKS = strict_json_hooks(IntegrityError, "safetensors header")


def _refuse_float(text: str) -> object:
    raise IntegrityError(f"safetensors header contains the number {text[:40]}; only integers are allowed")


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def parse_header(data: bytes | memoryview) -> ShardHeader:
    """Parse a safetensors header from the start of a shard (``data`` holds at least the header),
    strictly: duplicate keys anywhere, non-integer numbers, unknown members of an entry, and
    ``__metadata__`` that is not a string-to-string object are refused."""
    length = header_length(data, len(data))
    raw_bytes = bytes(data[_LENGTH.size : _LENGTH.size + length])
    try:
        raw = json.loads(raw_bytes.decode("utf-8"), parse_float=_refuse_float, **_STRICT_HEADER_HOOKS)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"safetensors header is malformed: {str(exc)[:200]}") from exc
    if not isinstance(raw, dict):
        raise IntegrityError("safetensors header is not a JSON object")
    entries: dict[str, HeaderEntry] = {}
    metadata: dict[str, str] = {}
    for name, spec in raw.items():
        if name == "__metadata__":
            if not isinstance(spec, dict) or not all(isinstance(v, str) for v in spec.values()):
                raise IntegrityError("safetensors header __metadata__ must map strings to strings")
            metadata = spec
            continue
        if not isinstance(spec, dict) or spec.keys() != {"dtype", "shape", "data_offsets"}:
            raise IntegrityError(f"safetensors header entry {name[:80]!r} must have exactly dtype, shape, data_offsets")
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(dtype, str):
            raise IntegrityError(f"safetensors header entry {name[:80]!r} has a non-string dtype")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise IntegrityError(f"safetensors header entry {name[:80]!r} has a shape that is not a list of sizes")
        problem = shape_problem(shape, DTYPE_ITEMSIZE.get(dtype, 1))
        if problem:
            raise IntegrityError(f"safetensors header entry {name[:80]!r} has an impossible shape: {problem}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(x) for x in offsets):
            raise IntegrityError(f"safetensors header entry {name[:80]!r} has malformed data_offsets")
        if offsets[0] > offsets[1]:
            raise IntegrityError(f"safetensors header entry {name[:80]!r} ends before it begins")
        entries[name] = HeaderEntry(name, dtype, list(shape), offsets[0], offsets[1])
    return ShardHeader(data_start=_LENGTH.size + length, entries=entries, metadata=metadata)


class _BuiltEntry(msgspec.Struct, forbid_unknown_fields=True):
    """One tensor of a header :func:`build_header` made, as msgspec decodes it (in C)."""

    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]


class _BuiltValue(msgspec.Struct, forbid_unknown_fields=True):
    """Any value of a header :func:`build_header` made, decoded in one pass: a tensor's fields,
    or those of ``__metadata__`` (which no tensor has)."""

    dtype: str = ""
    shape: list[int] = msgspec.field(default_factory=list)
    data_offsets: tuple[int, int] = (-1, -1)
    format: str | None = None
    writer: str | None = None
    version: str | None = msgspec.field(default=None, name=VERSION_KEY)


_BUILT_OUTER = msgspec.json.Decoder(dict[str, msgspec.Raw])
_BUILT_ENTRY = msgspec.json.Decoder(_BuiltEntry)
_BUILT_VALUES = msgspec.json.Decoder(dict[str, _BuiltValue])


def parse_built_header(header: bytes) -> ShardHeader:
    """Parse a header :func:`build_header` made in this process (the exact bytes a writer is
    about to write), for :func:`check_header` against the file's record before the file is
    written. Faster than :func:`parse_header` (msgspec, without its strictness: these bytes
    come from this module's encoder, not from storage); anything malformed is an
    :class:`~shardkeep.errors.IntegrityError`."""
    length = header_length(header, len(header))
    try:
        raw = _BUILT_OUTER.decode(header[_LENGTH.size : _LENGTH.size + length])
        metadata_raw = raw.pop("__metadata__", None)
        metadata = msgspec.json.decode(metadata_raw, type=dict[str, str]) if metadata_raw is not None else {}
        entries = {}
        for name, spec_raw in raw.items():
            spec = _BUILT_ENTRY.decode(spec_raw)
            entries[name] = HeaderEntry(name, spec.dtype, spec.shape, *spec.data_offsets)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise IntegrityError(f"safetensors header is malformed: {str(exc)[:200]}") from exc
    return ShardHeader(data_start=_LENGTH.size + length, entries=entries, metadata=metadata)


def built_header_agrees(header: bytes, record: FileRecord) -> bool:
    """Whether a header :func:`build_header` made lists exactly ``record``'s tensors, each with
    its dtype, shape and bytes (what :func:`check_header` checks on every load), decoded in one
    pass and compared without building a :class:`ShardHeader`: the check every file passes
    before it is written, where a per-tensor cost matters. ``False`` (a header of any other
    shape included) calls for :func:`check_header` to decide."""
    length = header_length(header, len(header))
    data_start = _LENGTH.size + length
    try:
        values = _BUILT_VALUES.decode(header[_LENGTH.size : data_start])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    metadata = values.pop("__metadata__", None)
    if len(values) != len(record.tensors):
        return False
    if metadata is not None and metadata.version is not None and metadata.version != str(record.version):
        return False
    carried = CARRIED_DTYPES
    for entry in record.tensors:
        spec = values.get(entry.key)
        if spec is None or spec.format is not None or spec.writer is not None or spec.version is not None:
            return False
        begin, end = spec.data_offsets
        if (
            begin < 0
            or data_start + begin != entry.offset
            or end - begin != entry.nbytes
            or data_start + end > record.size
            or (
                (spec.dtype, spec.shape) != (entry.dtype, entry.shape)
                if entry.dtype not in carried
                else (spec.dtype, spec.shape) != header_form(entry.dtype, entry.shape)
            )
            or spec.dtype not in DTYPE_ITEMSIZE
        ):
            return False
    return True


def check_header(header: ShardHeader, record: FileRecord) -> list[str]:
    """Every disagreement between a shard's safetensors header and its manifest record."""
    problems: list[str] = []
    where = f"{record.path}"
    on_disk = header.metadata.get(VERSION_KEY)
    if on_disk is not None:
        # ASCII digits only: str.isdigit() also accepts "²", which int() then refuses.
        if not (on_disk.isascii() and on_disk.isdigit()) or len(on_disk) > 18:
            problems.append(f"{where}: header version {on_disk[:40]!r} is not a number")
        elif int(on_disk) < record.version:
            problems.append(
                f"{where}: {STALE} the file on storage is version {int(on_disk)}, the manifest expects version "
                f"{record.version}"
            )
        elif int(on_disk) > record.version:
            problems.append(f"{where}: header version {int(on_disk)} is newer than the manifest's {record.version}")
    if len(header.entries) != len(record.tensors):
        problems.append(f"{where}: header lists {len(header.entries)} tensors, manifest lists {len(record.tensors)}")
    for entry in record.tensors:
        found = header.entries.get(entry.key)
        if found is None:
            problems.append(f"{where}: tensor {entry.key!r} is missing from the safetensors header")
            continue
        if (found.dtype, found.shape) != header_form(entry.dtype, entry.shape):
            problems.append(
                f"{where}: tensor {entry.key!r} is {found.dtype}{list(found.shape)} in the header "
                f"but {entry.dtype}{entry.shape} in the manifest"
            )
        if header.data_start + found.begin != entry.offset or found.end - found.begin != entry.nbytes:
            problems.append(f"{where}: tensor {entry.key!r} has different byte offsets in header and manifest")
        elif header.data_start + found.end > record.size:
            problems.append(f"{where}: tensor {entry.key!r} ends beyond the end of the file")
        itemsize = DTYPE_ITEMSIZE.get(found.dtype)
        if itemsize is None:
            problems.append(f"{where}: tensor {entry.key!r} has unknown dtype {found.dtype!r}")
    return problems
