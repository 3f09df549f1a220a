"""Moved to :mod:`shardkeep.integrations.accelerate`; this import path is the same module object."""

import sys

from shardkeep.integrations import accelerate as _moved

sys.modules[__name__] = _moved
