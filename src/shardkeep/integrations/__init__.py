"""The framework integrations and the converters, each behind its optional dependency.

- :mod:`~shardkeep.integrations.dcp`: DCP's ``StorageWriter``/``StorageReader``;
- :mod:`~shardkeep.integrations.lightning`: Lightning's ``CheckpointIO``;
- :mod:`~shardkeep.integrations.accelerate`: Accelerate's ``save_state``/``load_state``;
- :mod:`~shardkeep.integrations.hf`: Hugging Face model folders;
- :mod:`~shardkeep.integrations.convert`: import and export (torch.save, safetensors, DCP, HF).

Importing this package imports none of them.
"""
