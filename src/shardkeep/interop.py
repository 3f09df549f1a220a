"""Moved to :mod:`shardkeep.integrations.convert`; this import path is the same module object."""

import sys

from shardkeep.integrations import convert as _moved

sys.modules[__name__] = _moved
