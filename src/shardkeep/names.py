"""Sibling names: the staging, being-deleted and temporary names derived from a user's name,
each within the byte limit of one path component.

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
Checkpoint names are here too: :func:`step_of_name` reads the step a ``step_<N>`` name says.
Nothing here touches the filesystem.
"""

from __future__ import annotations

import hashlib
import re

from shardkeep.errors import UnsafePathError

__all__ = [
    "NAME_MAX",
    "ATTEMPT_ID_CHARS",
    "MAX_STEP",
    "STEP_NAME",
    "check_name_length",
    "is_derived_name",
    "is_shortened",
    "is_sibling_of",
    "name_bytes",
    "name_digest",
    "sibling_name",
    "sibling_prefix",
    "step_of_name",
]

#: The most bytes of one path component (``NAME_MAX`` of Linux: ext4, xfs, btrfs, tmpfs ...).
NAME_MAX = 255
#: Separates the shortened head of a long name from its digest.
HASH_MARK = "~"
#: Hex digits of SHA-256 that stand for a shortened name (64 bits: no collision in one directory).
DIGEST_CHARS = 16


#: Checkpoint directories are named ``step_<N>``, ``N`` in up to 20 ASCII digits (``step_100``,
#: ``step_00000100``); the manager writes ``step_<N, 8 digits>``.
STEP_NAME = re.compile(r"step_([0-9]{1,20})")
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


def step_of_name(name: str) -> int | None:
    """The step that checkpoint name ``step_<N>`` says, or ``None`` when ``name`` is not one (a
    number above :data:`MAX_STEP` included: no manifest can record it)."""
    match = STEP_NAME.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step <= MAX_STEP else None


#: Marks the directory that a two-rename replacement moved out of the way
#: (``.NAME.old-<id>``; see :meth:`shardkeep.storage.localfs.LocalFS.replace_dir`).
REPLACED_MARKER = ".old-"
