"""The manifest's codec: strict, bounded JSON encoding and decoding of :class:`Manifest`.

A reader accepts any minor version of its own major version: fields it does not know are kept
in :attr:`Manifest.unknown_fields` and otherwise ignored. A newer major version is refused with
:class:`~shardkeep.errors.ManifestVersionError`. Decoding never mutates its input, enforces the
limits in :class:`~shardkeep.config.ManifestLimits` before building objects, and raises only
:class:`~shardkeep.errors.ManifestError` (or a subclass) on bad input.

Bytes exactly as this library encodes them take a typed fast path; anything else is parsed
strictly (duplicate keys, NaN, surrogate escapes and bad UTF-8 refused) and converted. Which
members of the JSON hold nested structs, and so where unknown fields can hide, is read from the
structs' own type annotations (:func:`child_structs`): a new nested field needs no table here.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec
import msgspec.inspect

from shardkeep.config import ManifestLimits
from shardkeep.errors import ManifestError, ManifestVersionError, ShardkeepError
from shardkeep.manifest.families import entry_family_problems, expand_entry_families, instances_within
from shardkeep.manifest.schema import (
    FORMAT_NAME,
    INDEXED_VERSION,
    SEAL_FIELD,
    IndexedManifest,
    Manifest,
)
from shardkeep.progress import collector_paused

__all__ = [
    "child_structs",
    "decode_manifest",
    "encode_manifest",
    "parse_json_strict",
    "parse_version",
    "strict_json_hooks",
    "unknown_fields_of",
]

_encoder = msgspec.json.Encoder()


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest as compact UTF-8 JSON (not yet sealed; see ``integrity.seal_manifest``)."""
    try:
        return _encoder.encode(manifest)
    except (msgspec.EncodeError, OverflowError, TypeError, UnicodeEncodeError) as exc:
        raise ManifestError(f"cannot encode manifest: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_INNERMOST_PAIR = re.compile(rb"\{\}|\[\]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"{}[]")


def _check_depth(data: bytes, max_depth: int) -> None:
    """Refuse input nested deeper than ``max_depth`` without recursing.

    Strings are removed, then innermost ``{}``/``[]`` pairs are peeled away one level per pass;
    each pass is a single C-speed regex substitution, so the cost is bounded by the limit.
    """
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return
        peeled = _INNERMOST_PAIR.sub(b"", brackets)
        if peeled == brackets:
            raise ManifestError("manifest JSON is malformed: unbalanced brackets")
        brackets = peeled
    if brackets:
        raise ManifestError(f"manifest JSON is nested deeper than the limit of {max_depth}")


def strict_json_hooks(error: type[ShardkeepError], what: str) -> dict[str, Any]:
    """``json.loads`` hooks that refuse duplicate keys and NaN/Infinity with ``error``, naming
    ``what`` (the manifest, a shard header)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise error(f"{what} has a duplicate key {key[:80]!r}")
            result[key] = value
        return result

    def constant(name: str) -> Any:
        raise error(f"{what} contains {name}, which is not valid JSON")

    return {"object_pairs_hook": unique, "parse_constant": constant}


_STRICT_MANIFEST_HOOKS = strict_json_hooks(ManifestError, "manifest JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ManifestError(f"manifest JSON contains the number {text[:40]}, which overflows to infinity")
    return value


#: A JSON escape of a UTF-16 surrogate: such a string may not be valid Unicode text, and this
#: library never writes one (text is UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
#: What any such escape contains. It starts with a literal, which the regex engine finds with a
#: fast scan; the exact pattern above (its look-behind is tried at every byte, about 45 ms per
#: MiB) runs only when this finds something.
_SURROGATE_CANDIDATE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_version(text: object) -> tuple[int, int]:
    """``metadata_version`` as (major, minor); refuses (:class:`ManifestError`) anything else."""
    if not isinstance(text, str):
        raise ManifestError(f"metadata_version must be a string like '1.0', got {text!r}")
    match = re.fullmatch(r"(\d{1,6})\.(\d{1,6})", text)
    if match is None:
        raise ManifestError(f"metadata_version {text!r} is not of the form MAJOR.MINOR")
    return int(match.group(1)), int(match.group(2))


def parse_json_strict(data: bytes, limits: ManifestLimits) -> Any:
    """Parse JSON bytes, refusing oversized or deep input, duplicate keys, NaN and bad UTF-8."""
    if len(data) > limits.max_bytes:
        raise ManifestError(f"manifest is {len(data)} bytes, over the limit of {limits.max_bytes} bytes{_RAISE_LIMIT}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"manifest is not valid UTF-8: {exc}") from exc
    _check_depth(data, limits.max_depth)
    try:
        return json.loads(text, parse_float=_finite_float, **_STRICT_MANIFEST_HOOKS)
    except ManifestError:
        raise
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"manifest JSON is malformed: {exc}") from exc


#: Encoded field name -> (struct type, is_list), per struct type: built on first use.
_CHILDREN: dict[type, dict[str, tuple[type, bool]]] = {}


def child_structs(cls: type) -> dict[str, tuple[type, bool]]:
    """The fields of struct ``cls`` that hold a nested struct: encoded name -> (struct type,
    whether the field is a list of them). Read from the struct's type annotations (a struct, an
    optional struct, a list of structs), so that unknown fields are found in every nested
    struct a newer minor version may extend."""
    found = _CHILDREN.get(cls)
    if found is None:
        info = msgspec.inspect.type_info(cls)
        found = {}
        if isinstance(info, msgspec.inspect.StructType):
            for member in info.fields:
                child = _struct_of(member.type)
                if child is not None:
                    found[member.encode_name] = child
        _CHILDREN[cls] = found
    return found


def _struct_of(kind: msgspec.inspect.Type) -> tuple[type, bool] | None:
    """(struct type, is_list) when ``kind`` is a struct, a list of structs, or either or None."""
    if isinstance(kind, msgspec.inspect.StructType):
        return kind.cls, False
    if isinstance(kind, msgspec.inspect.ListType) and isinstance(kind.item_type, msgspec.inspect.StructType):
        return kind.item_type.cls, True
    if isinstance(kind, msgspec.inspect.UnionType):
        for member in kind.types:
            child = _struct_of(member)
            if child is not None:
                return child
    return None


_KNOWN_FIELDS: dict[type, frozenset[str]] = {}


def _known_fields(cls: type) -> frozenset[str]:
    known = _KNOWN_FIELDS.get(cls)
    if known is None:
        known = frozenset(f.encode_name for f in msgspec.structs.fields(cls))
        _KNOWN_FIELDS[cls] = known
    return known


def unknown_fields_of(raw: Any, cls: type) -> dict[str, Any]:
    """The members of decoded JSON ``raw`` that struct ``cls`` (and the structs nested in it)
    does not know, keyed by their location (``files[0].new_field``)."""
    found: dict[str, Any] = {}
    _collect_unknown(raw, cls, "", found)
    return found


def _collect_unknown(raw: Any, cls: type, where: str, out: dict[str, Any]) -> None:
    if not isinstance(raw, dict):
        return
    known = _known_fields(cls)
    if not known.issuperset(raw):
        for key, value in raw.items():
            if key not in known:
                out[f"{where}.{key}" if where else key] = value
    for name, (child, is_list) in child_structs(cls).items():
        value = raw.get(name)
        if is_list and isinstance(value, list):
            for index, item in enumerate(value):
                _collect_unknown(item, child, f"{where + '.' if where else ''}{name}[{index}]", out)
        elif not is_list:
            _collect_unknown(value, child, f"{where + '.' if where else ''}{name}", out)


_CANONICAL_START = re.compile(rb'\{"metadata_version":"(\d{1,6})\.\d{1,6}","format":"shardkeep",')
_CANONICAL_SEAL = re.compile(rb'"' + SEAL_FIELD.encode() + rb'":"[a-z0-9-]{1,16}:[0-9a-f]{1,128}"\}\n\Z')
#: The struct of each readable major version.
_BY_MAJOR: dict[int, type[Manifest]] = {1: Manifest, 2: IndexedManifest}
_typed_decoders = {major: msgspec.json.Decoder(cls) for major, cls in _BY_MAJOR.items()}


def _json_depth_exceeds(value: Any, limit: int) -> bool:
    """True if a decoded JSON value nests deeper than ``limit`` (recursion is bounded by it)."""
    if limit < 0:
        return True
    if isinstance(value, dict):
        return any(_json_depth_exceeds(item, limit - 1) for item in value.values())
    if isinstance(value, list):
        return any(_json_depth_exceeds(item, limit - 1) for item in value)
    return False


_RAISE_LIMIT = (
    " (the default limits bound what reading an untrusted manifest costs; for a large checkpoint you "
    "trust, pass limits=ManifestLimits(...) with larger values)"
)


def _check_counts(file_count: int, tensor_count: int, limits: ManifestLimits) -> None:
    if file_count > limits.max_files:
        raise ManifestError(f"manifest lists {file_count} files, over the limit of {limits.max_files}{_RAISE_LIMIT}")
    if tensor_count > limits.max_tensors:
        raise ManifestError(
            f"manifest lists {tensor_count} tensors, over the limit of {limits.max_tensors}{_RAISE_LIMIT}"
        )


def _decode_canonical(data: bytes, limits: ManifestLimits) -> Manifest | None:
    """The fast path for bytes exactly as this library encodes them, or ``None``.

    A typed decode followed by a re-encode that must reproduce the input byte for byte (plus the
    seal): that proves there are no duplicate keys, no unknown fields and nothing malformed, so
    the strict slow path is only needed for manifests written some other way.
    """
    match = _CANONICAL_START.match(data)
    decoder = _typed_decoders.get(int(match.group(1))) if match is not None else None
    if decoder is None:
        return None
    try:
        manifest = decoder.decode(data)
        encoded = _encoder.encode(manifest)
    except (msgspec.DecodeError, msgspec.EncodeError, RecursionError, ValueError):
        return None  # the strict path gives the precise error (UnicodeDecodeError is a ValueError)
    if data != encoded:
        body = len(encoded) - 1
        if not (
            data.startswith(memoryview(encoded)[:body])  # compared in place: no copy of either
            and data[body : body + 1] == b","
            and _CANONICAL_SEAL.match(data, body + 1) is not None
        ):
            return None
    depth_budget = limits.max_depth - 4
    if (
        _json_depth_exceeds(manifest.custom_fields, depth_budget)
        or _json_depth_exceeds(manifest.sharding.strategy_info, depth_budget)
        or (manifest.run is not None and _json_depth_exceeds(manifest.run.fingerprint_fields, depth_budget))
        or any(
            isinstance(v.value, (dict, list)) and _json_depth_exceeds(v.value, depth_budget) for v in manifest.values
        )
    ):
        raise ManifestError(f"manifest JSON is nested deeper than the limit of {limits.max_depth}")
    _check_counts(*_counts(manifest), limits)
    return manifest


#: Family instances are counted up to here (past any limit), so a hostile product stays small.
_COUNT_CAP = 2**62


def _counts(manifest: Manifest) -> tuple[int, int]:
    """(files, tensor entries) that the limits bound: a format 2.x manifest's rank indexes
    count as files, and its described tensors, every instance of a tensor family (counted, not
    built) included, as entries."""
    files, tensors = len(manifest.files), sum(len(record.tensors) for record in manifest.files)
    tensors += instances_within([family for record in manifest.files for family in record.families], _COUNT_CAP)
    if isinstance(manifest, IndexedManifest):
        files += len(manifest.indexes.ranks) if manifest.indexes is not None else 0
        tensors += len(manifest.sharded) + instances_within(manifest.families or [], _COUNT_CAP)
    return files, tensors


def decode_manifest(data: bytes, *, limits: ManifestLimits | None = None) -> Manifest:
    """Decode manifest JSON bytes into a :class:`Manifest`.

    Raises :class:`ManifestVersionError` for a newer major version and :class:`ManifestError`
    for anything malformed, oversized or not matching the schema.
    """
    limits = limits or ManifestLimits()
    # Decoding builds two lists per tensor entry; collections scanning them while they are built
    # would cost more than the decoding itself.
    with collector_paused():
        return _decode(data, limits)


def _decode(data: bytes, limits: ManifestLimits) -> Manifest:
    """:func:`decode_manifest`: the typed fast path, else the strict path."""
    if len(data) > limits.max_bytes:
        raise ManifestError(f"manifest is {len(data)} bytes, over the limit of {limits.max_bytes} bytes{_RAISE_LIMIT}")
    if _SURROGATE_CANDIDATE.search(data) is not None and _SURROGATE_ESCAPE.search(data) is not None:
        raise ManifestError("manifest JSON contains a \\uD800-\\uDFFF surrogate escape; text must be plain UTF-8")
    fast = _decode_canonical(data, limits)
    if fast is not None:
        return _with_entry_families_expanded(fast, limits)
    raw = parse_json_strict(data, limits)
    if not isinstance(raw, dict):
        raise ManifestError("manifest JSON must be an object")
    if raw.get("format", FORMAT_NAME) != FORMAT_NAME:
        raise ManifestError(f"not a shardkeep manifest: format is {raw.get('format')!r}")
    major, _minor = parse_version(raw.get("metadata_version"))
    if major > max(_BY_MAJOR):
        raise ManifestVersionError(str(raw["metadata_version"]), INDEXED_VERSION)
    if major < 1:
        raise ManifestError(f"metadata_version {raw['metadata_version']!r} is not supported")
    cls = _BY_MAJOR[major]
    files = raw.get("files", [])
    if isinstance(files, list):
        table = raw.get("indexes") if major >= 2 else None
        ranks = table.get("ranks") if isinstance(table, dict) else None
        extra = [ranks, raw.get("sharded") if major >= 2 else None]
        _check_counts(
            len(files) + (len(extra[0]) if isinstance(extra[0], list) else 0),
            sum(len(f["tensors"]) for f in files if isinstance(f, dict) and isinstance(f.get("tensors"), list))
            + (len(extra[1]) if isinstance(extra[1], list) else 0),
            limits,
        )
    unknown = unknown_fields_of(raw, cls)
    unknown.pop(SEAL_FIELD, None)
    raw_known = {k: v for k, v in raw.items() if k not in unknown and k != SEAL_FIELD}
    try:
        manifest = msgspec.convert(raw_known, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"manifest does not match the schema: {exc}") from exc
    if "created_at" not in raw:
        raise ManifestError("manifest does not match the schema: created_at is missing")
    if unknown:
        manifest.unknown_fields = unknown
    return _with_entry_families_expanded(manifest, limits)


def _with_entry_families_expanded(manifest: Manifest, limits: ManifestLimits) -> Manifest:
    """``manifest`` with the entry families (2.1) of its files expanded into their entries
    (:func:`~shardkeep.manifest.families.expand_entry_families`), after each family is checked
    and every instance counted toward ``max_tensors``; a bad family is a :class:`ManifestError`."""
    if not any(record.families for record in manifest.files):
        return manifest
    _check_counts(*_counts(manifest), limits)
    for record in manifest.files:
        for family in record.families:
            problems = entry_family_problems(family, limits.max_tensors)
            if problems:
                raise ManifestError(f"file {record.path[:80]!r}: " + "; ".join(problems[:5]))
        if record.families:
            expand_entry_families(record)
    return manifest
