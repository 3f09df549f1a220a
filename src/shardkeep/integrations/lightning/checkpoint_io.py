"""The Lightning ``CheckpointIO`` plugin: each checkpoint path Lightning asks for becomes a
shardkeep checkpoint directory, replaced atomically and recovered after a crash.

Each checkpoint path Lightning asks for (``.../epoch=1-step=8.ckpt``, ``.../last.ckpt``) becomes
a shardkeep checkpoint *directory* at that path: tensors in safetensors files, everything else in
the manifest (converted by :mod:`~shardkeep.integrations.lightning.values`), a digest on every
file, no pickle. Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0
only, so the plugin saves with ``process_group=shardkeep.LOCAL`` (no collective that the other
ranks would never join).

Saving over an existing checkpoint (``last.ckpt``, saved again at every epoch over the same
path) writes the new checkpoint under a hidden sibling name, then swaps the two directories
atomically with ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+; ext4, xfs, btrfs, tmpfs), then
renames the old one out of the way and removes it: at every moment ``path`` holds one complete
checkpoint, and nothing removed (an old checkpoint, a checkpoint Lightning removes) can come back
under its name after a crash (see :class:`ShardkeepCheckpointIO` for every crash point). Where
the exchange is not supported (another OS, or a filesystem that refuses it, such as some network
filesystems) it falls back to two renames, with a short window in which ``path`` does not
exist; the next save of the same path (or :meth:`ShardkeepCheckpointIO.clean_leftovers`) puts
the complete checkpoint back in place and removes the leftovers of an interrupted save. I/O
failures are raised as :class:`~shardkeep.errors.StorageError` naming the path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import shardkeep.api as api
from shardkeep.config import LOCAL, WriteOptions
from shardkeep.errors import (
    CheckpointNotFoundError,
    ConfigError,
    DependencyError,
    ShardkeepError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.integrations.lightning.values import apply_map_location, decode_checkpoint, encode_checkpoint
from shardkeep.manifest import Manifest, Tier
from shardkeep.names import (
    LIGHTNING_NEW_ROLE,
    LIGHTNING_OLD_ROLE,
    LIGHTNING_RETIRED_ROLE,
    LIGHTNING_TAG,
    MANIFEST_FILENAME,
    NAME_MAX,
    STAGING_MARKER,
    check_name_length,
    name_digest,
)
from shardkeep.options import LEGACY_KEYWORDS, Incremental, ManifestFields, TierPlan, regroup
from shardkeep.storage.localfs import current
from shardkeep.storage.locations import local_path
from shardkeep.verification import read_manifest

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ModuleNotFoundError as _missing_lightning:  # pragma: no cover - depends on the environment
    try:  # the standalone ``pytorch_lightning`` / ``lightning_fabric`` packages
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[assignment,unused-ignore]
    except ModuleNotFoundError:
        raise DependencyError(
            "shardkeep.lightning needs Lightning, which is not installed: pip install lightning"
        ) from _missing_lightning

if TYPE_CHECKING:
    from shardkeep.options import PublicKey, Signer

__all__ = ["ShardkeepCheckpointIO"]

Path_ = str | os.PathLike[str]

logger = logging.getLogger("shardkeep")


# --------------------------------------------------------------------------------------------
# Working names and their removal, built from the steps of the LocalFS in use
# (shardkeep.storage.localfs: crash tests substitute one whose step fails)
# --------------------------------------------------------------------------------------------


def _retire(parent: str, tag: str, entry: str) -> str:
    """Rename ``parent/entry`` to ``<tag>del-<id>`` (a name recovery never brings back) and return
    the new path; only then is it deleted, so a half-deleted tree always has such a name."""
    doomed = os.path.join(parent, f"{tag}{LIGHTNING_RETIRED_ROLE}{uuid.uuid4().hex}")
    return current().retire(os.path.join(parent, entry), aside=doomed, sync=False)  # the caller fsyncs


def _remove_trees(paths: list[str]) -> None:
    """Remove each path (a file, a symlink or a tree); one already gone is skipped."""
    fs = current()
    for path in paths:
        fs.remove_tree(path)


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST_FILENAME))


#: Hex digits of the id of a working name (``new-<id>``, ``old-<id>``, ``del-<id>``).
_ID_CHARS = 32
#: Hex digits of the id in the staging name shardkeep.save makes (``<name>.tmp-<id>``).
_STAGING_ID_CHARS = 32
#: The most bytes of a tag: a working name (``<tag>new-<id>``) and the staging directory
#: shardkeep.save makes of it (``<tag>new-<id>.tmp-<id>``) must fit in one path component, so
#: that no name derived from a working name is ever shortened (recovery finds them by the tag).
_TAG_MAX = NAME_MAX - len(LIGHTNING_NEW_ROLE) - _ID_CHARS - len(STAGING_MARKER) - _STAGING_ID_CHARS


def _tag(name: str) -> str:
    """The hidden prefix of ``name``'s sibling working names: ``.sk-<hex of the name>.``, or
    ``.sk-h<digest>.`` for a name whose hex does not fit in :data:`_TAG_MAX` bytes (more than
    88 bytes). Hex has no ``l``, ``s`` or ``t``, so Lightning's search for ``last*.ckpt`` never
    matches one."""
    encoded = name.encode("utf-8", "surrogateescape").hex()
    if len(f"{LIGHTNING_TAG}.") + len(encoded) > _TAG_MAX:
        encoded = "h" + name_digest(name, 40)
    return f"{LIGHTNING_TAG}{encoded}."


def _recorded_name(name: str) -> dict[str, str]:
    """What a working checkpoint records of the name it is saved for: recovery puts it back
    under that name when its tag is a digest (JSON holds only valid UTF-8)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return {}
    return {"name": name}


def _tag_of(entry: str) -> str | None:
    """The tag a hidden working name starts with, or None."""
    if not entry.startswith(LIGHTNING_TAG):
        return None
    encoded, found, _ = entry[len(LIGHTNING_TAG) :].partition(".")
    return f"{LIGHTNING_TAG}{encoded}." if found and encoded else None


def _name_of_tag(entry: str) -> str | None:
    """The name a hex tag spells (None for a digest tag, which cannot be told back)."""
    tag = _tag_of(entry)
    if tag is None or tag[len(LIGHTNING_TAG)] == "h":
        return None
    try:
        name = bytes.fromhex(tag[len(LIGHTNING_TAG) : -1]).decode("utf-8", "surrogateescape")
    except ValueError:
        return None
    return name if _tag(name) == tag else None


# --------------------------------------------------------------------------------------------
# The plugin
# --------------------------------------------------------------------------------------------


#: The keyword spellings of the previous release that ``ShardkeepCheckpointIO`` still accepts
#: (``save_options=`` is folded into them first).
_PLUGIN_LEGACY = tuple(name for name in LEGACY_KEYWORDS if name not in ("epoch", "storage_options"))


class ShardkeepCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that writes each checkpoint as a verified shardkeep directory.

    ``options``, ``tiers``, ``incremental``, ``fields`` and ``signer`` (the option groups of
    :func:`shardkeep.save`; the plugin sets the step, the epoch and its own custom field) apply
    to every save; ``public_key``, ``require_signature`` and ``mmap`` to every load (digests are always verified). Local paths
    only. See :mod:`~shardkeep.integrations.lightning.values` for the conversions and the module
    docstring for the atomic replacement.

    Working names beside a checkpoint ``X`` are hidden and tagged with ``X``'s name
    (``.sk-<hex>.``): ``new-<id>`` a save being written (``new-<id>.tmp-*`` until shardkeep
    commits it), ``old-<id>`` the previous checkpoint during a fallback swap, ``del-<id>`` anything
    being deleted. No directory is deleted under another name than ``del-``, and recovery never
    brings a ``del-`` entry back, so a half-deleted tree is never put in place. Recovery (the
    start of every save of ``X``, and :meth:`clean_leftovers`) deletes every leftover when ``X``
    exists; when ``X`` is missing it first puts back the last committed complete
    ``new-``/``old-`` checkpoint (by the manifest's ``created_at``).

    Where a crash (or kill) can stop a save of ``X`` over an existing checkpoint, and what the
    next save, removal or ``clean_leftovers`` of ``X`` finds:

    1. inside :func:`shardkeep.save`: ``X`` is the previous checkpoint; the uncommitted or
       committed ``new-`` staging is deleted.
    2. right after ``renameat2(RENAME_EXCHANGE)``: ``X`` is the new checkpoint and ``new-<id>``
       holds the *previous* one; it is deleted, never put back, because ``X`` exists (and a
       removal of ``X`` deletes the leftovers before ``X`` itself).
    3. after the exchanged-out side is renamed to ``del-`` (the next step, before its deletion
       starts): ``X`` is the new checkpoint; the ``del-`` tree is deleted.
    4. fallback, after ``X`` -> ``old-<id>``: nothing is at ``X``; ``old-`` (previous) and
       ``new-`` (the new one, committed) are both complete; the later committed (``new-``) is
       put back at ``X`` and the other deleted.
    5. fallback, after ``new-`` -> ``X``: ``X`` is the new checkpoint; ``old-`` is deleted
       (then as 3).

    A first save of ``X`` renames its committed ``new-`` with ``RENAME_NOREPLACE``; a crash
    before that leaves ``X`` missing and the ``new-`` entry, which recovery puts at ``X``.
    :meth:`remove_checkpoint` renames every leftover of ``X`` to ``del-``, then ``X`` itself,
    then fsyncs the directory and deletes them: after a crash anywhere in it, either ``X`` is
    still there whole or only ``del-`` entries are left, so a removed checkpoint never comes back.
    """

    def __init__(
        self,
        *,
        options: WriteOptions | None = None,
        tiers: TierPlan | Sequence[Tier] | None = None,
        incremental: Incremental | bool | str | os.PathLike[str] = False,
        fields: ManifestFields | None = None,
        signer: Signer | None = None,
        public_key: PublicKey | None = None,
        require_signature: bool | None = None,
        mmap: bool = False,
        **legacy: Any,
    ) -> None:
        super().__init__()
        hints = []
        if "save_options" in legacy:
            legacy = dict(legacy)
            mapping = dict(legacy.pop("save_options") or {})
            for reserved in ("process_group", "step", "epoch", "storage", "storage_options"):
                if reserved in mapping:
                    raise ConfigError(f"save_options={{{reserved!r}: ...}}: the plugin sets {reserved} itself")
            tiers = mapping.pop("tiers", tiers)
            incremental = mapping.pop("incremental", incremental)
            signer = mapping.pop("signer", signer)
            legacy.update(mapping)
            hints.append("save_options= is now options=, tiers=, incremental=, fields= and signer=")
        groups = regroup(
            "ShardkeepCheckpointIO",
            legacy,
            options=options,
            tiers=tiers,
            incremental=incremental,
            fields=fields,
            accepted=_PLUGIN_LEGACY,
            hints=hints,
        )
        if groups.options.storage_options is not None:
            raise ConfigError("options=WriteOptions(storage_options=...): the plugin saves to local paths only")
        self._fields = groups.fields
        self._save_arguments: dict[str, Any] = {
            "options": groups.options,
            "tiers": groups.tiers,
            "incremental": groups.incremental,
            "signer": signer,
        }
        self._public_key = public_key
        self._require_signature = require_signature
        self._mmap = mmap
        self.last_manifest: Manifest | None = None

    # -- Lightning's interface ---------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Path_, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` as a shardkeep checkpoint directory at ``path``, replacing a
        checkpoint already there atomically (see the class docstring for every crash point)."""
        if storage_options is not None:
            raise ConfigError(
                f"ShardkeepCheckpointIO.save_checkpoint(..., storage_options={storage_options!r}): per-call options "
                "are not supported; pass shardkeep.save options to ShardkeepCheckpointIO(...)"
            )
        target = _local_path(path)
        state = encode_checkpoint(checkpoint)
        parent, name = os.path.split(target)
        check_name_length(name, "checkpoint name")
        try:
            current().makedirs_durable(parent)
        except OSError as exc:
            raise StorageError(f"cannot create the directory {parent} to save the checkpoint {target}: {exc}") from exc
        if not os.path.islink(target) and os.path.isdir(target) and not _is_checkpoint_dir(target):
            raise UnsupportedValueError(
                f"{target} is a directory that is not a shardkeep checkpoint (no manifest.json); "
                "ShardkeepCheckpointIO does not replace it"
            )
        try:
            self._recover(parent, name)
        except OSError as exc:
            raise StorageError(f"cannot repair what an interrupted save left beside {target}: {exc}") from exc
        staging = os.path.join(parent, f"{_tag(name)}{LIGHTNING_NEW_ROLE}{uuid.uuid4().hex}")
        step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
        try:
            self.last_manifest = api.save(
                state,
                staging,
                process_group=LOCAL,
                step=step if type(step) is int and step >= 0 else None,
                fields=dataclasses.replace(
                    self._fields,
                    epoch=epoch if type(epoch) is int and epoch >= 0 else None,
                    custom_fields={
                        **(self._fields.custom_fields or {}),
                        "lightning": {
                            "version": str(checkpoint.get("pytorch-lightning_version", "")),
                            "checkpoint_io": "shardkeep.lightning.ShardkeepCheckpointIO",
                            **_recorded_name(name),
                        },
                    },
                ),
                **self._save_arguments,
            )
        except BaseException:
            try:
                self._remove_leftovers(parent, name)
            except OSError:
                pass  # the original error matters; the next save of this path removes the rest
            raise
        try:
            old = self._install(staging, target)
        except OSError as exc:
            try:
                self._recover(parent, name)  # the complete checkpoint back at ``target``, no leftovers
            except OSError:
                pass
            raise StorageError(f"cannot put the new checkpoint in place at {target}: {exc}") from exc
        if old is not None:
            try:
                _remove_trees([old])
            except OSError as exc:
                raise StorageError(
                    f"the new checkpoint is in place at {target}, but deleting the previous one ({old}) failed: "
                    f"{exc}; the next save of this path, or clean_leftovers, removes it"
                ) from exc

    def load_checkpoint(
        self, path: Path_, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load and verify the checkpoint at ``path`` and return Lightning's checkpoint dict.
        ``weights_only`` is accepted for the interface: nothing is ever unpickled."""
        target = _local_path(path)
        if not os.path.lexists(target):
            parent, name = os.path.split(target)
            try:
                found = self._leftovers(parent, name)
            except OSError:
                found = []  # only a hint
            hint = (
                f"; an interrupted save left {sorted(found)} beside it: the next save of this path, or "
                "ShardkeepCheckpointIO.clean_leftovers(directory), puts the complete checkpoint back"
                if found
                else ""
            )
            raise CheckpointNotFoundError(f"no checkpoint at {target}{hint}")
        if os.path.islink(target):
            target = _followed_link(target)
        if not os.path.isdir(target):
            raise UnsupportedValueError(
                f"{target} is a file, not a shardkeep checkpoint directory (a torch.save checkpoint?); "
                "ShardkeepCheckpointIO never unpickles: convert it with `shardkeep import` first"
            )
        state = api.load(
            target,
            verify=True,
            mmap=self._mmap,
            public_key=self._public_key,
            require_signature=self._require_signature,
        )
        checkpoint = decode_checkpoint(state, target)
        mapped: dict[str, Any] = apply_map_location(checkpoint, map_location)
        return mapped

    def remove_checkpoint(self, path: Path_) -> None:
        """Remove the checkpoint at ``path``: a shardkeep checkpoint directory (renamed out of
        the way first, so it disappears at once) or a single file, with every leftover of an
        interrupted save of that name. A path that does not exist is not an error (as with
        Lightning's own ``CheckpointIO``). Any other directory is refused."""
        target = _local_path(path)
        parent, name = os.path.split(target)
        if not os.path.lexists(target):
            kind = "missing"
        elif os.path.islink(target) or os.path.isfile(target):
            kind = "file"
        elif _is_checkpoint_dir(target):
            kind = "checkpoint"
        elif os.path.isdir(target):
            raise UnsupportedValueError(
                f"{target} is a directory that is not a shardkeep checkpoint (no manifest.json); not removed"
            )
        else:
            raise UnsupportedValueError(f"{target} is not a regular file or a checkpoint directory; not removed")
        try:
            # The leftovers first: once ``target`` is gone, nothing that recovery could bring back
            # under its name may remain (a stale exchanged-out side, a fallback swap's halves).
            doomed = self._retire_leftovers(parent, name)
            if kind == "file":
                os.remove(target)
            elif kind == "checkpoint":
                doomed.append(_retire(parent, _tag(name), name))
            if doomed:
                current().fsync_directory(parent)
            _remove_trees(doomed)
        except OSError as exc:
            gone = "" if os.path.lexists(target) else f" ({target} itself is already gone)"
            raise StorageError(
                f"cannot remove the checkpoint {target}: {exc}{gone}; the hidden .sk-* entries left beside it are "
                "removed by the next save of this path or by clean_leftovers"
            ) from exc

    def teardown(self) -> None:
        """Nothing to release: every save finishes before ``save_checkpoint`` returns."""

    # -- leftovers and the swap ----------------------------------------------------------------
    # These raise OSError; the public methods turn it into StorageError naming the path.

    @staticmethod
    def _leftovers(parent: str, name: str) -> list[str]:
        prefix = _tag(name)
        try:
            entries = os.listdir(parent)
        except (FileNotFoundError, NotADirectoryError):
            return []  # no directory, so nothing left in it
        return [entry for entry in entries if entry.startswith(prefix)]

    def _retire_leftovers(self, parent: str, name: str, keep: str | None = None) -> list[str]:
        """Rename every leftover of ``name`` (but ``keep``) to a ``del-`` name; return the paths to
        delete (the caller fsyncs ``parent`` first, so that no rename is lost after a deletion)."""
        prefix = _tag(name)
        doomed: list[str] = []
        for entry in self._leftovers(parent, name):
            if entry == keep:
                continue
            if entry[len(prefix) :].startswith(LIGHTNING_RETIRED_ROLE):
                doomed.append(os.path.join(parent, entry))
                continue
            try:
                doomed.append(_retire(parent, prefix, entry))
            except FileNotFoundError:
                pass
        return doomed

    def _remove_leftovers(self, parent: str, name: str) -> None:
        doomed = self._retire_leftovers(parent, name)
        if doomed:
            current().fsync_directory(parent)
        _remove_trees(doomed)

    @staticmethod
    def _newest_complete(parent: str, name: str, entries: list[str]) -> str | None:
        """The leftover to put back at ``name`` when nothing is there: among the complete
        checkpoints named ``new-``/``old-`` (never ``del-``, never an uncommitted ``.tmp-``), the
        last committed (the manifest's ``created_at``; not ``step``, which a run resumed from an
        earlier checkpoint lowers); ``new-`` wins a tie, and one whose manifest cannot be read
        comes last but is still put back rather than lost."""
        prefix = _tag(name)
        best: tuple[bool, float, bool] | None = None
        chosen: str | None = None
        for entry in entries:
            role = entry[len(prefix) :]
            if not role.startswith((LIGHTNING_NEW_ROLE, LIGHTNING_OLD_ROLE)) or STAGING_MARKER in role:
                continue
            candidate = os.path.join(parent, entry)
            if not _is_checkpoint_dir(candidate):
                continue
            try:
                rank = (True, read_manifest(candidate).created_at.timestamp())
            except ShardkeepError:
                rank = (False, 0.0)
            key = (*rank, role.startswith(LIGHTNING_NEW_ROLE))
            if best is None or key > best:
                best, chosen = key, entry
        return chosen

    def _recover(self, parent: str, name: str) -> None:
        """Finish or undo what an interrupted save or removal of ``parent/name`` left: if
        ``name`` is gone, the newest complete checkpoint among its leftovers takes its place (see
        :meth:`_newest_complete`); every other leftover is renamed to ``del-`` and deleted."""
        target = os.path.join(parent, name)
        entries = self._leftovers(parent, name)
        if not entries:
            return
        if not os.path.lexists(target):
            chosen = self._newest_complete(parent, name, entries)
            if chosen is not None:
                current().rename_noreplace(os.path.join(parent, chosen), target)
                current().fsync_directory(parent)
        self._remove_leftovers(parent, name)

    def _install(self, staging: str, target: str) -> str | None:
        """Put the committed ``staging`` at ``target``; return the ``del-`` path of the previous
        checkpoint, for the caller to delete, or None when there was none. Unlike
        :meth:`~shardkeep.storage.localfs.LocalFS.replace_dir`, a failed fallback swap is not
        undone: recovery puts the later committed checkpoint (the new one) at ``target``."""
        parent, name = os.path.split(target)
        aside = os.path.join(parent, f"{_tag(name)}{LIGHTNING_OLD_ROLE}{uuid.uuid4().hex}")
        # Where the exchange is not supported it is two renames: between them nothing is at
        # ``target``, and a crash there is repaired by the next save of this path (see _recover).
        old = current().replace_dir(staging, target, aside=aside, restore=False)
        if old is None:
            return None
        # At once out of the names recovery considers: after an exchange ``staging`` (a "new-"
        # name) holds the *previous* checkpoint.
        doomed = _retire(parent, _tag(name), os.path.basename(old))
        current().fsync_directory(parent)
        return doomed

    @classmethod
    def clean_leftovers(cls, directory: Path_) -> list[str]:
        """Repair and remove what interrupted saves left in ``directory`` (hidden ``.sk-*``
        entries); returns the names handled. Call it only while no save is running there."""
        parent = _local_path(directory)
        try:
            listing = os.listdir(parent)
        except OSError as exc:
            raise StorageError(f"cannot list {parent} for the leftovers of interrupted saves: {exc}") from exc
        handled: list[str] = []
        tags = {tag for tag in map(_tag_of, listing) if tag is not None}
        # The checkpoints still in place tell the names of digest tags.
        names = {_tag(entry): entry for entry in listing if _tag_of(entry) is None and _tag(entry) in tags}
        plugin = cls()
        for tag in sorted(tags):
            name = _name_of_tag(tag) or names.get(tag) or cls._name_recorded_in(parent, tag, listing)
            try:
                if name is None:
                    handled.extend(cls._remove_unnamed(parent, tag, listing))
                    continue
                handled.extend(plugin._leftovers(parent, name))
                plugin._recover(parent, name)
            except OSError as exc:
                where = os.path.join(parent, name or tag)
                raise StorageError(f"cannot repair the leftovers of {where}: {exc}") from exc
        return sorted(handled)

    @staticmethod
    def _name_recorded_in(parent: str, tag: str, listing: list[str]) -> str | None:
        """The name a complete working checkpoint tagged ``tag`` records (see
        :func:`_recorded_name`), when it is one whose tag that is."""
        for entry in sorted(listing):
            role = entry[len(tag) :]
            if (
                not entry.startswith(tag)
                or not role.startswith((LIGHTNING_NEW_ROLE, LIGHTNING_OLD_ROLE))
                or STAGING_MARKER in role
            ):
                continue
            candidate = os.path.join(parent, entry)
            if not _is_checkpoint_dir(candidate):
                continue
            try:
                recorded = read_manifest(candidate).custom_fields.get("lightning", {}).get("name")
            except (ShardkeepError, AttributeError):
                continue
            if isinstance(recorded, str) and os.sep not in recorded and _tag(recorded) == tag:
                return recorded
        return None

    @staticmethod
    def _remove_unnamed(parent: str, tag: str, listing: list[str]) -> list[str]:
        """The leftovers of a name that neither its tag nor any complete checkpoint tells: those
        being deleted and uncommitted staging are removed; a complete checkpoint (which recovery
        could not place) is kept, with a warning."""
        handled: list[str] = []
        doomed: list[str] = []
        for entry in listing:
            role = entry[len(tag) :]
            if not entry.startswith(tag):
                continue
            if role.startswith(LIGHTNING_RETIRED_ROLE):
                doomed.append(os.path.join(parent, entry))
            elif STAGING_MARKER in role or not _is_checkpoint_dir(os.path.join(parent, entry)):
                doomed.append(_retire(parent, tag, entry))
            else:
                logger.warning(
                    "%s: an interrupted save left this complete checkpoint, and its name is unknown: kept",
                    os.path.join(parent, entry),
                )
                continue
            handled.append(entry)
        if doomed:
            current().fsync_directory(parent)
        _remove_trees(doomed)
        return handled


def _followed_link(link: str) -> str:
    """What ``ModelCheckpoint(save_last="link")`` made ``link`` point to: a relative symlink to
    a checkpoint in the same directory. Other symlinks are refused, as shardkeep refuses them."""
    destination = os.readlink(link)
    parent = os.path.dirname(link)
    resolved = os.path.join(parent, destination)
    if os.path.isabs(destination) or os.sep in destination or os.path.islink(resolved) or destination in (".", ".."):
        raise UnsafePathError(
            f"{link} is a symlink to {destination!r}; ShardkeepCheckpointIO follows only a relative link to a "
            "checkpoint in the same directory (what save_last='link' makes)"
        )
    return resolved


def _local_path(path: Path_) -> str:
    """The absolute local path ``path`` names (a path, or ``file://PATH``: see
    :mod:`shardkeep.storage.locations`); a store URL is refused."""
    try:
        text = os.fspath(path)
    except TypeError as exc:
        raise UnsupportedValueError(f"checkpoint path {path!r} is not a path: {exc}") from exc
    if not isinstance(text, str) or "\x00" in text:
        raise UnsupportedValueError(f"checkpoint path {path!r} must be text without NUL characters")
    local = local_path(text)
    if local is None:
        raise UnsupportedValueError(
            f"{text}: ShardkeepCheckpointIO writes local paths only (its atomic replacement needs a rename); "
            "for object stores use shardkeep.save with an s3:// path directly"
        )
    return local
