"""Moved to :mod:`shardkeep.integrations.lightning`; this import path is the same module object."""

import sys

from shardkeep.integrations import lightning as _moved

sys.modules[__name__] = _moved
