"""Hugging Face model folders: writing a checkpoint's model as a folder that ``transformers``'
``from_pretrained`` loads, and reading such a folder (``--format hf``).

- :mod:`~shardkeep.integrations.hf.folder`: the folder on disk, its file names, and reading it;
- :mod:`~shardkeep.integrations.hf.keys`: the keys a model class reads, checked against the
  class built from a config, and transformers' key conversions;
- :mod:`~shardkeep.integrations.hf.export`: writing a checkpoint's model as a folder, placed
  whole or not at all.

``shardkeep.hf`` is this package.
"""

from shardkeep.integrations.hf.export import DEFAULT_MAX_SHARD_SIZE, HFExportSummary, export_hf, parse_size
from shardkeep.integrations.hf.folder import (
    CONFIG_FILE,
    CONFIG_VALUE_KEY,
    INDEX_FILE,
    SINGLE_FILE,
    HFFolder,
    is_hf_folder,
    read_folder,
)
from shardkeep.integrations.hf.keys import model_keys_of, to_folder_keys, to_model_keys

__all__ = [
    "CONFIG_FILE",
    "CONFIG_VALUE_KEY",
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "HFExportSummary",
    "HFFolder",
    "export_hf",
    "is_hf_folder",
    "model_keys_of",
    "parse_size",
    "read_folder",
    "to_folder_keys",
    "to_model_keys",
]
