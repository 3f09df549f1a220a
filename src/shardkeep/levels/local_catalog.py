"""One node's root of a node-local level: its steps, each one's state, the check of the node's
own files, and the removal of steps and of leftovers of interrupted saves.

A node sees only its part of a step (:mod:`shardkeep.levels.local_save`). Its states:

- ``committed``: ``step_<N>/`` holds a manifest and a ``node-part.json`` whose
  ``manifest_digest`` is that manifest's identity (and, after :func:`verify_part`, every file
  the part holds is present with the recorded size and digest);
- ``damaged``: a ``step_<N>/`` directory that is not such a part (``problems`` says why);
- ``staging``: ``step_<N>.tmp-<id>/``, an attempt in progress or left by a crash, with the
  seconds since anything in it changed (``age``); :func:`collect_leftovers` removes those
  idle for the lease.

Whether a step is complete across nodes is not a single node's to say: a restore gathers the
parts of every node (same ``manifest_digest``) to decide.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from shardkeep.catalog import DEFAULT_LEASE, CheckpointRoot
from shardkeep.errors import CheckpointDataError, ShardkeepError, SignatureError, UnsupportedValueError
from shardkeep.indexes import expand_all, read_small
from shardkeep.integrity import MAX_SIGNATURE_BYTES
from shardkeep.io import check_shard
from shardkeep.levels.parts import NodePart, decode_node_part, manifest_identity
from shardkeep.manifest import IndexedManifest, Manifest
from shardkeep.names import (
    MANIFEST_FILENAME,
    NODE_PART_FILENAME,
    SIGNATURE_FILENAME,
    STAGING_MARKER,
    is_derived_name,
    is_temporary_sibling,
    step_of_name,
)
from shardkeep.storage import ByteStore, LocalStore
from shardkeep.storage.localfs import current as local_fs
from shardkeep.storage.localfs import retire_and_remove
from shardkeep.verification import CheckpointLocation, file_set_problems, parse_manifest, read_manifest_bytes

__all__ = [
    "LocalStep",
    "PartState",
    "collect_leftovers",
    "read_part",
    "read_signature",
    "remove_step",
    "scan",
    "verify_part",
]

PartState = Literal["committed", "damaged", "staging"]
#: The most bytes a ``node-part.json`` may have.
_MAX_PART_BYTES = 64 << 20


@dataclass
class LocalStep:
    """One entry of a node's root: ``name`` (``step_<N>``, or the staging name), ``step``,
    ``state``, and for a committed or damaged step its ``part`` and ``manifest_digest`` (when
    they could be read) and ``problems``; for a staging directory its ``attempt`` id and
    ``age`` in seconds (``None``: unreadable)."""

    name: str
    step: int
    state: PartState
    part: NodePart | None = None
    manifest_digest: str | None = None
    problems: list[str] = field(default_factory=list)
    attempt: str | None = None
    age: float | None = None


def _store(root: str | os.PathLike[str] | ByteStore) -> ByteStore:
    if isinstance(root, (str, os.PathLike)):
        return LocalStore(os.path.abspath(os.fspath(root)))
    return root


def read_part(root: str | os.PathLike[str] | ByteStore, name: str) -> tuple[bytes, Manifest, NodePart]:
    """The sealed manifest bytes, the (checked) manifest and the node part of step ``name`` in
    this node's ``root``. Raises a :class:`~shardkeep.errors.ShardkeepError` saying what is
    wrong: no manifest, a bad seal, no or a bad ``node-part.json``, or a part of another
    manifest."""
    store = _store(root)
    location = CheckpointLocation(store, name)
    data = read_manifest_bytes(location)
    manifest = parse_manifest(data, where=str(location))
    part_path = f"{name}/{NODE_PART_FILENAME}"
    if store.stat(part_path) is None:
        raise CheckpointDataError(f"{location}: no {NODE_PART_FILENAME}: not a node-local part")
    part = decode_node_part(
        read_small(store, part_path, _MAX_PART_BYTES, CheckpointDataError), where=f"{location}/{NODE_PART_FILENAME}"
    )
    if part.manifest_digest != manifest_identity(data):
        raise CheckpointDataError(
            f"{location}: {NODE_PART_FILENAME} belongs to another manifest (digest {part.manifest_digest}, "
            f"the manifest's is {manifest_identity(data)})"
        )
    return data, manifest, part


def read_signature(root: str | os.PathLike[str] | ByteStore, name: str) -> bytes | None:
    """The ``manifest.sig`` of step ``name`` in this node's ``root`` (``None``: unsigned), the
    same bytes on every node; a drain copies it with the manifest."""
    store = _store(root)
    path = f"{name}/{SIGNATURE_FILENAME}"
    if store.stat(path) is None:
        return None
    return read_small(store, path, MAX_SIGNATURE_BYTES, SignatureError)


def verify_part(
    root: str | os.PathLike[str] | ByteStore,
    name: str,
    *,
    io_threads: int = 2,
    on_bytes: Callable[[int], None] | None = None,
) -> list[str]:
    """Every problem of this node's part of step ``name``: the manifest's seal and checks, the
    node part, every rank index, the directory's file set (:func:`~shardkeep.verification.file_set_problems`
    against the files the part holds), and the size and digest of each data file the part
    holds (including healed ones and replicas). Empty when the part verifies; never raises for bad content."""
    store = _store(root)
    location = CheckpointLocation(store, name)
    try:
        _, manifest, part = read_part(store, name)
    except ShardkeepError as exc:
        return [str(exc)]
    problems: list[str] = []
    if isinstance(manifest, IndexedManifest):
        try:
            manifest = expand_all(store, name, manifest)
        except ShardkeepError as exc:
            return [str(exc)]
    holds = part.holds()
    records = {record.path: record for record in manifest.files}
    problems += [
        f"{path}: listed in {NODE_PART_FILENAME} but not in the manifest" for path in sorted(holds - set(records))
    ]
    try:
        problems += file_set_problems(location, manifest, holds=holds)
    except ShardkeepError as exc:
        problems.append(f"{location}: {exc}")

    def check(path: str) -> list[str]:
        if store.stat(f"{name}/{path}") is None:
            return []  # reported by the file set
        return check_shard(store, f"{name}/{path}", records[path], verify=True, keep=False, on_bytes=on_bytes)[1]

    with ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="shardkeep-verify-part") as pool:
        for found in pool.map(check, sorted(holds & set(records))):
            problems.extend(found)
    return problems


def scan(
    root: str | os.PathLike[str] | ByteStore, *, verify: bool = False, now: float | None = None
) -> list[LocalStep]:
    """This node's steps, oldest first (staging directories after the steps of their number).
    Committed parts are read (manifest seal, node part); with ``verify``, each one's files are
    also checked (:func:`verify_part`), and a part with problems is ``damaged``. A missing root
    holds nothing."""
    store = _store(root)
    now = time.time() if now is None else now
    try:
        entries = store.list_dir("")
    except ShardkeepError:
        return []
    found: list[LocalStep] = []
    ages: dict[str, float | None] | None = None
    for name, info in entries:
        step = step_of_name(name)
        if step is not None and info.kind == "dir":
            found.append(_committed_or_damaged(store, name, step, verify=verify))
        elif is_derived_name(name, STAGING_MARKER):
            head, _, attempt = name.rpartition(STAGING_MARKER)
            staged = step_of_name(head)
            if staged is None:
                continue
            if ages is None:
                ages = dict(CheckpointRoot(store).leftovers(now=now))
            found.append(LocalStep(name, staged, "staging", attempt=attempt, age=ages.get(name)))
    return sorted(found, key=lambda item: (item.step, item.state == "staging", item.name))


def _committed_or_damaged(store: ByteStore, name: str, step: int, *, verify: bool) -> LocalStep:
    try:
        data, _, part = read_part(store, name)
    except ShardkeepError as exc:
        digest = None
        if store.stat(f"{name}/{MANIFEST_FILENAME}") is not None:
            try:
                digest = manifest_identity(read_manifest_bytes(CheckpointLocation(store, name)))
            except ShardkeepError:
                digest = None
        return LocalStep(name, step, "damaged", manifest_digest=digest, problems=[str(exc)])
    problems = verify_part(store, name) if verify else []
    state: PartState = "damaged" if problems else "committed"
    return LocalStep(name, step, state, part=part, manifest_digest=manifest_identity(data), problems=problems)


def remove_step(root: str | os.PathLike[str], name: str) -> bool:
    """Remove this node's part of step ``name``: renamed aside under the deleting marker
    (durably), then removed, so a half-removed part never looks committed. ``False`` when
    there was nothing."""
    if step_of_name(name) is None:
        raise UnsupportedValueError(f"{name!r} is not a step name (step_<N>)")
    return retire_and_remove(os.path.join(os.path.abspath(os.fspath(root)), name))


def collect_leftovers(
    root: str | os.PathLike[str] | ByteStore, *, lease: float = DEFAULT_LEASE, now: float | None = None
) -> list[str]:
    """Remove this node's stale leftovers: staging directories of local saves idle for
    ``lease`` seconds, half-removed steps (``.deleting-``), and, inside committed steps, the
    temporary files of replicas or heals whose process was killed mid-file; the names
    removed. The staging directory of a save in progress changes while it runs, so a lease
    longer than any save never removes one."""
    store = _store(root)
    try:
        store.list_dir("")
    except ShardkeepError:
        return []
    removed = CheckpointRoot(store).collect_leftovers(lease=lease, now=now)
    if isinstance(root, (str, os.PathLike)):
        base = os.path.abspath(os.fspath(root))
        fs = local_fs()
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            if step_of_name(name) is None or not os.path.isdir(os.path.join(base, name)):
                continue
            for directory, _, _ in os.walk(os.path.join(base, name)):
                found = fs.remove_idle(directory, is_temporary_sibling, lease, now=now)
                removed += [os.path.relpath(os.path.join(directory, each), base) for each in found]
    return removed
