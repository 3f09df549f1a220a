"""A root of checkpoints, as the checkpoint manager and ``shardkeep ls``/``prune`` see it.

The truth about a root is its committed checkpoints and their manifests, never a listing alone
and never the pointer files: ``step_<N>/`` directories whose ``manifest.json`` verifies. Each
manifest written by a :class:`~shardkeep.manager.CheckpointManager` carries the run id, the
metrics and the retention policy, so everything here (latest, best, what to keep) is rebuilt
from the checkpoints themselves after any restart.

What this module does to storage, always as the coordinator alone:

- retention: only after a commit is durable, and never the newest checkpoint that verifies,
  the best one, or a file a kept checkpoint references; a checkpoint is deleted by
  first *un-committing* it, a no-replace rename to ``<name>.deleting-<uuid>`` with an fsync of the
  root, and only then removing the tree. A crash at any point leaves either a whole committed
  checkpoint or a ``.deleting-`` directory that nothing reads as a checkpoint. On an object
  store (no rename), or when a kept checkpoint references some of its files, un-committing is
  removing its manifest first; then every file of it that no remaining manifest lists is
  removed, in the checkpoint's directory, in its tiers' locations, and in the earlier
  checkpoints it referenced (reference counting derived from the manifests alone);
- the ``last`` and ``best`` pointer files: small JSON files replaced atomically (never
  symlinks). They are hints for humans and tools; nothing here trusts them;
- leftovers: ``.deleting-`` directories are removed; staging directories
  (``.tmp-``), and on object stores and tier locations the ``attempt-<id>/`` prefixes that no
  manifest uses and unfinished multipart uploads, only once nothing in them has changed for
  the lease.

Checkpoints of other runs, and checkpoints whose manifest cannot be read (so their run is
unknown), are never deleted.

A checkpoint is trusted only under its own name: a ``step_<N>`` directory whose manifest records
another step (a checkpoint renamed or copied, perhaps to pass an old, validly signed checkpoint
off as the newest: a signature proves who wrote the bytes, not when or under which name) is
*misnamed*. It is listed with that problem, and is never the newest, the best, the resume point,
the owner of the root, nor deleted by retention as if it were the step its name says.

This module does not import torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardkeep.config import ManifestLimits
from shardkeep.errors import CheckpointNotFoundError, ShardkeepError, StorageError
from shardkeep.indexes import expand_all, index_paths
from shardkeep.integrity import SignaturePolicy
from shardkeep.manifest import FileRecord, Manifest, stored_bytes
from shardkeep.names import (
    ATTEMPT_PREFIX,
    CHECKPOINT_NAME,
    DELETING_MARKER,
    MANIFEST_FILENAME,
    POINTERS,
    RETAINED_MARKER,
    SIGNATURE_FILENAME,
    STAGING_MARKER,
    checkpoint_name,
    is_derived_name,
    is_shortened,
    is_sibling_of,
    is_staging_name,
    sibling_name,
    step_of_name,
)
from shardkeep.retention import CheckpointInfo, RetentionDecision, RetentionPolicy, decide, load_config_file
from shardkeep.storage import ByteStore, LocalStore, adapt_store, local_path, open_store, renames
from shardkeep.verification import (
    CheckpointLocation,
    FileResolver,
    file_set_problems,
    missing_tier_problem,
    missing_tiers,
    parse_manifest,
    read_manifest_bytes,
    verify,
)

__all__ = [
    "CHECKPOINT_NAME",
    "POINTERS",
    "CheckpointEntry",
    "CheckpointRoot",
    "Found",
    "checkpoint_name",
    "duplicate_problem",
    "load_config_file",
    "misnamed_problem",
    "missing_tier_problem",
    "missing_tiers",
]

logger = logging.getLogger("shardkeep")

#: Staging directories untouched for this long are leftovers of crashed saves.
DEFAULT_LEASE = 3600.0


def misnamed_problem(name: str, manifest: Manifest) -> str | None:
    """Why checkpoint directory ``name`` does not agree with the step its manifest records
    (``None`` when it does, or when the manifest records no step).

    A renamed or copied checkpoint still verifies, and a signature over its manifest is still
    valid: neither covers the directory's name. Only this comparison tells that
    ``step_00000099`` holds step 3. Any spelling of the step agrees: ``step_3`` and
    ``step_00000003`` both name step 3.
    """
    if manifest.step is None or step_of_name(name) == manifest.step:
        return None
    return (
        f"name {name} but the manifest says step {manifest.step} (renamed or copied?): not trusted under this "
        f"name; its own name is {checkpoint_name(manifest.step)}"
    )


def duplicate_problem(name: str, step: int, used: str) -> str:
    """Why ``name`` is passed over: ``used`` names the same step, and is the one used."""
    return f"{name} names step {step}, as {used} does: only {used} is used for step {step}"


@dataclass(frozen=True)
class CheckpointEntry:
    """One committed checkpoint of a root, as :meth:`CheckpointManager.list` returns it.

    ``verified`` is ``True`` when every file's digest was checked, ``None`` when only the
    manifest (seal, schema) and the file set and sizes were checked, ``False`` when a check
    failed (``problems`` says which). ``is_last``/``is_best`` follow the retention policy;
    ``is_newest`` marks the newest verified checkpoint, the resume point that is always kept.
    ``metric`` is the value of the policy's metric; ``metrics`` holds every recorded metric.
    ``misnamed`` marks a directory whose name disagrees with its manifest's step (renamed or
    copied): it is never last, best or newest, and ``problems`` says which step it holds.
    ``missing_tiers`` names the tiers whose location held nothing of the checkpoint when it
    was verified (moved or offline: one problem each, not one per file).
    """

    name: str
    path: str
    step: int
    metric: float | None = None
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    is_last: bool = False
    is_best: bool = False
    is_newest: bool = False
    verified: bool | None = None
    problems: tuple[str, ...] = ()
    size: int = 0
    run_id: str | None = None
    created_at: _dt.datetime | None = None
    misnamed: bool = False
    missing_tiers: tuple[str, ...] = ()
    manifest: Manifest | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """No check has failed (``verified`` is ``True`` or ``None``)."""
        return self.verified is not False


@dataclass
class Found:
    """One directory of a root as :meth:`CheckpointRoot.scan` found it: its name and step, its
    manifest (``None`` when unreadable) and the problems found."""

    name: str
    step: int
    manifest: Manifest | None
    problems: list[str]
    full: bool = False
    #: The directory's name disagrees with the manifest's step (see :func:`misnamed_problem`).
    misnamed: bool = False
    #: Tiers whose location held nothing of the checkpoint at the full verification.
    missing_tiers: list[str] = field(default_factory=list)
    #: Another directory names the same step and is the one used (see :meth:`CheckpointRoot.scan`).
    duplicate: bool = False


_Found = Found  # deprecated alias of Found


class CheckpointRoot:
    """The committed checkpoints in one store, with retention, pointers and leftover cleanup."""

    def __init__(
        self,
        store: ByteStore,
        *,
        display: str | None = None,
        limits: ManifestLimits | None = None,
        storage_options: Mapping[str, Any] | None = None,
        signatures: SignaturePolicy | None = None,
        tier_locations: Mapping[str, str] | None = None,
        remap_hint: str = "tier_locations={{{tier!r}: NEW_LOCATION}}",
    ) -> None:
        self.store = adapt_store(store)
        self.display = display or self.store.root
        self.limits = limits
        self.storage_options = storage_options
        self.signatures = signatures or SignaturePolicy()
        #: Tiers moved since their checkpoints were saved: tier name -> its new location
        #: (applied to every checkpoint that defines the tier; used by :meth:`verify_fully`).
        self.tier_locations = dict(tier_locations or {})
        #: Tier locations this root's saves write to (set by the manager from its ``tiers``).
        self.tier_homes: set[str] = set()
        #: How a user remaps a missing tier, in the words of the caller (API or command line).
        self.remap_hint = remap_hint
        self._tier_stores: dict[str, ByteStore] = {}

    @classmethod
    def at(
        cls,
        path: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        tier_locations: Mapping[str, str] | None = None,
        remap_hint: str = "tier_locations={{{tier!r}: NEW_LOCATION}}",
        limits: ManifestLimits | None = None,
    ) -> CheckpointRoot:
        """The root at a local path or a URL (``s3://bucket/prefix``)."""
        text = os.fspath(path)
        options: dict[str, Any] = {
            "limits": limits,
            "storage_options": storage_options,
            "tier_locations": tier_locations,
            "remap_hint": remap_hint,
        }
        local = local_path(text)
        if local is None:
            return cls(open_store(text, storage_options), display=text.rstrip("/"), **options)
        return cls(LocalStore(local), display=local, **options)

    def tier_store(self, location: str | None) -> ByteStore:
        """The store of a tier location (``None``: this root's store), opened once."""
        if location is None:
            return self.store
        store = self._tier_stores.get(location)
        if store is None:
            store = self._tier_stores[location] = open_store(location, self.storage_options)
        return store

    def _expanded(self, name: str, manifest: Manifest) -> Manifest:
        """A format 2.x manifest with its rank indexes expanded: every file of the checkpoint,
        for the few steps that need them (deleting it; the references of an incremental one).
        Scans and listings read the manifest alone: at a thousand ranks, the indexes of one
        checkpoint are hundreds of megabytes."""
        return expand_all(self.store, name, manifest, limits=self.limits)

    def _with_refs(self, name: str, manifest: Manifest) -> Manifest:
        """``manifest`` expanded when its indexes reference files of earlier checkpoints (an
        incremental save), else as it is: only then can its indexes keep files of others."""
        table = getattr(manifest, "indexes", None)
        if table is None or not table.refs:
            return manifest
        return self._expanded(name, manifest)

    def path_of(self, name: str) -> str:
        return f"{self.display.rstrip('/')}/{name}"

    # -- reading ---------------------------------------------------------------------------
    def scan(self) -> list[Found]:
        """Every ``step_<N>`` directory, oldest first, with its manifest (or why there is none)
        and the problems a quick check finds: file set and sizes against the manifest."""
        found: list[Found] = []
        for name, info in self.store.list_dir(""):
            step = step_of_name(name)
            if step is None:
                continue
            if info.kind != "dir":
                found.append(Found(name, step, None, [f"{name} is not a directory"]))
                continue
            location = CheckpointLocation(self.store, name)
            try:
                data = read_manifest_bytes(location, self.limits)
                manifest = parse_manifest(data, where=self.path_of(name), limits=self.limits)
            except StorageError:
                raise  # an I/O failure says nothing about the checkpoint: never read it as corrupt
            except CheckpointNotFoundError as exc:
                if not renames(self.store) or self._only_retained_data(name) or not self.store.list_dir(name):
                    # An object-store prefix without a manifest is an unfinished save or
                    # leftovers (a listing never proves a checkpoint); a directory holding only
                    # files that later checkpoints reference is retained data, not a checkpoint;
                    # an empty directory is a place a save may commit into.
                    continue
                found.append(Found(name, step, None, [str(exc)]))
                continue
            except ShardkeepError as exc:
                found.append(Found(name, step, None, [str(exc)]))
                continue
            misnamed = misnamed_problem(name, manifest)
            problems = [misnamed] if misnamed is not None else []
            quick, missing = self._quick_problems(location, manifest)
            problems.extend(quick)
            found.append(Found(name, step, manifest, problems, misnamed=misnamed is not None, missing_tiers=missing))
        found.sort(key=lambda item: (item.step, item.name))
        self._pass_over_duplicates(found)
        return found

    @staticmethod
    def _pass_over_duplicates(found: list[Found]) -> None:
        """Several directories naming one step (``step_100`` and ``step_00000100``): the
        manager's own spelling (8 digits) is used if present, else the first in name order; the
        others are treated as misnamed (listed with the reason; never last, best, newest,
        restored or deleted). Only directories with a readable manifest that is not misnamed
        take part."""
        by_step: dict[int, list[Found]] = {}
        for item in found:
            if not item.misnamed and item.manifest is not None:
                by_step.setdefault(item.step, []).append(item)
        for step, items in by_step.items():
            if len(items) < 2:
                continue
            own = checkpoint_name(step)
            used = next((item for item in items if item.name == own), items[0])
            for item in items:
                if item is not used:
                    item.misnamed = item.duplicate = True
                    item.problems.insert(0, duplicate_problem(item.name, step, used.name))

    def _only_retained_data(self, name: str) -> bool:
        """Whether directory ``name`` holds nothing but files that retention kept because a
        remaining checkpoint references them (its own manifest is gone)."""
        try:
            listing = self.store.list_files(name)
        except ShardkeepError:
            return False
        return (
            bool(listing)
            and all(info.kind == "file" for _, info in listing)
            and RETAINED_MARKER in {relative.rpartition("/")[2] for relative, _ in listing}
        )

    def _quick_problems(self, location: CheckpointLocation, manifest: Manifest) -> tuple[list[str], list[str]]:
        """What a check without reading data finds: the file set and sizes of the checkpoint's
        own directory, and every file the manifest lists elsewhere (in a tier's own location,
        or an earlier checkpoint it references) present with its size, one listing per place.
        Returns the problems and the tiers whose location holds nothing of the checkpoint (one
        problem each, saying how to remap them)."""
        remapped = self.tiers_remapped(manifest)
        resolver = FileResolver(location, manifest, tier_locations=remapped, storage_options=self.storage_options)
        try:
            listing = self.store.list_files(location.name)
            problems = file_set_problems(location, manifest, listing, resolver)
            sizes = {relative: info.size for relative, info in listing}
            missing = missing_tiers(resolver, manifest)
        except StorageError:
            raise
        except ShardkeepError as exc:
            return [str(exc)], []
        problems.extend(
            missing_tier_problem(tier, where, self.remap_hint, tier in remapped) for tier, where in missing.items()
        )
        elsewhere: dict[tuple[str, str], list[FileRecord]] = {}
        for record in manifest.files:
            if not resolver.own_directory(record):
                if record.tier not in missing:
                    elsewhere.setdefault((record.tier, record.ref or location.name), []).append(record)
                continue
            size = sizes.get(record.path)
            if size is None and not renames(self.store):
                problems.append(f"{record.path}: missing (listed in the manifest)")
            elif size is not None and size != record.stored_size:
                problems.append(f"{record.path}: size {size}, the manifest says {record.stored_size}")
        for (tier, owner), records in elsewhere.items():
            store = resolver.store_of(tier)
            try:
                found = {relative: info for relative, info in store.list_files(owner)}
            except CheckpointNotFoundError:
                found = {}
            except ShardkeepError as exc:  # an I/O error proves nothing about the files: unknown
                where = f"{store.root.rstrip('/')}/{owner}: {exc}"
                problems.append(missing_tier_problem(tier, where, self.remap_hint, tier in remapped))
                missing[tier] = where
                continue
            for record in records:
                info = found.get(record.path)
                where = resolver.describe(record)
                if info is None or info.kind != "file":
                    problems.append(f"{record.path}: missing (listed in the manifest; at {where})")
                elif info.size != record.stored_size:
                    problems.append(
                        f"{record.path}: size {info.size}, the manifest says {record.stored_size} (at {where})"
                    )
        return problems, list(missing)

    def verify_fully(self, item: Found, on_bytes: Callable[[int], None] | None = None) -> None:
        """Check every digest of ``item`` and record its problems (none means verified).

        A tier whose location holds nothing of the checkpoint (moved, unmounted, another
        bucket) is one problem naming the tier and how to remap it, not one per file; the
        other tiers are still checked."""
        if item.manifest is None or item.full or len(item.problems) > len(item.missing_tiers):
            return
        remapped = self.tiers_remapped(item.manifest)
        location = CheckpointLocation(self.store, item.name)
        try:
            resolver = FileResolver(
                location, item.manifest, tier_locations=remapped, storage_options=self.storage_options
            )
            missing = missing_tiers(resolver, item.manifest)
        except StorageError:
            raise
        except ShardkeepError as exc:
            item.problems.append(str(exc))
            item.full = True
            return
        reachable = None
        if missing:
            # The quick check may have found them already: one problem per tier.
            item.problems.extend(
                missing_tier_problem(tier, where, self.remap_hint, tier in remapped)
                for tier, where in missing.items()
                if tier not in item.missing_tiers
            )
            item.missing_tiers.extend(tier for tier in missing if tier not in item.missing_tiers)
            reachable = sorted({record.tier for record in item.manifest.files} - set(missing))
        report = verify(
            item.name,
            storage=self.store,
            limits=self.limits,
            on_bytes=on_bytes,
            tiers=reachable,
            tier_locations=remapped,
            storage_options=self.storage_options,
            public_key=self.signatures.public_key,
            require_signature=self.signatures.required,
        )
        item.problems.extend(report.problems)
        item.full = True

    def tiers_remapped(self, manifest: Manifest) -> dict[str, str]:
        """This root's ``tier_locations`` for the tiers that ``manifest`` defines."""
        defined = {tier.name for tier in manifest.tiers}
        return {tier: place for tier, place in self.tier_locations.items() if tier in defined}

    # -- ownership --------------------------------------------------------------------------
    @staticmethod
    def owner(found: list[Found]) -> str | None:
        """The run that owns the root: that of the newest checkpoint recording a run id (a
        misnamed checkpoint's name proves nothing, so it never decides)."""
        for item in reversed(found):
            if item.manifest is not None and item.manifest.run is not None and not item.misnamed:
                return item.manifest.run.run_id
        return None

    @staticmethod
    def run_of(item: Found) -> str | None:
        return item.manifest.run.run_id if item.manifest is not None and item.manifest.run is not None else None

    @staticmethod
    def recorded_policy(found: list[Found], run_id: str | None = None) -> RetentionPolicy | None:
        """The retention policy recorded by the newest checkpoint (of ``run_id`` if given)."""
        record = CheckpointRoot.policy_record(found, run_id)
        return record[0] if record is not None else None

    @staticmethod
    def policy_record(found: list[Found], run_id: str | None = None) -> tuple[RetentionPolicy, str] | None:
        """The retention policy recorded by the newest checkpoint (of ``run_id`` if given), and
        that checkpoint's name; misnamed checkpoints are passed over."""
        for item in reversed(found):
            run = item.manifest.run if item.manifest is not None and not item.misnamed else None
            if run is None or run.retention is None or (run_id is not None and run.run_id != run_id):
                continue
            record = run.retention
            policy = RetentionPolicy(
                keep_last=record.keep_last, keep_best=record.keep_best, metric=record.metric, mode=record.mode
            )
            return policy, item.name
        return None

    # -- deciding ---------------------------------------------------------------------------
    def decide(
        self,
        found: list[Found],
        policy: RetentionPolicy,
        run_id: str | None,
        *,
        verify_newest: bool = True,
    ) -> tuple[list[CheckpointEntry], RetentionDecision]:
        """Entries for every checkpoint in ``found`` and the retention decision over those of
        ``run_id`` (every readable one when ``run_id`` is ``None``).

        With ``verify_newest``, the run's checkpoints are verified fully, newest first, until
        one passes: that one is the newest verified checkpoint, which is never deleted.
        Misnamed checkpoints take no part in the decision: never kept as last, best or newest,
        and never deleted (their name does not say which step they are).
        """
        mine = [
            item
            for item in found
            if item.manifest is not None and not item.misnamed and (run_id is None or self.run_of(item) == run_id)
        ]
        if verify_newest:
            for item in reversed(mine):
                if item.missing_tiers:
                    continue  # unknown whatever the rest holds: never the newest verified
                self.verify_fully(item)
                if not item.problems:
                    break
        infos = [
            CheckpointInfo(
                name=item.name,
                step=item.step,
                metric=_metric(item.manifest, policy.metric),
                # A tier that cannot be seen proves nothing either way: unknown, never deleted.
                verified=None if item.missing_tiers else not item.problems,
                created=item.manifest.created_at.timestamp() if item.manifest is not None else None,
            )
            for item in mine
        ]
        decision = decide(infos, policy)
        last, best = set(decision.last), set(decision.best)
        entries = [
            self._entry(
                item,
                policy.metric,
                is_last=item.name in last,
                is_best=item.name in best,
                is_newest=item.name == decision.newest_verified,
            )
            for item in found
        ]
        return entries, decision

    def _entry(self, item: Found, metric: str, *, is_last: bool, is_best: bool, is_newest: bool) -> CheckpointEntry:
        manifest = item.manifest
        verified: bool | None = False if item.problems else (True if item.full else None)
        return CheckpointEntry(
            name=item.name,
            path=self.path_of(item.name),
            step=item.step,
            metric=_metric(manifest, metric),
            metrics=dict(manifest.metrics) if manifest is not None else {},
            is_last=is_last,
            is_best=is_best,
            is_newest=is_newest,
            verified=verified,
            problems=tuple(item.problems),
            size=stored_bytes(manifest) if manifest is not None else 0,
            run_id=self.run_of(item),
            created_at=manifest.created_at if manifest is not None else None,
            misnamed=item.misnamed,
            missing_tiers=tuple(item.missing_tiers),
            manifest=manifest,
        )

    # -- changing storage (coordinator only) -----------------------------------------------------
    def manifests(self) -> tuple[list[tuple[str, Manifest]], list[str]]:
        """Every readable manifest in the root, under any directory name (not only
        ``step_<N>``), and the names whose manifest exists but cannot be read."""
        readable: list[tuple[str, Manifest]] = []
        unreadable: list[str] = []
        for name, info in self.store.list_dir(""):
            if info.kind != "dir" or is_staging_name(name):
                continue
            location = CheckpointLocation(self.store, name)
            try:
                data = read_manifest_bytes(location, self.limits)
            except CheckpointNotFoundError:
                continue
            try:
                readable.append((name, parse_manifest(data, where=self.path_of(name), limits=self.limits)))
            except StorageError:
                raise
            except ShardkeepError:
                unreadable.append(name)
        return readable, unreadable

    def delete(self, name: str, known: tuple[list[tuple[str, Manifest]], list[str]] | None = None) -> None:
        """Un-commit checkpoint ``name``, then remove every file of it that no other manifest
        in the root lists (reference counting from the manifests alone).

        Without references into it, on a filesystem: a no-replace rename to
        ``<name>.deleting-<uuid>`` (durable), then removal. Otherwise a ``_retained`` marker is
        written, the manifest removed (the commit point, undone), and the unlisted files removed
        one by one: in its directory, in its tiers' locations, and those it referenced in
        earlier checkpoints that were deleted before (``_retained``, no manifest). While any
        manifest in the root cannot be read, its references are unknown: the checkpoint is
        un-committed and its files are all kept. ``known`` is :meth:`manifests` when the caller
        has just read it.
        """
        readable, unreadable = known if known is not None else self.manifests()
        manifest = next((m for other, m in readable if other == name), None)
        unreadable = list(unreadable)
        if manifest is not None:
            try:
                manifest = self._expanded(name, manifest)  # every file of it (format 2.x: in its indexes)
            except StorageError:
                raise
            except ShardkeepError as exc:
                logger.warning(
                    "deleting %s: its rank indexes cannot be read (%s); only the files its manifest lists are known",
                    self.path_of(name),
                    exc,
                )
        remaining: list[tuple[str, Manifest]] = []
        for other, kept in readable:
            if other == name:
                continue
            try:
                remaining.append((other, self._with_refs(other, kept)))
            except StorageError:
                raise
            except ShardkeepError:
                unreadable.append(other)  # its references into this checkpoint are unknown: keep its files
        listed: set[tuple[str | None, str, str]] = set()
        for other, kept in remaining:
            locations = {tier.name: tier.location for tier in kept.tiers}
            for record in kept.files:
                listed.add((locations.get(record.tier), record.ref or other, record.path))
        keep_everything = bool([other for other in unreadable if other != name]) or manifest is None
        if keep_everything:
            logger.warning(
                "deleting %s keeps its files: %s",
                self.path_of(name),
                "its manifest is missing"
                if manifest is None
                else f"manifest(s) of {sorted(unreadable)} cannot be read, so their references are unknown",
            )
        own_listed = keep_everything or any(key[1] == name for key in listed)
        doomed: list[tuple[str | None, str, str]] = []
        if manifest is not None and not keep_everything:
            locations = {tier.name: tier.location for tier in manifest.tiers}
            for record in manifest.files:
                key = (locations.get(record.tier), record.ref or name, record.path)
                if key in listed:
                    continue
                owner = key[1]
                if owner != name and not self._retired(owner):
                    continue  # another checkpoint's own file (live, unreadable, or not ours to judge)
                doomed.append(key)
        if renames(self.store) and not own_listed:
            moved = sibling_name(name, DELETING_MARKER, uuid.uuid4().hex)
            self.store.rename(name, moved)
            self._remove_files([key for key in doomed if not (key[0] is None and key[1] == name)])
            self.store.remove_tree(moved)
            return
        if own_listed and self.store.stat(f"{name}/{RETAINED_MARKER}") is None:
            self.store.put_atomic(f"{name}/{RETAINED_MARKER}", b"files here are referenced by other checkpoints\n")
        # The commit point next: without its manifest, nothing reads it as a checkpoint.
        manifest_path = f"{name}/{MANIFEST_FILENAME}"
        self.store.remove_file(manifest_path)
        if self.store.stat(manifest_path) is not None:
            raise StorageError(f"removing {self.path_of(manifest_path)} did not take effect; nothing else was deleted")
        self.store.remove_tree(f"{name}/{SIGNATURE_FILENAME}")
        if renames(self.store):
            self.store.sync_dir(name)
        self._remove_files(doomed)
        if not own_listed:
            self.store.remove_tree(name)

    def _retired(self, owner: str) -> bool:
        """Whether ``owner`` is a checkpoint that retention deleted earlier and that only holds
        files kept for others: no manifest, and the ``_retained`` marker."""
        return (
            self.store.stat(f"{owner}/{MANIFEST_FILENAME}") is None
            and self.store.stat(f"{owner}/{RETAINED_MARKER}") is not None
        )

    def _remove_files(self, files: list[tuple[str | None, str, str]]) -> None:
        """Remove (tier location, owner, path) files, then their owners' empty directories."""
        owners: set[tuple[str | None, str]] = set()
        for location, owner, path in files:
            self.tier_store(location).remove_tree(f"{owner}/{path}")
            owners.add((location, owner))
        for location, owner in owners:
            store = self.tier_store(location)
            try:
                left = [relative for relative, _ in store.list_files(owner) if relative != RETAINED_MARKER]
            except CheckpointNotFoundError:
                continue
            if not left and (location is not None or store.stat(f"{owner}/{MANIFEST_FILENAME}") is None):
                store.remove_tree(owner)

    def apply(self, decision: RetentionDecision, found: list[Found] | None = None) -> list[str]:
        """Delete what ``decision`` says, oldest first; return the names deleted. Files that a
        remaining checkpoint references are kept (the manifests are read once; a checkpoint
        deleted later in the pass still protects what it references until then)."""
        deleted: list[str] = []
        readable, unreadable = self.manifests() if decision.delete else ([], [])
        for name in sorted(decision.delete):
            self.delete(name, (readable, unreadable))
            readable = [(other, manifest) for other, manifest in readable if other != name]
            deleted.append(name)
            logger.info("retention deleted checkpoint %s", self.path_of(name))
        return deleted

    def write_pointers(self, entries: list[CheckpointEntry], decision: RetentionDecision, metric: str) -> None:
        """Point ``last`` at the newest verified checkpoint and ``best`` at the best one; remove
        a pointer that has nothing to name."""
        by_name = {entry.name: entry for entry in entries}
        newest = by_name.get(decision.newest_verified or "")
        best = by_name.get(decision.best[0]) if decision.best else None
        for pointer, entry in (("last", newest), ("best", best)):
            if entry is None:
                self.store.remove_tree(pointer)
                continue
            body = {
                "checkpoint": entry.name,
                "step": entry.step,
                "run_id": entry.run_id,
                "metric": metric,
                "value": entry.metric,
                "updated_at": _dt.datetime.now(_dt.UTC).isoformat(),
            }
            self.store.put_atomic(pointer, (json.dumps(body, indent=1) + "\n").encode())

    def read_pointer(self, pointer: str) -> dict[str, Any] | None:
        """A pointer file's contents, or ``None`` if it is absent or unreadable (it is a hint)."""
        info = self.store.stat(pointer)
        if info is None or info.kind != "file" or info.size > 65536:
            return None
        handle = self.store.open_read(pointer)
        try:
            buffer = bytearray(handle.size)
            handle.read_into(0, memoryview(buffer))
        finally:
            handle.close()
        try:
            body = json.loads(buffer)
        except (ValueError, RecursionError):
            return None
        return body if isinstance(body, dict) else None

    def collect_leftovers(self, *, lease: float = DEFAULT_LEASE, now: float | None = None) -> list[str]:
        """Remove ``.deleting-`` directories, and staging leftovers (``.tmp-``) in which nothing
        changed for ``lease`` seconds; on object stores and tier locations, ``attempt-<id>/``
        prefixes that no manifest uses and unfinished multipart uploads, after the same lease.
        Never follows symlinks. Returns the names removed."""
        now = time.time() if now is None else now
        removed: list[str] = []
        tier_stores: list[tuple[str, ByteStore]] | None = None
        for name, info in self.store.list_dir(""):
            if is_derived_name(name, DELETING_MARKER):
                self.store.remove_tree(name)
            elif is_derived_name(name, STAGING_MARKER):
                if not self._idle(self.store, name, info.mtime, info.kind, lease, now):
                    continue
                # The staging directory is the only record of the attempt id that names the
                # attempt's files in tier locations: those go first, and it goes only once
                # they are gone.
                if tier_stores is None:
                    tier_stores = self._tier_stores_to_clean()
                attempt = name.rpartition(STAGING_MARKER)[2]
                collected = self._remove_tier_attempt(tier_stores, name, f"{ATTEMPT_PREFIX}{attempt[:16]}", lease, now)
                if collected is None:
                    continue
                removed.extend(collected)
                self.store.remove_tree(name)
            else:
                continue
            removed.append(name)
            logger.info("removed leftover %s", self.path_of(name))
        if renames(self.store):
            return removed  # a filesystem root stages with renames: no attempt prefixes there
        # An object-store root: attempt prefixes that no manifest uses, and unfinished uploads.
        # Tier locations are left alone: other roots may share them, and their manifests are
        # not visible from here.
        readable, unreadable = self.manifests()
        used: dict[str, set[str]] = {}
        for owner_name, manifest in readable:
            manifest = self._with_refs(owner_name, manifest)  # its indexes' references into other attempts
            locations = {tier.name: tier.location for tier in manifest.tiers}
            for record in manifest.files:
                if locations.get(record.tier) is None:
                    used.setdefault(record.ref or owner_name, set()).add(record.path.partition("/")[0])
            for path in index_paths(manifest):  # format 2.x: the rank indexes sit in the attempt too
                used.setdefault(owner_name, set()).add(path.partition("/")[0])
        for name, info in self.store.list_dir(""):
            if step_of_name(name) is None or info.kind != "dir" or name in unreadable:
                continue  # an unreadable manifest's attempts may be committed data: never touched
            try:
                attempts = self.store.list_dir(name)
            except ShardkeepError:
                continue
            for attempt, attempt_info in attempts:
                if not attempt.startswith(ATTEMPT_PREFIX) or attempt in used.get(name, set()):
                    continue
                if not self._idle(self.store, f"{name}/{attempt}", attempt_info.mtime, attempt_info.kind, lease, now):
                    continue
                self.store.remove_tree(f"{name}/{attempt}")
                removed.append(f"{name}/{attempt}")
                logger.info("removed leftover %s", self.path_of(f"{name}/{attempt}"))
        for key in self.store.abort_uploads("", older_than=lease):
            removed.append(f"upload:{key}")
            logger.info("aborted unfinished upload %s", key)
        return removed

    def _tier_stores_to_clean(self) -> list[tuple[str, ByteStore]]:
        """The tier locations where a crashed save of this root may have left files: those this
        root's manifests define, ``tier_locations`` remaps to, and ``tier_homes`` (the ones the
        manager saves to, which a crashed first save may be the only user of)."""
        readable, _ = self.manifests()
        locations = {tier.location for _, manifest in readable for tier in manifest.tiers if tier.location}
        locations.update(place for place in self.tier_locations.values() if isinstance(place, str))
        locations.update(self.tier_homes)
        stores: list[tuple[str, ByteStore]] = []
        for location in sorted(locations):
            try:
                stores.append((location, self.tier_store(location)))
            except ShardkeepError as exc:
                logger.warning("leftovers in tier location %s not collected: %s", location, exc)
        return stores

    def _remove_tier_attempt(
        self, stores: list[tuple[str, ByteStore]], staging: str, attempt: str, lease: float, now: float
    ) -> list[str] | None:
        """Remove ``<final>/<attempt>/`` (the files one abandoned save attempt wrote) from each
        tier location, ``final`` being the name the staging directory ``staging`` belongs to.
        That prefix belongs to the attempt alone, so this never touches another save's data,
        even in a location other roots share. Returns what was removed, or None when something
        there changed within the lease or a location failed (the staging directory then stays,
        so that a later collection can finish)."""
        found: list[tuple[str, ByteStore, str]] = []
        try:
            for location, store in stores:
                for final in self._finals_of(store, staging):
                    prefix = f"{final}/{attempt}"
                    info = store.stat(prefix)
                    if info is None:
                        continue
                    if not self._idle(store, prefix, info.mtime, info.kind, lease, now):
                        return None  # the save may still be writing there
                    found.append((location, store, prefix))
            removed: list[str] = []
            for location, store, prefix in found:
                store.remove_tree(prefix)
                removed.append(f"{location.rstrip('/')}/{prefix}")
                logger.info("removed leftover %s/%s", location.rstrip("/"), prefix)
        except ShardkeepError as exc:  # an unreachable tier location: everything stays for a later collection
            logger.warning("leftovers of %s in tier locations not collected: %s", staging, exc)
            return None
        return removed

    @staticmethod
    def _finals_of(store: ByteStore, staging: str) -> list[str]:
        """The names in ``store`` whose staging directory ``staging`` can be. The name before
        the marker is one; a long name was shortened with its digest (see
        :mod:`shardkeep.names`) and is found among the store's top-level names."""
        literal = staging.rpartition(STAGING_MARKER)[0]
        if not is_shortened(literal) or store.stat(literal) is not None:
            return [literal]
        try:
            listing = store.list_dir("")
        except CheckpointNotFoundError:
            return []  # no tier directory: nothing of the attempt there
        return [name for name, _ in listing if is_sibling_of(staging, name, STAGING_MARKER)]

    def leftovers(self, *, now: float | None = None) -> list[tuple[str, float | None]]:
        """The root's staging and being-deleted names (of the shapes :meth:`collect_leftovers`
        removes), each with the seconds since anything in it changed (``None`` for a
        being-deleted name, removed whatever its age, or one that cannot be read)."""
        now = time.time() if now is None else now
        found: list[tuple[str, float | None]] = []
        for name, info in self.store.list_dir(""):
            if is_derived_name(name, DELETING_MARKER):
                found.append((name, None))
            elif is_derived_name(name, STAGING_MARKER):
                newest = self._newest_change(self.store, name, info.mtime, info.kind)
                found.append((name, None if newest is None else now - newest))
        return found

    @staticmethod
    def _newest_change(store: ByteStore, name: str, mtime: float, kind: str) -> float | None:
        """When anything below ``name`` last changed (``None``: vanished or unreadable)."""
        if kind != "dir":
            return mtime
        try:
            return max([mtime, *(child.mtime for _, child in store.list_files(name))])
        except ShardkeepError:
            return None

    def _idle(self, store: ByteStore, name: str, mtime: float, kind: str, lease: float, now: float) -> bool:
        """Whether nothing below ``name`` changed for ``lease`` seconds."""
        newest = self._newest_change(store, name, mtime, kind)
        return newest is not None and now - newest >= lease  # unreadable: left for the next pass


def _metric(manifest: Manifest | None, metric: str) -> float | None:
    if manifest is None:
        return None
    value = manifest.metrics.get(metric)
    return None if value is None or not math.isfinite(value) else value
