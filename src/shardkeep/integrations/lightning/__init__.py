"""A Lightning ``CheckpointIO`` plugin: every Lightning checkpoint becomes a shardkeep checkpoint.

::

    from shardkeep.lightning import ShardkeepCheckpointIO
    trainer = lightning.pytorch.Trainer(plugins=[ShardkeepCheckpointIO()])

- :mod:`~shardkeep.integrations.lightning.values`: the lossless value codec (what a Lightning
  checkpoint dict holds that is not a tensor or JSON, recorded under :data:`RESERVED_KEY`);
- :mod:`~shardkeep.integrations.lightning.checkpoint_io`: the plugin, its atomic replacement of
  a checkpoint directory and the recovery of an interrupted save.

``shardkeep.lightning`` is this package. Importing it without Lightning installed raises
:class:`~shardkeep.errors.DependencyError`.
"""

from shardkeep.integrations.lightning.checkpoint_io import ShardkeepCheckpointIO
from shardkeep.integrations.lightning.values import RESERVED_KEY, decode_checkpoint, encode_checkpoint

__all__ = ["RESERVED_KEY", "ShardkeepCheckpointIO", "decode_checkpoint", "encode_checkpoint"]
