"""Tensor handling: the shard file format, the key grammar and the coverage check of chunks (no
torch); dtype mapping, state flattening and the resharding arithmetic (torch).

``shardfile``, ``keys`` and ``coverage`` import without torch so that ``verify`` and the CLI
stay light; ``convert``, ``flatten`` and ``regions`` import torch and numpy.
"""
