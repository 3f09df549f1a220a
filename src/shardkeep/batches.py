"""Moved to :mod:`shardkeep.ledger.batches`; this import path is the same module object."""

import sys

from shardkeep.ledger import batches as _moved

sys.modules[__name__] = _moved
