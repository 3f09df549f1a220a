"""Tensor handling: the shard file format and the key grammar (no torch); dtype mapping, state
flattening and the resharding arithmetic (torch).

``shardkeep.tensors.shardfile`` imports without torch so that ``verify`` and the CLI stay light;
``convert`` and ``flatten`` import torch and numpy.
"""
