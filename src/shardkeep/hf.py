"""Moved to :mod:`shardkeep.integrations.hf`; this import path is the same module object."""

import sys

from shardkeep.integrations import hf as _moved

sys.modules[__name__] = _moved
