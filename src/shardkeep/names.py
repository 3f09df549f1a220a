"""Every name shardkeep gives something on disk: the reserved file names of a checkpoint, the
markers of staging, being-deleted and kept-aside entries, checkpoint names (``step_<N>``), the
rule for a safe relative path, and the sibling names derived from a user's name, each within
the byte limit of one path component.

A reader of a root, a store or an integration recognises what it finds by these names, so each
is defined here once and imported everywhere else.

**Derived names.**

A filesystem refuses a path component of more than :data:`NAME_MAX` bytes (ENAMETOOLONG), so a
derived name ``<lead><name><marker><tail>`` (``step_1.tmp-<uuid>``, ``.folder.old-<id>``) cannot
simply append to a name that is itself legal. Every derived name is built here:

- when it fits, it is the plain concatenation (the names earlier versions wrote, unchanged);
- otherwise ``name`` is shortened to its longest prefix of whole characters that fits, followed
  by ``~`` and the first 16 hex digits of the SHA-256 of the whole name. The marker stays in the
  name, so anything that recognises leftovers by their marker (``.tmp-``, ``.deleting-``) still
  does, and a derived name is never mistaken for the name it derives from.

:func:`is_sibling_of` tells whether a derived name belongs to a given name, in either form;
:func:`is_derived_name` whether a name has the shape of a staging or being-deleted name at all
(``<name or its shortened form><marker><32 hex digits>``): a name that merely contains a marker
is a user's name like any other.
Checkpoint names are here too: :func:`checkpoint_name` makes ``step_<N>``, :func:`step_of_name`
reads the step such a name says. Nothing here touches the filesystem, and nothing imports torch.
"""

from __future__ import annotations

import hashlib
import re

from shardkeep.errors import ConfigError, UnsafePathError

__all__ = [
    "ATTEMPT_ID_CHARS",
    "ATTEMPT_PREFIX",
    "CHECKPOINT_NAME",
    "CORRUPT_MARKER",
    "DELETING_MARKER",
    "HF_OLD_MARKER",
    "INDEX_DIRECTORY",
    "LIGHTNING_NEW_ROLE",
    "LIGHTNING_OLD_ROLE",
    "LIGHTNING_RETIRED_ROLE",
    "LIGHTNING_TAG",
    "MANIFEST_FILENAME",
    "MAX_STEP",
    "NAME_MAX",
    "NODE_PART_FILENAME",
    "POINTERS",
    "RETAINED_MARKER",
    "SIGNATURE_FILENAME",
    "STAGING_MARKER",
    "STEP_NAME",
    "check_name_length",
    "checkpoint_name",
    "index_path",
    "is_staging_name",
    "is_temporary_sibling",
    "unsafe_path_reason",
    "is_derived_name",
    "is_shortened",
    "is_sibling_of",
    "name_bytes",
    "name_digest",
    "sibling_name",
    "sibling_prefix",
    "step_of_checkpoint",
    "step_of_name",
]

# --------------------------------------------------------------------------------------------
# Reserved names and markers
# --------------------------------------------------------------------------------------------

#: A checkpoint's manifest; written last, its presence means committed.
MANIFEST_FILENAME = "manifest.json"
#: The detached signature of a checkpoint's manifest.
SIGNATURE_FILENAME = "manifest.sig"
#: In a node's part of a node-local checkpoint: which node, ranks and files it holds by design,
#: and the digest of the manifest it belongs to (see :mod:`shardkeep.levels.local_save`).
NODE_PART_FILENAME = "node-part.json"
#: Staging directories are named ``<final>.tmp-<id>``; they are never read as checkpoints.
STAGING_MARKER = ".tmp-"
#: A checkpoint being deleted is first renamed to ``<name>.deleting-<id>`` (un-committed).
DELETING_MARKER = ".deleting-"
#: A checkpoint that failed verification is set aside as ``<name>.corrupt-<id>`` by the manager.
CORRUPT_MARKER = ".corrupt-"
#: The file left in a deleted checkpoint's directory whose data files later checkpoints still
#: reference: the directory is retained data, not a checkpoint.
RETAINED_MARKER = "_retained"
#: Pointer files at a root: ``last`` names the newest verified checkpoint, ``best`` the best.
POINTERS = ("last", "best")
#: Data written by one save attempt on a store without rename (or in a tier location) lives
#: under ``<checkpoint>/attempt-<id>/``: a prefix no other attempt uses, so nothing is ever
#: overwritten (see :mod:`shardkeep.distributed.commit`).
ATTEMPT_PREFIX = "attempt-"
#: The directory of the rank indexes of a format 2.x checkpoint.
INDEX_DIRECTORY = "index/"
#: Hugging Face folders: the previous folder during a replacement is ``.<name>.old-<id>``.
HF_OLD_MARKER = ".old-"
#: Lightning's working names beside a checkpoint ``X`` start with a hidden tag,
#: ``.sk-<hex of X>.``, followed by a role and an id: ``new-`` a save being written, ``old-``
#: the previous checkpoint during a swap, ``del-`` anything being deleted.
LIGHTNING_TAG = ".sk-"
LIGHTNING_NEW_ROLE = "new-"
LIGHTNING_OLD_ROLE = "old-"
LIGHTNING_RETIRED_ROLE = "del-"

#: The most bytes of one path component (``NAME_MAX`` of Linux: ext4, xfs, btrfs, tmpfs ...).
NAME_MAX = 255
#: Separates the shortened head of a long name from its digest.
HASH_MARK = "~"
#: Hex digits of SHA-256 that stand for a shortened name (64 bits: no collision in one directory).
DIGEST_CHARS = 16


#: Checkpoint directories are named ``step_<N>``, ``N`` in up to 20 ASCII digits (``step_100``,
#: ``step_00000100``); the manager writes ``step_<N, 8 digits>`` (:func:`checkpoint_name`).
STEP_NAME = re.compile(r"step_([0-9]{1,20})")
#: The committed checkpoints of a root: see :func:`step_of_name`, which also bounds ``N`` by
#: what a manifest records.
CHECKPOINT_NAME = STEP_NAME
#: The largest step a manifest records (an unsigned 64-bit integer).
MAX_STEP = (1 << 64) - 1

#: Hex digits of the fresh id that ends a staging or being-deleted name in a checkpoint root.
ATTEMPT_ID_CHARS = 32
_ATTEMPT_ID = re.compile(f"[0-9a-f]{{{ATTEMPT_ID_CHARS}}}")

_SHORTENED = re.compile(rf"{re.escape(HASH_MARK)}[0-9a-f]{{{DIGEST_CHARS}}}")


def _encoded(name: str) -> bytes:
    # surrogateescape: a name os.listdir decoded from undecodable bytes encodes back to them.
    return name.encode("utf-8", "surrogateescape")


def name_bytes(name: str) -> int:
    """The length of ``name`` on disk, in bytes."""
    return len(_encoded(name))


def name_digest(name: str, chars: int = DIGEST_CHARS) -> str:
    """The first ``chars`` hex digits of the SHA-256 of ``name``'s bytes."""
    return hashlib.sha256(_encoded(name)).hexdigest()[:chars]


def check_name_length(name: str, what: str) -> None:
    """Refuse (:class:`~shardkeep.errors.UnsafePathError`) a path component longer than
    :data:`NAME_MAX` bytes; ``what`` names it in the message (``"checkpoint name"``)."""
    size = name_bytes(name)
    if size > NAME_MAX:
        raise UnsafePathError(
            f"{what} {name[:40]!r}... is {size} bytes long; a file or directory name may have at most "
            f"{NAME_MAX} bytes (UTF-8)"
        )


def _shortened(name: str, room: int) -> str:
    """``name`` if it fits in ``room`` bytes, else its longest prefix (whole characters) that
    fits with ``~`` and its digest."""
    if name_bytes(name) <= room:
        return name
    budget = room - len(HASH_MARK) - DIGEST_CHARS
    if budget < 0:
        raise UnsafePathError(f"no room for a name derived from {name[:40]!r}... ({room} bytes)")
    head: list[str] = []
    used = 0
    for character in name:
        used += name_bytes(character)
        if used > budget:
            break
        head.append(character)
    return f"{''.join(head)}{HASH_MARK}{name_digest(name)}"


def sibling_prefix(name: str, marker: str, *, reserve: int, lead: str = "") -> str:
    """``<lead><name><marker>``, with ``name`` shortened (see the module docstring) so that
    ``reserve`` more bytes still fit in :data:`NAME_MAX`."""
    room = NAME_MAX - name_bytes(lead) - name_bytes(marker) - reserve
    return f"{lead}{_shortened(name, room)}{marker}"


def sibling_name(name: str, marker: str, tail: str = "", *, lead: str = "") -> str:
    """``<lead><name><marker><tail>`` within :data:`NAME_MAX` bytes: ``name`` is shortened
    when needed, ``lead``, ``marker`` and ``tail`` never are."""
    return sibling_prefix(name, marker, reserve=name_bytes(tail), lead=lead) + tail


def is_shortened(head: str) -> bool:
    """Whether ``head`` (a derived name up to its marker) may be a shortened name: it ends with
    ``~`` and a digest, so the name it stands for is not written out in it."""
    return _SHORTENED.fullmatch(head[-len(HASH_MARK) - DIGEST_CHARS :]) is not None


def is_sibling_of(sibling: str, name: str, marker: str, *, lead: str = "") -> bool:
    """Whether ``sibling`` is :func:`sibling_name` of ``name`` with this ``marker`` and ``lead``
    and some tail (which must not contain ``marker``)."""
    head, found, tail = sibling.rpartition(marker)
    if not found:
        return False
    return f"{head}{found}" == sibling_prefix(name, marker, reserve=name_bytes(tail), lead=lead)


def is_derived_name(name: str, marker: str) -> bool:
    """Whether ``name`` has the shape of a name derived with ``marker`` and a fresh id:
    ``<head><marker><32 lowercase hex digits>``, ``head`` not empty (a whole name, or a long
    one shortened with its digest)."""
    head, found, tail = name.rpartition(marker)
    return bool(found) and bool(head) and _ATTEMPT_ID.fullmatch(tail) is not None


#: A temporary file written beside its destination before the rename (``.NAME.tmp-<12 hex>``,
#: by the local durable writes and by files arriving over the process group).
_TEMPORARY_SIBLING = re.compile(r"\..+" + re.escape(STAGING_MARKER) + r"[0-9a-f]{12}")


def is_temporary_sibling(name: str) -> bool:
    """Whether ``name`` (a file name, no directory) has the shape of a temporary file written
    beside its destination before the rename: left behind only by a process killed mid-write."""
    return _TEMPORARY_SIBLING.fullmatch(name) is not None


def step_of_name(name: str) -> int | None:
    """The step that checkpoint name ``step_<N>`` says, or ``None`` when ``name`` is not one (a
    number above :data:`MAX_STEP` included: no manifest can record it)."""
    match = STEP_NAME.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step <= MAX_STEP else None


def step_of_checkpoint(name: str) -> int:
    """The step of checkpoint name ``name`` (``step_<N>``, as :func:`checkpoint_name` makes
    it); refuses (:class:`~shardkeep.errors.ConfigError`) any other name."""
    step = step_of_name(name)
    if step is None:
        raise ConfigError(f"{name[:80]!r} is not a checkpoint name (step_<N>)")
    return step


def checkpoint_name(step: int) -> str:
    """The name of the checkpoint of ``step`` in a root: ``step_<N, 8 digits>``; refuses
    (:class:`~shardkeep.errors.ConfigError`) a step that is not an integer from 0 to
    :data:`MAX_STEP`."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ConfigError(f"step={step!r} must be an integer from 0 to {MAX_STEP}")
    return f"step_{step:08d}"


def index_path(rank: int) -> str:
    """Where the index of ``rank`` lies in a format 2.x checkpoint."""
    return f"{INDEX_DIRECTORY}rank_{rank:05d}.json"


def is_staging_name(name: str) -> bool:
    """True for a staging or being-deleted directory name (of the shape shardkeep creates, see
    :func:`is_derived_name`), which is never read as a checkpoint."""
    return is_derived_name(name, STAGING_MARKER) or is_derived_name(name, DELETING_MARKER)


_WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:")
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def unsafe_path_reason(path: str) -> str | None:
    """Why ``path`` is not a safe relative path inside a checkpoint, or ``None`` if it is.

    Safe means: relative, ``/``-separated, no empty, ``.`` or ``..`` component, no backslash,
    no NUL or control character, and not longer than 1024 bytes.
    """
    if not isinstance(path, str) or not path:
        return "path is empty"
    if len(path.encode("utf-8", "surrogatepass")) > 1024:
        return "path is longer than 1024 bytes"
    if path.startswith("/"):
        return "path is absolute"
    if "\\" in path:
        return "path contains a backslash"
    if _CONTROL_CHARACTER.search(path) is not None:
        return "path contains a NUL or control character"
    if _WINDOWS_DRIVE.match(path):
        return "path starts with a drive letter"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return f"path has a {part or 'empty'!r} component" if part else "path has an empty component"
    return None
