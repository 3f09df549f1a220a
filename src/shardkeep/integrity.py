"""Digests: streaming file digests recorded at write time, and the manifest's self-digest seal.

A digest is written as ``"<algorithm>:<hex>"`` (for example ``"blake3:9f2c..."``) so that each
record names its own algorithm. ``blake3`` is the default; ``xxh3-128`` (fast, not
cryptographic) and ``sha256`` are selectable. All three release the GIL while hashing large
buffers, so hashing runs in parallel with file writes.

The manifest carries its own digest as its last member (the *seal*), so a bit flip anywhere in
``manifest.json`` is detected even when the damaged JSON still parses.

Signatures: ``manifest.sig`` holds an Ed25519 signature over
``SIGNATURE_DOMAIN + <the exact bytes of manifest.json>``. The prefix keeps a signature over a
manifest from being valid for any other message signed with the same key. Since the manifest
records every file's digest, the signature covers the data, provided those digests are
cryptographic: signing a manifest with ``xxh3-128`` digests is refused, and so is accepting
one. The signature file is canonical JSON, checked byte for byte, so any change to it is
detected.

Key files (``signer=``, ``public_key=`` given as paths, the CLI's ``--key`` and ``--public-key``)
are read by :func:`read_regular_file`, like the ledger's files: a regular file of at most 64 KiB
(a symlink is followed only to a regular file), so a FIFO or a device given as a key fails at
once instead of hanging.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import blake3
import msgspec
import xxhash

from shardkeep.config import DIGEST_ALGORITHMS
from shardkeep.errors import (
    ConfigError,
    IntegrityError,
    ManifestError,
    SignatureError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.manifest import (
    FAST_BLOCK_DIGEST_BYTES,
    FAST_DIGEST,
    SEAL_FIELD,
    STRONG_BLOCK_DIGEST_BYTES,
    FileRecord,
    Manifest,
    TensorEntry,
)
from shardkeep.storage import localfs

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "CRYPTOGRAPHIC_DIGESTS",
    "BlockDigester",
    "DualDigester",
    "FULL_BLOCK_DIGEST_BYTES",
    "PASSPHRASE_ENV",
    "SIGNATURE_DOMAIN",
    "Digester",
    "SignaturePolicy",
    "SignatureStatus",
    "block_digests",
    "block_width",
    "blocks_check",
    "blocks_strong",
    "check_signature",
    "check_signed_digests",
    "fast_block_digests",
    "file_kind",
    "format_digest",
    "generate_key_pair",
    "key_id",
    "load_private_key",
    "load_public_key",
    "new_digester",
    "parse_signature",
    "read_regular_file",
    "seal_manifest",
    "sign_manifest",
    "uncovered_digests",
    "unseal_manifest",
]


class Digester(Protocol):
    """A streaming hash: ``update`` in order, then ``hexdigest`` once."""

    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


#: Whether blake3 may hash on its worker threads in this process. A forked child gets none of
#: the parent's threads but the pool's state says they exist: a parallel update there would
#: wait forever. So a child hashes on its own thread (see the fork hook below).
_PARALLEL_HASHING = True


def _no_parallel_hashing_after_fork() -> None:
    global _PARALLEL_HASHING
    _PARALLEL_HASHING = False


os.register_at_fork(after_in_child=_no_parallel_hashing_after_fork)


def new_digester(algorithm: str, *, parallel: bool = False) -> Digester:
    """A fresh streaming digester for ``algorithm`` (one of ``DIGEST_ALGORITHMS``). With
    ``parallel``, blake3 hashes each large update on every core (its tree allows it; the
    digest is the same), except in a forked child; the other algorithms are sequential by
    construction."""
    if algorithm == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO) if parallel and _PARALLEL_HASHING else blake3.blake3()
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


#: The strong algorithms a block may record (32-byte digests).
_STRONG_BLOCK_ALGORITHMS = ("blake3", "sha256")


def block_digests(view: bytes | bytearray | memoryview, block_size: int, strong: str | None) -> bytes:
    """The ``blocks`` value of a tensor entry whose bytes are ``view``: for each block of
    ``block_size`` bytes counted from the first byte (the last one shorter), the 16-byte
    xxh3-128 digest of the block and then, unless ``strong`` is ``None``, its 32-byte
    ``strong`` digest (``"blake3"`` or ``"sha256"``). Empty bytes have no block. This is the
    definition that writers' streaming digests and readers' checks must equal."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"block_size={block_size!r} must be a positive integer")
    if strong is not None and strong not in _STRONG_BLOCK_ALGORITHMS:
        raise UnsupportedValueError(f"a block's strong digest is blake3 or sha256, not {strong!r}")
    data = memoryview(view).cast("B")
    parts: list[bytes] = []
    for start in range(0, len(data), block_size):
        block = data[start : start + block_size]
        parts.append(xxhash.xxh3_128(block).digest())
        if strong == "blake3":
            parts.append(blake3.blake3(block).digest())
        elif strong == "sha256":
            parts.append(hashlib.sha256(block).digest())
    return b"".join(parts)


#: Bytes of one block digest with its strong half: 16 of xxh3-128, then 32 of the strong digest.
FULL_BLOCK_DIGEST_BYTES = FAST_BLOCK_DIGEST_BYTES + STRONG_BLOCK_DIGEST_BYTES


def block_width(record: FileRecord, entry: TensorEntry) -> int:
    """The bytes per block of ``entry.blocks``: :data:`FULL_BLOCK_DIGEST_BYTES` with a strong
    half, ``FAST_BLOCK_DIGEST_BYTES`` fast-only, or 0 when the entry has no usable blocks (none
    recorded, no block size, a compressed file, an empty entry, or a length that fits neither
    width)."""
    if not entry.blocks or record.block_size <= 0 or record.compression is not None or not entry.nbytes:
        return 0
    count = -(-entry.nbytes // record.block_size)
    for width in (FULL_BLOCK_DIGEST_BYTES, FAST_BLOCK_DIGEST_BYTES):
        if len(entry.blocks) == count * width:
            return width
    return 0


def blocks_strong(record: FileRecord, entry: TensorEntry) -> str | None:
    """The algorithm of the strong half of ``entry``'s block digests (the save's, named by the
    file's digest), or ``None`` when its blocks are fast-only or unusable."""
    if record.digest and block_width(record, entry) == FULL_BLOCK_DIGEST_BYTES:
        return record.digest.partition(":")[0]
    return None


def blocks_check(record: FileRecord, entry: TensorEntry, *, strong: bool) -> bool:
    """Whether ``entry``'s block digests alone can check a read of it: any usable blocks for a
    fast check; with ``strong``, blocks with a cryptographic strong half, or fast-only blocks
    of a save whose own digest is xxh3-128 (its blocks are then as strong as its file digest)."""
    width = block_width(record, entry)
    if not width or not record.digest:
        return False
    if not strong:
        return True
    algorithm = record.digest.partition(":")[0]
    if width == FAST_BLOCK_DIGEST_BYTES:
        return algorithm == FAST_DIGEST
    return algorithm in CRYPTOGRAPHIC_DIGESTS


def fast_block_digests(blocks: bytes, width: int) -> bytes:
    """The xxh3-128 half of each block digest of ``blocks`` (``width`` bytes per block, from
    :func:`block_width`): ``blocks`` itself when they are fast-only."""
    if width == FAST_BLOCK_DIGEST_BYTES:
        return blocks
    return b"".join(blocks[start : start + FAST_BLOCK_DIGEST_BYTES] for start in range(0, len(blocks), width))


def _one_shot(algorithm: str) -> Callable[[memoryview], bytes]:
    """The raw digest of one buffer, for a block algorithm (xxh3-128, blake3 or sha256)."""
    if algorithm == FAST_DIGEST:
        return xxhash.xxh3_128_digest
    if algorithm == "blake3":
        return lambda view: blake3.blake3(view).digest()
    if algorithm == "sha256":
        return lambda view: hashlib.sha256(view).digest()
    raise UnsupportedValueError(f"a block's strong digest is blake3 or sha256, not {algorithm!r}")


class _BlockStream:
    """The raw digests, in one algorithm, of consecutive ``block_size``-byte blocks of a stream
    given in pieces of any size."""

    __slots__ = ("_algorithm", "_block_size", "_filled", "_one", "_partial", "parts")

    def __init__(self, algorithm: str, block_size: int) -> None:
        self._algorithm = algorithm
        self._block_size = block_size
        self._one = _one_shot(algorithm)
        self._partial: Any = None  # the digester of the block begun by an earlier piece
        self._filled = 0
        #: One digest per finished block.
        self.parts: list[bytes] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        size, block, position = len(view), self._block_size, 0
        if self._partial is not None:
            position = min(block - self._filled, size)
            self._partial.update(view[:position])
            self._filled += position
            if self._filled == block:
                self.parts.append(self._partial.digest())
                self._partial, self._filled = None, 0
        one, parts = self._one, self.parts
        while size - position >= block:
            parts.append(one(view[position : position + block]))
            position += block
        if position < size:
            self._partial = new_digester(self._algorithm)
            self._partial.update(view[position:])
            self._filled = size - position

    def finish(self) -> list[bytes]:
        """Every block's digest, the last (shorter) block's included."""
        if self._partial is not None:
            self.parts.append(self._partial.digest())
            self._partial, self._filled = None, 0
        return self.parts


class BlockDigester:
    """The ``blocks`` value of one tensor entry, streamed: equal to :func:`block_digests` of the
    pieces joined, whatever their sizes. :meth:`update_fast` and :meth:`update_strong` feed
    the two digests separately (each in order), so two threads can hash one buffer at once."""

    __slots__ = ("_fast", "_strong")

    def __init__(self, block_size: int, strong: str | None) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size={block_size!r} must be a positive integer")
        if strong is not None and strong not in _STRONG_BLOCK_ALGORITHMS:
            raise UnsupportedValueError(f"a block's strong digest is blake3 or sha256, not {strong!r}")
        self._fast = _BlockStream(FAST_DIGEST, block_size)
        self._strong = _BlockStream(strong, block_size) if strong is not None else None

    @property
    def strong(self) -> bool:
        """Whether each block records a strong digest too."""
        return self._strong is not None

    def update_fast(self, data: bytes | bytearray | memoryview) -> None:
        self._fast.update(data)

    def update_strong(self, data: bytes | bytearray | memoryview) -> None:
        if self._strong is not None:
            self._strong.update(data)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.update_fast(data)
        self.update_strong(data)

    def digest(self) -> bytes:
        """The blocks' digests: per block, 16 bytes of xxh3-128, then the strong digest if any."""
        fast = self._fast.finish()
        if self._strong is None:
            return b"".join(fast)
        strong = self._strong.finish()
        return b"".join(part for pair in zip(fast, strong, strict=True) for part in pair)


class DualDigester:
    """A file's two digests, streamed: ``strong`` in the save's algorithm and, unless that is
    already xxh3-128 or ``fast`` is false, ``fast`` in xxh3-128 (``FileRecord.fast_digest``).
    :meth:`update_strong` and :meth:`update_fast` feed them separately."""

    __slots__ = ("_algorithm", "fast", "strong")

    def __init__(self, algorithm: str, *, fast: bool = True) -> None:
        self._algorithm = algorithm
        self.strong = new_digester(algorithm)
        self.fast = new_digester(FAST_DIGEST) if fast and algorithm != FAST_DIGEST else None

    def update_strong(self, data: bytes | memoryview) -> None:
        self.strong.update(data)

    def update_fast(self, data: bytes | memoryview) -> None:
        if self.fast is not None:
            self.fast.update(data)

    def update(self, data: bytes | memoryview) -> None:
        self.strong.update(data)
        if self.fast is not None:
            self.fast.update(data)

    def digests(self) -> tuple[str, str | None]:
        """(the formatted strong digest, the formatted fast one or ``None``)."""
        fast = None if self.fast is None else format_digest(FAST_DIGEST, self.fast.hexdigest())
        return format_digest(self._algorithm, self.strong.hexdigest()), fast


def digests_equal(expected: str, actual: str) -> bool:
    return hmac.compare_digest(expected.encode(), actual.encode())


def seal_manifest(body: bytes, algorithm: str) -> bytes:
    """Append the self-digest as the last member of the JSON object ``body``.

    The body is copied once, into the result: a manifest of 100,000 tensors is about 20 MB, and
    each copy of it (slicing, concatenating) cost about 30 ms on first-touch memory."""
    if not body.endswith(b"}") or not body.startswith(b"{"):
        raise ManifestError("manifest body must be a JSON object")
    prefix = memoryview(body)[:-1]
    empty = len(body) <= 64 and not body[1:-1].strip()
    separator = b"" if empty else b","
    digester = new_digester(algorithm)
    digester.update(prefix)
    digester.update(separator)
    digest = format_digest(algorithm, digester.hexdigest())
    return b"".join((prefix, separator, b'"', SEAL_FIELD.encode(), b'":"', digest.encode(), b'"}\n'))


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


# -- signatures ----------------------------------------------------------------------------

#: Prepended to the manifest's bytes before signing (domain separation).
SIGNATURE_DOMAIN = b"shardkeep manifest signature v1\n"
#: Digests a signature can vouch for.
CRYPTOGRAPHIC_DIGESTS = frozenset({"blake3", "sha256"})
#: The environment variable holding the passphrase of an encrypted private key file.
PASSPHRASE_ENV = "SHARDKEEP_KEY_PASSPHRASE"
SIGNATURE_FORMAT = "shardkeep-signature/1"
MAX_SIGNATURE_BYTES = 1024
_MAX_KEY_FILE_BYTES = 64 * 1024


class _SignatureFile(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    algorithm: str
    key_id: str
    signature: str


_HEX = re.compile(r"[0-9a-f]+")


def key_id(public_key: Ed25519PublicKey) -> str:
    """A public key's identifier: the SHA-256 of its raw 32 bytes, in hex."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def file_kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, for messages: ``a regular file``, ``a FIFO`` ..."""
    for test, kind in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return kind
    return "a special file"


def read_regular_file(path: str | os.PathLike[str], *, limit: int, follow_symlinks: bool = False) -> bytes:
    """The whole content of ``path``, which must be a regular file of at most ``limit`` bytes.

    The file is opened with ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`` and checked with ``fstat``
    before anything is read, so a symlink is never followed and a FIFO or device never blocks the
    caller or streams endless bytes. (A symlink in a parent directory is followed.) With
    ``follow_symlinks`` a symlink is followed, and what it reaches must still be a regular file
    within the limit: for files the user names, such as keys mounted as symlinks by Kubernetes.

    Raises :class:`UnsafePathError` when the path is a symlink, not a regular file, or larger than
    ``limit``; its message is the reason alone (``is a FIFO, not a regular file``), for the caller
    to put after the file's name in its own typed error. Any other failure, including a missing
    file, is the ``OSError`` itself, for the caller to map.
    """
    try:
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
        descriptor = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError("is a symlink, which is never followed") from exc
        if exc.errno == errno.ENXIO:  # a socket, or a device without a driver
            raise UnsafePathError("is a special file, not a regular file") from exc
        raise
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"is {file_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise UnsafePathError(f"is {info.st_size} bytes, over the limit of {limit}")
        chunks: list[bytes] = []
        remaining = limit + 1
        while remaining > 0:
            chunk = os.read(descriptor, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        if remaining <= 0:  # it grew while being read
            raise UnsafePathError(f"is over the limit of {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(descriptor)


def _read_key_file(path: str | os.PathLike[str], what: str) -> bytes:
    """A PEM key file's bytes: a regular file of at most 64 KiB (never a FIFO or device; a
    symlink to a regular file is followed, as secret mounts use them)."""
    try:
        return read_regular_file(path, limit=_MAX_KEY_FILE_BYTES, follow_symlinks=True)
    except UnsafePathError as exc:
        hint = "a key must be a PEM file"
        if os.path.islink(path):
            hint = f"give the file itself, {os.path.realpath(path)!r}, if that is the key"
        raise ConfigError(f"the {what} {os.fspath(path)!r} {exc}: {hint}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {os.fspath(path)!r}: {exc.strerror or exc}") from exc


def load_private_key(key: object) -> Ed25519PrivateKey:
    """An Ed25519 private key, given as a key object or the path of a PEM file (PKCS#8; if
    encrypted, the passphrase is read from ``$SHARDKEEP_KEY_PASSPHRASE``)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if isinstance(key, Ed25519PrivateKey):
        return key
    if not isinstance(key, (str, os.PathLike)):
        raise ConfigError(f"signer={key!r} must be an Ed25519PrivateKey or the path of a PEM private key file")
    data = _read_key_file(key, "private key file")
    passphrase = os.environ.get(PASSPHRASE_ENV)
    try:
        loaded = serialization.load_pem_private_key(data, password=passphrase.encode() if passphrase else None)
    except TypeError as exc:  # encrypted without a passphrase, or a passphrase for a plain key
        raise ConfigError(f"private key file {os.fspath(key)!r}: {exc} (set ${PASSPHRASE_ENV})") from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{os.fspath(key)!r} is not a readable PEM private key: {exc}") from exc
    if not isinstance(loaded, Ed25519PrivateKey):
        raise ConfigError(f"{os.fspath(key)!r} holds a {type(loaded).__name__}, not an Ed25519 private key")
    return loaded


def load_public_key(key: object) -> Ed25519PublicKey:
    """An Ed25519 public key, given as a key object or the path of a PEM file
    (SubjectPublicKeyInfo, as ``shardkeep keygen`` writes)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if isinstance(key, Ed25519PublicKey):
        return key
    if not isinstance(key, (str, os.PathLike)):
        raise ConfigError(f"public_key={key!r} must be an Ed25519PublicKey or the path of a PEM public key file")
    data = _read_key_file(key, "public key file")
    try:
        loaded = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{os.fspath(key)!r} is not a readable PEM public key: {exc}") from exc
    if not isinstance(loaded, Ed25519PublicKey):
        raise ConfigError(f"{os.fspath(key)!r} holds a {type(loaded).__name__}, not an Ed25519 public key")
    return loaded


def generate_key_pair(private_path: str | os.PathLike[str], public_path: str | os.PathLike[str]) -> str:
    """Write a new Ed25519 key pair (the private key mode 0600, encrypted when
    ``$SHARDKEEP_KEY_PASSPHRASE`` is set); refuse to replace existing files. Returns the key id."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    passphrase = os.environ.get(PASSPHRASE_ENV)
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase.encode()) if passphrase else serialization.NoEncryption()
    )
    private_pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    written: list[str | os.PathLike[str]] = []
    try:
        for path, data, mode in ((private_path, private_pem, 0o600), (public_path, public_pem, 0o644)):
            _write_exclusive(path, data, mode)
            written.append(path)
    except BaseException:
        for path in written:
            os.unlink(path)
        raise
    return key_id(private.public_key())


def _write_exclusive(path: str | os.PathLike[str], data: bytes, mode: int) -> None:
    """Write the new file ``path`` whole (never half a key) and never over an existing one."""
    try:
        localfs.write_file_atomic(path, data, mode=mode, overwrite=False)
    except FileExistsError as exc:
        raise ConfigError(f"{os.fspath(path)!r} already exists; keys are never overwritten") from exc
    except OSError as exc:
        raise ConfigError(f"cannot create {os.fspath(path)!r}: {exc.strerror}") from exc


def uncovered_digests(manifest: Manifest, manifest_bytes: bytes) -> list[str]:
    """The files, tensor chunks (whose own digests partial loads check) and the manifest's seal
    whose digests a signature cannot vouch for."""

    def weak(digest: str | None) -> bool:
        return digest is not None and digest.partition(":")[0] not in CRYPTOGRAPHIC_DIGESTS

    found = [record.path for record in manifest.files if record.digest is None or weak(record.digest)]
    found += [
        f"{record.path}:{entry.key}"
        for record, entry in manifest.iter_tensors()
        if weak(entry.digest)
        or (entry.global_offset is not None and block_width(record, entry) == FAST_BLOCK_DIGEST_BYTES)
    ]
    table = getattr(manifest, "indexes", None)  # format 2.x: the rank indexes' digests
    if table is not None and table.ranks and table.algorithm not in CRYPTOGRAPHIC_DIGESTS:
        found.append("indexes")
    seal = _SEAL.search(manifest_bytes[-256:])
    if seal is None or seal.group(1).decode() not in CRYPTOGRAPHIC_DIGESTS:
        found.append(SEAL_FIELD)
    return found


def sign_manifest(manifest_bytes: bytes, private_key: Ed25519PrivateKey, manifest: Manifest) -> bytes:
    """The contents of ``manifest.sig`` for these exact manifest bytes."""
    weak = uncovered_digests(manifest, manifest_bytes)
    if weak:
        raise UnsupportedValueError(
            "cannot sign a manifest whose digests are not cryptographic (xxh3-128 is fast but forgeable): "
            f"{', '.join(weak[:5])}; save with digest='blake3' or 'sha256'"
        )
    signature = private_key.sign(SIGNATURE_DOMAIN + manifest_bytes)
    record = _SignatureFile(
        format=SIGNATURE_FORMAT, algorithm="ed25519", key_id=key_id(private_key.public_key()), signature=signature.hex()
    )
    return msgspec.json.encode(record) + b"\n"


def parse_signature(data: bytes) -> tuple[str, bytes]:
    """(key id, raw signature) from ``manifest.sig`` bytes; strict: only the exact canonical
    encoding is accepted, so that any changed byte is an error."""
    if len(data) > MAX_SIGNATURE_BYTES:
        raise SignatureError(f"manifest.sig is {len(data)} bytes, over the limit of {MAX_SIGNATURE_BYTES}")
    try:
        record = msgspec.json.decode(data, type=_SignatureFile)
    except msgspec.DecodeError as exc:
        raise SignatureError(f"manifest.sig is malformed: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise SignatureError("manifest.sig is not valid UTF-8") from exc
    if record.format != SIGNATURE_FORMAT or record.algorithm != "ed25519":
        raise SignatureError(
            f"manifest.sig has format {record.format!r}, algorithm {record.algorithm!r}; "
            f"expected {SIGNATURE_FORMAT!r}, 'ed25519'"
        )
    if len(record.key_id) != 64 or not _HEX.fullmatch(record.key_id):
        raise SignatureError("manifest.sig: key_id must be 64 lowercase hex digits")
    if len(record.signature) != 128 or not _HEX.fullmatch(record.signature):
        raise SignatureError("manifest.sig: signature must be 128 lowercase hex digits")
    if msgspec.json.encode(record) + b"\n" != data:
        raise SignatureError("manifest.sig is not in its canonical form (it was changed)")
    return record.key_id, bytes.fromhex(record.signature)


@dataclass(frozen=True)
class SignaturePolicy:
    """How a reader treats ``manifest.sig``: with a ``public_key``, a present signature must be
    valid for it, and with ``required`` an absent one is an error too."""

    public_key: Ed25519PublicKey | None = None
    required: bool = False

    @classmethod
    def of(cls, public_key: object = None, require_signature: bool | None = None) -> SignaturePolicy:
        """From the public options: a ``public_key`` implies ``require_signature=True`` unless it
        is passed as ``False``; ``require_signature=True`` needs a ``public_key``."""
        if require_signature is not None and not isinstance(require_signature, bool):
            raise ConfigError(f"require_signature={require_signature!r} must be True, False or None")
        if public_key is None:
            if require_signature:
                raise ConfigError("require_signature=True needs public_key= (the key to check the signature with)")
            return cls()
        return cls(load_public_key(public_key), True if require_signature is None else require_signature)


class SignatureStatus(NamedTuple):
    """The outcome of :func:`check_signature`: ``verified`` with the given key, and a one-line
    description."""

    verified: bool
    text: str


def check_signature(manifest_bytes: bytes, signature: bytes | None, policy: SignaturePolicy) -> SignatureStatus:
    """Check ``signature`` (the bytes of ``manifest.sig``, ``None`` if absent) against
    ``policy`` before the manifest is parsed; raise :class:`SignatureError` when the policy is
    not met."""
    if signature is None:
        if policy.required:
            raise SignatureError("manifest.sig is missing: the checkpoint is not signed, and a signature is required")
        return SignatureStatus(False, "not signed")
    signer, raw = parse_signature(signature)
    if policy.public_key is None:
        return SignatureStatus(False, f"signed by key {signer[:16]} (not checked: no public key given)")
    from cryptography.exceptions import InvalidSignature

    expected = key_id(policy.public_key)
    if not hmac.compare_digest(signer, expected):
        raise SignatureError(
            f"manifest.sig was made with key {signer[:16]}, not with the given public key {expected[:16]}"
        )
    try:
        policy.public_key.verify(raw, SIGNATURE_DOMAIN + manifest_bytes)
    except InvalidSignature as exc:
        raise SignatureError(
            "manifest.sig does not match manifest.json: the manifest was changed after it was signed"
        ) from exc
    return SignatureStatus(True, f"valid signature by key {expected[:16]}")


def check_signed_digests(manifest: Manifest, manifest_bytes: bytes) -> None:
    """After a signature was verified: refuse a manifest whose digests it cannot vouch for."""
    weak = uncovered_digests(manifest, manifest_bytes)
    if weak:
        raise SignatureError(
            "the signed manifest records digests that are not cryptographic, so the signature does not "
            f"cover the data: {', '.join(weak[:5])}"
        )
