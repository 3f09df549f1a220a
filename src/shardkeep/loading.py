"""A load job: which files and entries a rank needs (and which box of each), reading and
checking them, assembling tensors and resharded regions, placeholders for what a partial load
leaves out, and the fill.

A file of which a rank needs only a part (a resharding load, ``extra="ignore"``, sections) is
read by range (:func:`shardkeep.reads.read_needs`): only the digest blocks that hold the
needed boxes, each checked once, and whole entries where an entry has no blocks but a digest
of its own (format 2.0 chunks). A file it needs (almost) all of, or whose entries only the
file's digest covers, is read and checked whole (:func:`shardkeep.io.check_shard`). The choice
is made per file and entry, never per checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardkeep.config import LoadOptions, ManifestLimits
from shardkeep.errors import (
    IntegrityError,
    ShardkeepError,
    UnsupportedValueError,
)
from shardkeep.fill import fill_into
from shardkeep.indexes import expand, needed_ranks
from shardkeep.io import DigestChoice, check_shard
from shardkeep.manifest import (
    IndexedManifest,
    Manifest,
    ShardedTensor,
    TensorEntry,
)
from shardkeep.progress import collector_paused, progress_bar
from shardkeep.reads import Need, Piece, read_needs
from shardkeep.tensors.convert import (
    array_from_buffer,
)
from shardkeep.tensors.flatten import rebuild_state
from shardkeep.tensors.keys import section_of
from shardkeep.tensors.regions import (
    Box,
    Region,
    assemble,
    chunk_part,
    needed_box,
    needed_entries,
    rows_part,
    wanted_regions,
)
from shardkeep.tensors.shardfile import STALE
from shardkeep.tensors.targets import TargetResolver
from shardkeep.verification import (
    CheckpointLocation,
    FileResolver,
    TierLocations,
    file_set_problems,
    select_files,
)

__all__ = ["LoadJob"]


class LoadJob:
    """One load of one checkpoint whose manifest was read and checked, in visible phases:

    1. :meth:`select`: which files, and which entries of each, this rank needs (the tiers and
       sections asked for, and only the chunks that overlap the regions ``into`` holds), and
       of each chunk the box that overlaps (``boxes``);
    2. :meth:`read`: read and check every needed file, in parallel: by range where only a part
       of it is needed (the blocks of those boxes), else whole (memory-mapped); any problem
       raises :class:`~shardkeep.errors.IntegrityError` before a tensor is built;
    3. :meth:`assemble`: build the tensors, sharded ones as full tensors or as this rank's
       regions, and placeholders (or nothing) for what a partial load left out;
    4. :meth:`fill`: fill ``into`` all or nothing (:func:`shardkeep.fill.fill_into`), or
       return the state.
    """

    def __init__(
        self,
        location: CheckpointLocation,
        manifest: Manifest,
        options: LoadOptions,
        *,
        into: Any,
        tiers: Iterable[str] | None,
        sections: set[str] | None,
        tier_locations: TierLocations | None,
        storage_options: Mapping[str, Any] | None,
        lazy: bool,
        progress: bool,
        limits: ManifestLimits | None = None,
        only_into: bool = False,
    ) -> None:
        self.location = location
        #: This rank's region of each sharded key it loads into a DTensor (``select``).
        self.wanted: dict[str, tuple[list[int], list[int]]] | None = None
        #: With ``only_into`` (``load(extra="ignore")``): the saved keys ``into`` holds, the only
        #: ones read; ``None``: every key.
        self.held: set[str] | None = held_keys(into, manifest) if only_into else None
        #: Described (format 2.x) tensors left out because ``into`` lacks them.
        self.unheld: list[ShardedTensor] = []
        if isinstance(manifest, IndexedManifest):
            # Format 2.x: the regions first, then only the rank indexes holding chunks of them.
            self.wanted = wanted_regions(into, manifest) if into is not None else {}
            if self.held is not None:
                self.unheld = [tensor for tensor in manifest.described() if tensor.key not in self.held]
            manifest = expand(
                location.store,
                location.name,
                manifest,
                needed_ranks(manifest, self.wanted, self.held),
                limits=limits,
                threads=options.io_threads,
            )
        self.manifest = manifest
        self.options = options
        self.into = into
        self.tiers = tiers
        self.sections = sections
        self.lazy = lazy
        self.progress = progress
        self.resolver = FileResolver(location, manifest, tier_locations=tier_locations, storage_options=storage_options)
        self.partial = False
        self.needed: list[list[int] | None] = []
        #: Per file: the box of each needed chunk this rank uses a part of (the others whole).
        self.boxes: list[dict[int, Box]] = []
        #: Per file: its bytes (read whole), or the pieces of each needed entry (read by range).
        self.buffers: list[memoryview | dict[int, list[Piece]] | None] = []
        self.absent: dict[str, tuple[TensorEntry, int]] = {}

    def run(self) -> Any:
        # Reading headers and building tensors makes many small objects and no cycles: the
        # collector's repeated scans of them would cost more than the work (about 0.7 s of 1.9 s
        # for 100,000 tensors). It runs again for the fill, which calls the caller's code.
        with collector_paused():
            self.select()
            self.read()
            state = self.assemble()
        return self.fill(state)

    def select(self) -> None:
        manifest = self.manifest
        selected = set(select_files(manifest, self.tiers))
        self.partial = len(selected) < len(manifest.files) or self.sections is not None
        if self.wanted is None:
            self.wanted = wanted_regions(self.into, manifest) if self.into is not None else {}
        section_of = _section_function(manifest)
        sections, held = self.sections, self.held
        for index, record in enumerate(manifest.files):
            entries = needed_entries(record, self.wanted)
            if index not in selected:
                entries = []
            elif sections is not None or held is not None:
                keep = [
                    i
                    for i in (range(len(record.tensors)) if entries is None else entries)
                    if (sections is None or section_of(record.tensors[i].key) in sections)
                    and (held is None or record.tensors[i].key in held)
                ]
                entries = None if entries is None and len(keep) == len(record.tensors) else keep
            self.needed.append(entries)
            boxes: dict[int, Box] = {}
            for position in range(len(record.tensors)) if entries is None else entries:
                entry = record.tensors[position]
                box = needed_box(entry, self.wanted.get(entry.key))
                if box is not None:
                    boxes[position] = box
            self.boxes.append(boxes)

    def read(self, checked: Mapping[str, memoryview] | None = None) -> None:
        """Read (and with ``verify``, check) every file this rank needs into ``buffers``.
        ``checked``: files the caller has read and checked already (their digests and headers,
        against this manifest's records), by path: their bytes are used as they are."""
        manifest, needed, options = self.manifest, self.needed, self.options
        checked = checked or {}
        problems: list[str] = []
        if options.verify:
            problems.extend(file_set_problems(self.location, manifest, resolver=self.resolver))
        update, close = progress_bar(
            sum(r.size for i, r in enumerate(manifest.files) if needed[i] != []),
            f"load {self.location.name}",
            self.progress,
        )

        def read_one(index: int) -> tuple[memoryview | dict[int, list[Piece]] | None, list[str]]:
            record = manifest.files[index]
            if needed[index] == []:
                return None, []  # not selected, or nothing in it overlaps what this rank loads
            if record.path in checked:
                if update is not None:
                    update(record.size)
                return checked[record.path], []
            store, where = self.resolver(record)
            if needed[index] is not None or self.boxes[index]:
                pieces, found = self._read_ranges(index, update)
                if pieces is not None or found:
                    return pieces, self.resolver.annotate(record, found)
            buffer, found = check_shard(
                store,
                where,
                record,
                verify=options.verify,
                keep=True,
                use_mmap=options.mmap,
                needed=needed[index],
                on_bytes=update,
                digest=checked_digests(options),
            )
            return buffer, self.resolver.annotate(record, found)

        try:
            threads = min(options.io_threads, len(manifest.files))
            if threads <= 1:  # no pool: starting its thread costs more than reading one file
                results = [read_one(index) for index in range(len(manifest.files))]
            else:
                with ThreadPoolExecutor(threads, thread_name_prefix="shardkeep-read") as pool:
                    results = list(pool.map(read_one, range(len(manifest.files))))
        finally:
            close()
        for _, file_problems in results:
            problems.extend(file_problems)
        if problems:
            raise IntegrityError(f"checkpoint {self.location} failed verification: " + "; ".join(problems), problems)
        self.buffers = [buffer for buffer, _ in results]

    def _read_ranges(
        self, index: int, on_bytes: Callable[[int], None] | None
    ) -> tuple[dict[int, list[Piece]] | None, list[str]]:
        """File ``index`` read by range (:func:`~shardkeep.reads.read_needs`): its needed
        entries' pieces, or ``None`` (read it whole), and the problems found. A file whose
        header is older than the record's (a cache or replica behind) is read once more."""
        record = self.manifest.files[index]
        store, where = self.resolver(record)
        positions = self.needed[index]
        boxes = self.boxes[index]
        needs = [Need(p, boxes.get(p)) for p in (range(len(record.tensors)) if positions is None else positions)]
        choice = checked_digests(self.options) if self.options.verify else None
        for attempt in range(2):
            try:
                return read_needs(store, where, record, needs, choice, on_bytes=on_bytes), []
            except IntegrityError as exc:
                if attempt or not any(STALE in problem for problem in exc.problems):
                    return None, exc.problems
            except ShardkeepError as exc:
                return None, [f"{record.path}: {exc}"]
        raise AssertionError("unreachable")

    def assemble(self) -> Any:
        manifest, wanted = self.manifest, self.wanted or {}
        with collector_paused():
            tensors: list[tuple[list[str | int], int, Any]] = []
            chunks: dict[str, list[tuple[Box, Any]]] = {}
            descriptions: dict[str, TensorEntry] = {}
            loaded_keys: set[str] = set()
            skipped: dict[str, tuple[TensorEntry, int]] = {}
            for index, (record, buffer, wanted_here) in enumerate(
                zip(manifest.files, self.buffers, self.needed, strict=True)
            ):
                chosen = (
                    (range(len(record.tensors)) if wanted_here is None else wanted_here) if buffer is not None else ()
                )
                if self.partial or self.held is not None:
                    picked = set(chosen)
                    for position, entry in enumerate(record.tensors):
                        if position not in picked:
                            skipped.setdefault(entry.key, (entry, index))
                for position in chosen:
                    assert buffer is not None
                    entry = record.tensors[position]
                    loaded_keys.add(entry.key)
                    if isinstance(buffer, dict):
                        pieces = buffer.get(position, [])
                        if entry.global_offset is not None and entry.nbytes:
                            box = self.boxes[index].get(position)
                            chunks.setdefault(entry.key, []).append(rows_part(entry, box, pieces))
                            descriptions.setdefault(entry.key, entry)
                            continue
                        data, at = (pieces[0].data, -pieces[0].start) if pieces else (memoryview(b""), 0)
                    else:
                        data, at = buffer, entry.offset
                    array = array_from_buffer(
                        data, entry.dtype, entry.shape, at, entry.nbytes, entry.array_type, entry.key
                    )
                    if entry.global_offset is None:
                        tensors.append((entry.path, entry.order, array))
                    else:
                        chunks.setdefault(entry.key, []).append(chunk_part(entry, array))
                        descriptions.setdefault(entry.key, entry)
            for key, parts in chunks.items():
                tensors.append(assemble(descriptions[key], parts, wanted.get(key)))
            # A key whose region on this rank is empty (fewer rows than ranks) overlaps no
            # chunk: its chunks in the files read are skipped, yet it is not absent.
            empty = {key for key in wanted.keys() - chunks.keys() if 0 in wanted[key][1]}
            self.absent = {key: found for key, found in skipped.items() if key not in loaded_keys | empty}
            for key in wanted.keys() - chunks.keys():
                if key in self.absent:
                    continue  # on a tier or in a section this partial load leaves out
                # This rank's region is empty (fewer rows than ranks): no chunk overlaps it.
                first = _sharded_entry(manifest, key)
                assert first.global_shape is not None
                offset, shape = wanted[key]
                tensors.append((first.path, first.order, Region([], offset, shape, first.global_shape, first.dtype)))
            tensors.extend(
                _placeholders(
                    manifest,
                    self.absent,
                    self.resolver,
                    lazy=self.lazy,
                    verify=self.options.verify,
                    digest=checked_digests(self.options),
                )
            )
            # Described tensors into= lacks, none of whose chunks this load's indexes list.
            unheld = [tensor for tensor in self.unheld if tensor.key not in self.absent]
            tensors.extend((tensor.path, tensor.order, None) for tensor in unheld)
            loaded = rebuild_state(manifest.structure, manifest.values, tensors)
            if (self.absent or unheld) and not self.lazy:
                _drop_absent(loaded, [*(entry for entry, _ in self.absent.values()), *unheld])
        return loaded

    def fill(self, loaded: Any) -> Any:
        if self.into is None:
            return loaded
        fill_into(self.into, loaded, partial=self.partial, absent=frozenset(self.absent), add_extra=self.held is None)
        return self.into


def held_keys(into: Any, manifest: Manifest) -> set[str]:
    """The saved tensor keys that have a place in ``into`` (:mod:`shardkeep.tensors.targets`):
    what ``load(extra="ignore")`` reads. A place is a key of a mapping, an index of a list or
    tuple, a key of a module's state, anything under an optimizer or another object with
    ``load_state_dict`` (each takes its whole state), or a slot holding ``None``."""
    targets = TargetResolver(into)
    held: set[str] = set()
    seen: set[str] = set()
    described: list[TensorEntry | ShardedTensor] = [entry for _, entry in manifest.iter_tensors()]
    if isinstance(manifest, IndexedManifest):
        described += manifest.described()
    for entry in described:
        if entry.key in seen:
            continue
        seen.add(entry.key)
        if targets.resolve(entry.path).held:
            held.add(entry.key)
    return held


def checked_digests(options: LoadOptions) -> DigestChoice:
    """Which recorded digests a load with ``options`` compares: the fast ones for
    ``digest="fast"``, else the save's own (``None`` is resolved by the caller: the public
    entry points pass "fast" or "cryptographic")."""
    return "fast" if options.digest == "fast" else "strong"


def _sharded_entry(manifest: Manifest, key: str) -> TensorEntry | ShardedTensor:
    """How ``manifest`` describes sharded tensor ``key``: a chunk entry, or (format 2.x) its
    description (a family instance included)."""
    if isinstance(manifest, IndexedManifest):
        tensor = manifest.find(key)
        if tensor is not None:
            return tensor
    return next(entry for _, entry in manifest.iter_tensors() if entry.key == key)


def _section_function(manifest: Manifest) -> Callable[[str], str]:
    optim = manifest.optim_state.prefixes if manifest.optim_state is not None else []
    router = manifest.router_state.prefixes if manifest.router_state is not None else []
    return lambda key: section_of(key, optim, router)


def _placeholders(
    manifest: Manifest,
    absent: dict[str, tuple[TensorEntry, int]],
    resolver: FileResolver,
    *,
    lazy: bool,
    verify: bool,
    digest: DigestChoice,
) -> list[tuple[list[str | int], int, Any]]:
    """Leaves for tensors a partial load left out: lazy placeholders, or ``None`` (removed
    again from mappings by :func:`_drop_absent`; kept inside lists so indices stay right)."""
    result: list[tuple[list[str | int], int, Any]] = []
    files: dict[int, Any] = {}
    for key, (entry, index) in absent.items():
        if entry.global_offset is not None and lazy:
            raise UnsupportedValueError(
                f"tensor {key!r} is stored in chunks; lazy loading of sharded tensors is not supported"
            )
        if lazy:
            from shardkeep.lazy import LazyFile, LazyTensor

            if index not in files:
                store, where = resolver(manifest.files[index])
                files[index] = LazyFile(
                    store,
                    where,
                    manifest.files[index],
                    verify=verify,
                    describe=resolver.describe(manifest.files[index]),
                    digest=digest,
                )
            position = next(i for i, e in enumerate(manifest.files[index].tensors) if e is entry)
            result.append((entry.path, entry.order, LazyTensor(files[index], position)))
        else:
            result.append((entry.path, entry.order, None))
    return result


def _drop_absent(loaded: dict[str, Any], absent: list[TensorEntry | ShardedTensor]) -> None:
    """Remove the ``None`` placeholders of absent tensors from mappings (lists keep them)."""
    for entry in absent:
        node: Any = loaded
        for part in entry.path[:-1]:
            node = node[part]
        if isinstance(node, dict) and node.get(entry.path[-1], 0) is None:
            del node[entry.path[-1]]
