"""The public option groups of a save and a load: where tensors go (:class:`TierPlan`), what an
incremental save compares against (:class:`Incremental`) and what the manifest records
(:class:`ManifestFields`), beside :class:`~shardkeep.config.WriteOptions` (how bytes are
written); which part of a checkpoint a load reads (:class:`LoadSelection`); the typed values of
``signer=``, ``public_key=`` and ``process_group=``; and :func:`regroup` and :func:`reselect`,
which turn the keyword spellings of the previous release into these groups.

Each group is frozen and checks its fields when it is built, raising
:class:`~shardkeep.errors.ConfigError` naming the field. :func:`shardkeep.save`,
:func:`shardkeep.async_save`, :class:`shardkeep.CheckpointManager` and the integrations take the
same groups under the same names (``options=``, ``tiers=``, ``incremental=``, ``fields=``).
This module does not import torch.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from shardkeep.config import WriteOptions
from shardkeep.errors import ConfigError, UnknownOptionError
from shardkeep.manifest import Tier
from shardkeep.tiers import Placement

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
    from torch.distributed import ProcessGroup

    #: ``signer=``: an Ed25519 private key, or the path of a PEM private key file.
    Signer: TypeAlias = Ed25519PrivateKey | str | os.PathLike[str]
    #: ``public_key=``: an Ed25519 public key, or the path of a PEM public key file.
    PublicKey: TypeAlias = Ed25519PublicKey | str | os.PathLike[str]
    #: ``process_group=``: a torch process group, or :data:`shardkeep.LOCAL` (this process alone).
    Group: TypeAlias = ProcessGroup | Literal["local"]

# ``Signer``, ``PublicKey`` and ``Group`` exist for type checkers only (they name torch and
# cryptography types): import them under ``TYPE_CHECKING``.
__all__ = [
    "INTERNAL_KEYWORDS",
    "LEGACY_KEYWORDS",
    "Incremental",
    "LoadSelection",
    "ManifestFields",
    "Regrouped",
    "TierPlan",
    "WriteOptions",
    "regroup",
    "reselect",
]

#: The base of ``incremental=``: off, on (laid out to be referenced later), or an earlier checkpoint.
IncrementalBase: TypeAlias = bool | str | os.PathLike[str]


@dataclass(frozen=True, kw_only=True)
class TierPlan:
    """Where each tensor goes: ``tiers`` (:class:`~shardkeep.manifest.Tier` objects; a tier's
    files go to its ``location``, ``None`` meaning beside the manifest) and ``placement``
    (ordered ``(glob on the key, tier name)`` rules, or a callable taking a
    :class:`~shardkeep.tiers.PlacementInfo` and returning a tier name). Size budgets are
    enforced as each tier's ``placement_policy`` says. ``save(tiers=[...])`` is
    ``TierPlan(tiers=[...])``."""

    tiers: Sequence[Tier] = ()
    placement: Placement | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tiers, (str, bytes)) or not isinstance(self.tiers, Sequence):
            raise ConfigError(f"TierPlan tiers={self.tiers!r} must be a list of shardkeep.Tier")
        for tier in self.tiers:
            if not isinstance(tier, Tier):
                raise ConfigError(f"TierPlan tiers= must hold shardkeep.Tier objects, got {type(tier).__name__}")
        placement = self.placement
        if placement is not None and not callable(placement):
            if isinstance(placement, (str, bytes)) or not isinstance(placement, Sequence):
                raise ConfigError(f"TierPlan placement={placement!r} must be (glob, tier name) pairs or a callable")
            for rule in placement:
                if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and all(isinstance(s, str) for s in rule)):
                    raise ConfigError(f"TierPlan placement rule {rule!r} must be a (glob, tier name) pair")
        if placement is not None and not self.tiers:
            raise ConfigError("placement= needs tiers=: define the tiers the rules name")


@dataclass(frozen=True, kw_only=True)
class Incremental:
    """An incremental save. ``base``: ``True`` lays files out so that unchanged parts can be
    referenced later (one file per expert); a path (an earlier checkpoint in the same root) also
    compares each file's digest with that checkpoint's and records a reference to the existing
    file where they are equal; ``False`` is a full save. ``save(incremental=path)`` is
    ``Incremental(base=path)``.

    ``trust_versions`` (off by default): a file whose tensors are the same objects this process
    saved or proved before, alone on the same storage, with PyTorch version counters that have
    not moved since and no optimizer step with a gradient for them, is known unchanged without
    hashing it (module buffers are always hashed). Writes that bypass the counter are not seen
    (``tensor.data.add_()``, storage-level writes, native ops writing an argument other than
    their first, a NumPy view, another process writing shared memory): turn it on only when the
    saved tensors change through torch in-place ops on themselves and optimizer steps
    (docs/tiers.md lists every case). ``async_save`` never uses it (its state is a copy).
    """

    base: IncrementalBase = True
    trust_versions: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.base, (bool, str, os.PathLike)):
            raise ConfigError(f"incremental={self.base!r} must be True, False, or the path of an earlier checkpoint")
        if not isinstance(self.trust_versions, bool):
            raise ConfigError(f"trust_versions={self.trust_versions!r} must be True or False")
        if self.trust_versions and self.base is False:
            raise ConfigError("trust_versions=True needs incremental= (it proves files unchanged)")


@dataclass(frozen=True, kw_only=True)
class ManifestFields:
    """What the manifest records beside the state: ``model_id``, ``epoch``, ``training``
    (``learning_rate``, ``optimizer_type``; detected from an optimizer in the state otherwise),
    ``sharding_strategy`` (detected otherwise), ``custom_fields`` (a mapping of plain JSON
    values) and ``metrics`` (name to number; NaN and infinities are recorded as null; the
    checkpoint manager sets them for each save)."""

    model_id: str | None = None
    epoch: int | None = None
    training: Mapping[str, Any] | None = None
    sharding_strategy: str | None = None
    custom_fields: Mapping[str, Any] | None = None
    metrics: Mapping[str, float | None] | None = None

    def __post_init__(self) -> None:
        for name in ("model_id", "sharding_strategy"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"ManifestFields {name}={value!r} must be a string or None")
        if self.epoch is not None and (isinstance(self.epoch, bool) or not isinstance(self.epoch, int)):
            raise ConfigError(f"ManifestFields epoch={self.epoch!r} must be an integer or None")
        for name in ("training", "custom_fields", "metrics"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"ManifestFields {name}= must be a mapping or None, got {type(value).__name__}")


@dataclass(frozen=True, kw_only=True)
class LoadSelection:
    """Which part of a checkpoint :func:`shardkeep.load` reads: the ``select=`` of ``load``.

    ``tiers`` (tier names) and ``sections`` (``"model"``, ``"optim"``, ``"router"``) select a
    part: only the files holding it are read. Tensors left out are absent from the result
    (``None`` inside lists), or, with ``lazy=True``, :class:`~shardkeep.lazy.LazyTensor`
    placeholders that read and verify their file on first use (not with ``into``). ``extra``
    says what becomes of saved state that ``into`` lacks: ``"add"`` (the default) loads it and
    adds it to ``into``; ``"ignore"`` never reads it (it needs ``into``), so a rank whose
    ``into`` holds only its own experts reads only their files.
    """

    tiers: Collection[str] | None = None
    sections: Collection[str] | None = None
    extra: Literal["add", "ignore"] = "add"
    lazy: bool = False

    def __post_init__(self) -> None:
        if self.extra not in ("add", "ignore"):
            raise ConfigError(f"extra={self.extra!r} must be 'add' or 'ignore'")
        if not isinstance(self.lazy, bool):
            raise ConfigError(f"LoadSelection lazy={self.lazy!r} must be True or False")


# --------------------------------------------------------------------------------------------
# The keyword spellings of the previous release
# --------------------------------------------------------------------------------------------

#: Write options newer than the flat keywords: given through ``options=`` only.
_WITHOUT_KEYWORD = ("block_size",)

_GROUP_OF: dict[str, tuple[str, type[Any]]] = {
    **{f.name: ("options", WriteOptions) for f in fields(WriteOptions) if f.name not in _WITHOUT_KEYWORD},
    "placement": ("tiers", TierPlan),
    "trust_versions": ("incremental", Incremental),
    **{f.name: ("fields", ManifestFields) for f in fields(ManifestFields)},
}

#: The keyword spellings of the previous release that name a field of a group.
LEGACY_KEYWORDS: tuple[str, ...] = tuple(_GROUP_OF)

#: Keywords of the previous release that only the checkpoint manager passed (it now builds the
#: save settings itself); still accepted, with the warning, and passed on unchanged.
INTERNAL_KEYWORDS = ("run", "budget", "started", "after_commit")


@dataclass(frozen=True)
class Regrouped:
    """The groups of one call, after :func:`regroup`."""

    options: WriteOptions
    tiers: TierPlan
    incremental: Incremental
    fields: ManifestFields
    #: Old internal keywords given (``run``, ``budget``, ``started``, ``after_commit``).
    internal: dict[str, Any] = field(default_factory=dict)


def regroup(
    call: str,
    legacy: Mapping[str, Any],
    *,
    options: WriteOptions | None = None,
    tiers: TierPlan | Sequence[Tier] | None = None,
    incremental: Incremental | IncrementalBase = False,
    fields: ManifestFields | None = None,
    accepted: Sequence[str] = LEGACY_KEYWORDS + INTERNAL_KEYWORDS,
    hints: Sequence[str] = (),
) -> Regrouped:
    """The option groups of a call to ``call``, from its group arguments and ``legacy``, the
    keywords it got beyond them.

    An old keyword (``digest=``, ``placement=``, ``model_id=`` ... listed in ``accepted``) is
    folded into its group, over the group's value, and one :class:`DeprecationWarning` per call
    names each old keyword and its replacement (and ``hints``, the caller's own old spellings).
    Any other keyword raises :class:`~shardkeep.errors.UnknownOptionError`, as Python raises
    ``TypeError``.
    """
    unknown = sorted(name for name in legacy if name not in accepted)
    if unknown:
        raise UnknownOptionError(f"{call}() got unknown option(s) {unknown}")
    written = _group(call, "options", options, WriteOptions)
    plan = TierPlan(tiers=tiers) if tiers is not None and not isinstance(tiers, TierPlan) else tiers
    plan = _group(call, "tiers", plan, TierPlan)
    if not isinstance(incremental, Incremental):
        if not isinstance(incremental, (bool, str, os.PathLike)):
            raise ConfigError(
                f"incremental={incremental!r} must be True, False, the path of an earlier checkpoint or an Incremental"
            )
        incremental = Incremental(base=incremental)
    recorded = _group(call, "fields", fields, ManifestFields)
    if not legacy and not hints:
        return Regrouped(written, plan, incremental, recorded)
    changes: dict[str, dict[str, Any]] = {"options": {}, "tiers": {}, "incremental": {}, "fields": {}}
    internal: dict[str, Any] = {}
    hints = list(hints)
    for name, value in legacy.items():
        if name in INTERNAL_KEYWORDS:
            internal[name] = value
            hints.append(f"{name}= is internal to the checkpoint manager and has no replacement")
            continue
        group, kind = _GROUP_OF[name]
        changes[group][name] = value
        hints.append(f"{name}= is now {group}={kind.__name__}({name}=...)")
    warnings.warn(f"{call}(): " + "; ".join(hints), DeprecationWarning, stacklevel=3)
    return Regrouped(
        replace(written, **changes["options"]),
        replace(plan, **changes["tiers"]),
        replace(incremental, **changes["incremental"]),
        replace(recorded, **changes["fields"]),
        internal,
    )


def _group(call: str, name: str, value: Any, kind: type[Any]) -> Any:
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise ConfigError(f"{call}(): {name}= must be a shardkeep.{kind.__name__}, got {value!r}")
    return value


#: The keyword spellings of ``load`` of the previous release that name a field of :class:`LoadSelection`.
LOAD_KEYWORDS: tuple[str, ...] = tuple(f.name for f in fields(LoadSelection))


def reselect(call: str, legacy: Mapping[str, Any], select: LoadSelection | None) -> LoadSelection:
    """The :class:`LoadSelection` of a call to ``call``, from ``select`` and ``legacy``, the
    keywords it got beyond its own: an old keyword (``tiers=``, ``sections=``, ``extra=``,
    ``lazy=``) is folded in, with one :class:`DeprecationWarning` per call naming each; any
    other raises :class:`~shardkeep.errors.UnknownOptionError`."""
    unknown = sorted(name for name in legacy if name not in LOAD_KEYWORDS)
    if unknown:
        raise UnknownOptionError(f"{call}() got unknown option(s) {unknown}")
    chosen: LoadSelection = _group(call, "select", select, LoadSelection)
    if not legacy:
        return chosen
    hints = [f"{name}= is now select=LoadSelection({name}=...)" for name in legacy]
    warnings.warn(f"{call}(): " + "; ".join(hints), DeprecationWarning, stacklevel=3)
    return replace(chosen, **legacy)
