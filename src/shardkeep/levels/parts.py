"""A node's part of a node-local checkpoint (``node-part.json``): the format lives with the
manifest's, in :mod:`shardkeep.manifest.node_part` (``verify`` reads it too); these are the
same objects."""

from shardkeep.manifest.node_part import NodePart, decode_node_part, encode_node_part, manifest_identity

__all__ = ["NodePart", "decode_node_part", "encode_node_part", "manifest_identity"]
