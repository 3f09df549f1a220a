"""Converting to and from other formats: ``shardkeep import`` and ``shardkeep export``.

Imports treat their input as untrusted:

- a torch ``.pt``/``.pth``/``.bin`` file is read with ``torch.load(weights_only=True)``, passed
  explicitly, so ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` cannot turn pickle loading back on; a file
  that needs arbitrary Python objects is refused;
- a safetensors file holds no code at all; its header is bounded and checked by ``safetensors``;
- a ``torch.distributed.checkpoint`` (DCP) directory keeps its metadata (``.metadata``) and its
  non-tensor values as Python pickles, and DCP reads them with ``pickle.load`` and
  ``torch.load(weights_only=False)``: reading one runs whatever code the file names. It is
  refused unless the caller passes ``trust_pickle=True`` (``--trust-pickle``).

- a Hugging Face model folder (``model.safetensors``, or shards and their index) is read with
  ``safetensors`` only, after its index is checked (:mod:`shardkeep.integrations.hf`); a folder of
  ``pytorch_model.bin`` pickles is refused (import the file itself as ``pt``).

Exports write a single torch ``.pt`` file (loadable with ``weights_only=True``), a single
safetensors file (tensors under their dotted keys; JSON values go into the header's metadata as
``shardkeep.values``), or a Hugging Face model folder (:func:`shardkeep.integrations.hf.export_hf`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

import shardkeep.api as api
import shardkeep.integrations.hf as hf
from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    StorageError,
    UnsupportedValueError,
)
from shardkeep.fill import restore_optimizer_ids
from shardkeep.manifest import Manifest
from shardkeep.names import check_name_length
from shardkeep.options import ManifestFields
from shardkeep.storage.localfs import write_file_atomic
from shardkeep.tensors.convert import TORCH_TO_NAME
from shardkeep.tensors.flatten import FlatState, flatten_state
from shardkeep.tensors.shardfile import CARRIED_DTYPES

if TYPE_CHECKING:
    from torch.distributed.checkpoint.storage import StorageReader

__all__ = ["ExportSummary", "detect_format", "export_checkpoint", "import_checkpoint"]

SourceFormat = Literal["pt", "safetensors", "dcp", "hf"]
ExportFormat = Literal["pt", "safetensors", "hf"]
#: The keyword options of :func:`export_checkpoint` that go to :func:`shardkeep.integrations.hf.export_hf`.
_HF_EXPORT_OPTIONS = ("subtree", "config", "max_shard_size", "check_keys", "model_class")

_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: The safetensors metadata key holding a checkpoint's JSON values on export.
VALUES_METADATA_KEY = "shardkeep.values"

PICKLE_REFUSAL = (
    "{source} is a torch.distributed.checkpoint directory. DCP stores its metadata (.metadata) and "
    "its non-tensor values as Python pickles, and reading a pickle runs whatever code the file names: "
    "a checkpoint from a source you do not fully trust can execute code on this machine. shardkeep "
    "never unpickles by default. If you trust where this checkpoint came from, pass --trust-pickle "
    "(trust_pickle=True); the result is then a shardkeep checkpoint that loads without pickle."
)


def detect_format(source: str | os.PathLike[str]) -> SourceFormat:
    """The format of ``source``: a DCP directory (it has ``.metadata``), a Hugging Face model
    folder (``model.safetensors``, ``model.safetensors.index.json``), a safetensors file, or a
    torch file."""
    path = os.fspath(source)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, ".metadata")):
            return "dcp"
        if hf.is_hf_folder(path):
            return "hf"
        raise UnsupportedValueError(
            f"{path} is a directory without a .metadata file (not a torch.distributed.checkpoint) and without "
            f"{hf.SINGLE_FILE} or {hf.INDEX_FILE} (not a Hugging Face model folder); "
            "to copy a shardkeep checkpoint, load and save it"
        )
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not os.path.isfile(path):
        raise UnsupportedValueError(f"{path} is not a regular file")
    if path.endswith(".safetensors"):
        return "safetensors"
    with open(path, "rb") as handle:
        head = handle.read(9)
    if head[:4] == b"PK\x03\x04" or path.endswith(_TORCH_SUFFIXES):
        return "pt"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise UnsupportedValueError(
        f"cannot tell the format of {path}: name it .pt/.pth/.bin or .safetensors, or pass the format"
    )


def _read_torch(path: str) -> Any:
    import pickle

    try:
        # weights_only=True is passed explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD only overrides
        # calls that leave it unset.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedValueError(
            f"{path} needs more than tensors and plain containers to load ({first}); shardkeep reads torch "
            "files only with torch.load(weights_only=True) and never runs code from them"
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UnsupportedValueError(f"{path} is not a readable torch file: {exc}") from exc


def _read_safetensors(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118  # safe_open has no iterator
    except (SafetensorError, OSError, ValueError) as exc:
        raise UnsupportedValueError(f"{path} is not a valid safetensors file: {exc}") from exc
    state: dict[str, Any] = dict(tensors)
    values = metadata.pop(VALUES_METADATA_KEY, None)
    if values is not None:
        try:
            decoded = json.loads(values)
        except (ValueError, RecursionError) as exc:
            raise UnsupportedValueError(f"{path}: metadata {VALUES_METADATA_KEY!r} is not JSON: {exc}") from exc
        if not isinstance(decoded, dict):
            raise UnsupportedValueError(f"{path}: metadata {VALUES_METADATA_KEY!r} must be a JSON object")
        clashes = sorted(set(decoded) & set(state))
        if clashes:
            raise UnsupportedValueError(f"{path}: {VALUES_METADATA_KEY!r} repeats tensor key(s) {clashes[:5]}")
        state.update(decoded)
    return state, metadata


def _read_dcp(path: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        state = load_whole_state(FileSystemReader(path))
    except (Exception, CheckpointException) as exc:
        # DCP raises many kinds: pickle errors, OSError, and CheckpointException, which derives
        # from BaseException only.
        raise IntegrityError(
            f"{path}: reading the DCP checkpoint failed (damaged or incomplete?): {type(exc).__name__}: {exc}"
        ) from exc
    restored: dict[str, Any] = _optimizer_ids_restored(state)
    return restored


def load_whole_state(storage_reader: StorageReader) -> dict[str, Any]:
    """Every item of the DCP checkpoint ``storage_reader`` reads, nested as it was saved, loaded
    in this process alone through DCP's public ``load`` (``no_dist=True``): the state
    ``format_utils.dcp_to_torch_save`` loads. The state to load into is first built from the
    checkpoint's metadata (each tensor allocated on the CPU, nested as its ``planner_data``
    says). Byte items are read with ``torch.load(weights_only=False)``, as DCP reads them: only
    for a trusted checkpoint."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    metadata = storage_reader.read_metadata()
    paths = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    state: dict[str, Any] = {}
    for key, described in metadata.state_dict_metadata.items():
        value: Any = described  # a byte item's place, filled by the load
        if isinstance(described, TensorStorageMetadata):
            value = torch.empty(described.size, dtype=described.properties.dtype)
        if key in paths:
            _set_at(state, tuple(paths[key]), value)
        else:
            state[key] = value
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # no_dist is meant
        load(state, storage_reader=storage_reader, planner=DefaultLoadPlanner(), no_dist=True)
    return state


def _set_at(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in ``root``, making the containers on the way: a dict before a
    string key, a list (extended with None) before an integer one, as DCP nests a state."""
    container: Any = root
    for step, following in itertools.pairwise(path):
        empty: Any = {} if type(following) is str else []
        if isinstance(container, dict):
            container = container.setdefault(step, empty)
        else:
            index = int(step)
            container.extend([None] * (index + 1 - len(container)))
            if container[index] is None:
                container[index] = empty
            container = container[index]
    last = path[-1]
    if type(last) is int:
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value


def _optimizer_ids_restored(value: Any) -> Any:
    """``value`` with every optimizer state dict in it given back its integer parameter ids:
    DCP flattens ``optimizer.state_dict()`` with string keys (``'0'`` for ``0``), which
    ``load_state_dict`` would keep apart from the parameters, dropping their state in silence."""
    if isinstance(value, list):
        return [_optimizer_ids_restored(item) for item in value]
    if not isinstance(value, Mapping):
        return value
    value = restore_optimizer_ids(value)
    return {key: _optimizer_ids_restored(item) for key, item in value.items()}


def import_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    source_format: SourceFormat | None = None,
    trust_pickle: bool = False,
    subtree: str | None = None,
    **save_options: Any,
) -> Manifest:
    """Convert ``source`` (a torch file, a safetensors file, a DCP directory or a Hugging Face
    model folder) into a new shardkeep checkpoint at ``destination``; ``save_options`` go to
    :func:`shardkeep.save` (``options=``, ``fields=``, ``signer=`` ...; the custom fields of
    ``fields`` are recorded beside ``imported_from``). See the module
    docstring for what is trusted.

    A Hugging Face folder's tensors go under ``subtree`` (dotted; default ``"model"``, ``""``
    for the top level), under the state_dict keys of the model class its ``config.json`` names
    when transformers can convert them (:func:`shardkeep.integrations.hf.model_keys_of`; which keys they are
    is recorded in ``custom_fields["imported_from"]["keys"]``), and its ``config.json`` under
    the value ``hf_config``, where a later ``export_checkpoint(..., format="hf")`` finds it."""
    path = os.fspath(source)
    found = source_format or detect_format(path)
    if subtree is not None and found != "hf":
        raise ConfigError(f"subtree= (--subtree) applies to Hugging Face folders only, not to {found!r}")
    custom: dict[str, Any] = {"imported_from": {"format": found, "path": os.path.basename(path.rstrip("/"))}}
    if found == "hf":
        state, keys = _hf_state(path, "model" if subtree is None else subtree)
        custom["imported_from"]["keys"] = keys
    elif found == "pt":
        state = _read_torch(path)
    elif found == "safetensors":
        state, metadata = _read_safetensors(path)
        if metadata:
            custom["safetensors_metadata"] = metadata
    elif found == "dcp":
        if not trust_pickle:
            raise UnsupportedValueError(PICKLE_REFUSAL.format(source=path))
        state = _read_dcp(path)
    else:
        raise ConfigError(f"source_format={source_format!r} must be 'pt', 'safetensors', 'dcp' or 'hf'")
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(
            f"{path} holds a {type(state).__name__}, not a mapping of names to tensors; a checkpoint's state is a dict"
        )
    recorded = save_options.pop("fields", None) or ManifestFields()
    given = save_options.pop("custom_fields", None)  # the previous release's spelling
    if given is not None:
        warnings.warn(
            "import_checkpoint(): custom_fields= is now fields=ManifestFields(custom_fields=...)",
            DeprecationWarning,
            stacklevel=2,
        )
    given = given if given is not None else recorded.custom_fields or {}
    fields = dataclasses.replace(recorded, custom_fields={**custom, **given})
    return api.save(state, destination, fields=fields, **save_options)


def _hf_state(path: str, subtree: str) -> tuple[dict[str, Any], str]:
    """The state of an imported Hugging Face folder: its tensors nested under ``subtree``, under
    the keys of the model its config names (:func:`shardkeep.integrations.hf.model_keys_of`), and its config
    as the value ``hf_config``; and which keys they are."""
    if not os.path.isdir(path):
        raise UnsupportedValueError(f"{path} is not a directory: a Hugging Face model folder is one")
    folder = hf.read_folder(path)
    parts = subtree.split(".") if subtree else []
    if any(not part for part in parts):
        raise ConfigError(f"subtree={subtree!r} has an empty component")
    state: dict[str, Any] = {}
    node = state
    for part in parts:
        node = node.setdefault(part, {})
    tensors, keys = hf.model_keys_of(folder, path)
    node.update(tensors)
    if folder.config is not None:
        if hf.CONFIG_VALUE_KEY in state:
            raise UnsupportedValueError(f"{path} has a tensor named {hf.CONFIG_VALUE_KEY!r}; import it under a subtree")
        state[hf.CONFIG_VALUE_KEY] = folder.config
    return state, keys


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_checkpoint` wrote."""

    path: str
    format: ExportFormat
    tensors: int
    values: int
    bytes: int


def _export_format(destination: str, given: str | None) -> ExportFormat:
    if given is not None:
        if given not in ("pt", "safetensors", "hf"):
            raise ConfigError(f"format={given!r} must be 'pt', 'safetensors' or 'hf'")
        return given  # type: ignore[return-value]  # checked just above
    if destination.endswith(".safetensors"):
        return "safetensors"
    if destination.endswith(_TORCH_SUFFIXES):
        return "pt"
    raise ConfigError(
        f"cannot tell the format from {destination!r}: end it in .pt or .safetensors, or pass format= "
        "('hf' for a Hugging Face model folder)"
    )


def _write_export(kind: ExportFormat, state: Any, flat: FlatState, temporary: str) -> None:
    if kind == "pt":
        torch.save(_as_torch(state), temporary)
        return
    from safetensors.torch import save_file

    values = {entry.key: entry.value for entry in flat.values if entry.special is None}
    if len(values) < len(flat.values):
        special = [entry.key for entry in flat.values if entry.special is not None][:5]
        raise UnsupportedValueError(
            f"values {special} (non-finite floats, big integers ...) have no safetensors form; export to .pt"
        )
    tensors = {leaf.key: torch.as_tensor(leaf.value) for leaf in flat.tensors}
    unnamed = [key for key, tensor in tensors.items() if TORCH_TO_NAME.get(tensor.dtype) in CARRIED_DTYPES]
    if unnamed:
        raise UnsupportedValueError(
            f"tensors {unnamed[:5]} have dtypes safetensors has no name for "
            f"({sorted({str(tensors[key].dtype) for key in unnamed})}); export to .pt"
        )
    save_file(tensors, temporary, metadata={VALUES_METADATA_KEY: json.dumps(values)} if values else None)


def write_replacing(target: str, write: Callable[[str], None]) -> None:
    """Write ``target`` whole or not at all (:func:`~shardkeep.storage.localfs.write_file_atomic`:
    a fresh temporary file beside it, created exclusively with mode 0600, fsync, rename over
    ``target``, fsync of the directory), once its name is known to fit the filesystem."""
    check_name_length(os.path.basename(os.path.abspath(target)), "export destination")
    write_file_atomic(target, write, mode=0o600)


def _as_torch(value: Any) -> Any:
    """``value`` with numpy arrays as tensors, so that the ``.pt`` loads with ``weights_only=True``."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {key: _as_torch(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_as_torch(item) for item in value)
    return value


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    format: str | None = None,
    overwrite: bool = False,
    **load_options: Any,
) -> ExportSummary:
    """Write the checkpoint at ``checkpoint`` (verified while it is read; ``load_options`` go to
    :func:`shardkeep.load`, e.g. ``public_key``) as one torch ``.pt`` or safetensors file, or,
    with ``format="hf"``, as a Hugging Face model folder: then ``subtree``, ``config``,
    ``max_shard_size``, ``check_keys`` and ``model_class`` go to :func:`shardkeep.integrations.hf.export_hf` (which says more
    in its :class:`~shardkeep.integrations.hf.HFExportSummary`; here ``values`` is 0)."""
    target = os.fspath(destination)
    kind = _export_format(target, format)
    hf_options = {name: load_options.pop(name) for name in _HF_EXPORT_OPTIONS if name in load_options}
    if kind == "hf":
        written = hf.export_hf(checkpoint, target, overwrite=overwrite, **hf_options, **load_options)
        return ExportSummary(written.path, "hf", written.tensors, 0, written.bytes)
    if hf_options:
        raise ConfigError(f"{sorted(hf_options)} apply to format='hf' only")
    if os.path.exists(target) and not overwrite:
        raise CheckpointExistsError(f"{target} already exists; pass overwrite=True (--force) to replace it")
    state = api.load(checkpoint, **load_options)
    flat = flatten_state(state)
    tensor_bytes = sum(int(leaf.value.nbytes) for leaf in flat.tensors)
    try:
        write_replacing(target, lambda temporary: _write_export(kind, state, flat, temporary))
    except OSError as exc:
        raise StorageError(f"cannot write {target}: {exc}") from exc
    return ExportSummary(target, kind, len(flat.tensors), len(flat.values), tensor_bytes)
