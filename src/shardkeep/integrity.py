"""Digests: streaming file digests recorded at write time, and the manifest's self-digest seal.

A digest is written as ``"<algorithm>:<hex>"`` (for example ``"blake3:9f2c..."``) so that each
record names its own algorithm. ``blake3`` is the default; ``xxh3-128`` (fast, not
cryptographic) and ``sha256`` are selectable. All three release the GIL while hashing large
buffers, so hashing runs in parallel with file writes.

The manifest carries its own digest as its last member (the *seal*), so a bit flip anywhere in
``manifest.json`` is detected even when the damaged JSON still parses.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Protocol

import blake3
import xxhash

from shardkeep.config import DIGEST_ALGORITHMS
from shardkeep.errors import IntegrityError, ManifestError, UnsupportedValueError
from shardkeep.manifest import SEAL_FIELD

__all__ = [
    "Digester",
    "format_digest",
    "new_digester",
    "seal_manifest",
    "unseal_manifest",
]


class Digester(Protocol):
    """A streaming hash: ``update`` in order, then ``hexdigest`` once."""

    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_digester(algorithm: str) -> Digester:
    """A fresh streaming digester for ``algorithm`` (one of ``DIGEST_ALGORITHMS``)."""
    if algorithm == "blake3":
        return blake3.blake3()
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise UnsupportedValueError(
        f"digest algorithm {algorithm!r} is not supported; choose one of {', '.join(DIGEST_ALGORITHMS)}"
    )


def format_digest(algorithm: str, hex_digest: str) -> str:
    return f"{algorithm}:{hex_digest}"


def digest_bytes(algorithm: str, data: bytes | memoryview) -> str:
    """The formatted digest of one buffer."""
    digester = new_digester(algorithm)
    digester.update(data)
    return format_digest(algorithm, digester.hexdigest())


def digests_equal(expected: str, actual: str) -> bool:
    return hmac.compare_digest(expected.encode(), actual.encode())


def seal_manifest(body: bytes, algorithm: str) -> bytes:
    """Append the self-digest as the last member of the JSON object ``body``."""
    if not body.endswith(b"}") or not body.startswith(b"{"):
        raise ManifestError("manifest body must be a JSON object")
    prefix = body[:-1]
    separator = b"," if prefix.rstrip() != b"{" else b""
    sealed_prefix = prefix + separator
    digest = digest_bytes(algorithm, sealed_prefix)
    return sealed_prefix + b'"' + SEAL_FIELD.encode() + b'":"' + digest.encode() + b'"}\n'


_SEAL = re.compile(rb'"' + SEAL_FIELD.encode() + rb'":"([a-z0-9-]{1,16}):([0-9a-f]{1,128})"\}\n\Z')


def unseal_manifest(data: bytes) -> None:
    """Check the self-digest seal of manifest bytes; raise :class:`IntegrityError` if it fails."""
    match = _SEAL.search(data[-256:])
    if match is None:
        raise IntegrityError("manifest.json has no valid self-digest seal (damaged or truncated)")
    algorithm = match.group(1).decode()
    if algorithm not in DIGEST_ALGORITHMS:
        raise IntegrityError(f"manifest.json is sealed with unknown digest {algorithm!r}")
    start = len(data) - len(data[-256:]) + match.start()
    actual = digest_bytes(algorithm, memoryview(data)[:start])
    expected = f"{algorithm}:{match.group(2).decode()}"
    if not digests_equal(expected, actual):
        raise IntegrityError("manifest.json does not match its self-digest (the manifest is corrupt)")
