"""Tensor handling: the shard file format (no torch), dtype mapping and state flattening (torch).

``shardkeep.tensors.shardfile`` imports without torch so that ``verify`` and the CLI stay light;
``convert`` and ``flatten`` import torch and numpy.
"""
