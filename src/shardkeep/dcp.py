"""Moved to :mod:`shardkeep.integrations.dcp`; this import path is the same module object."""

import sys

from shardkeep.integrations import dcp as _moved

sys.modules[__name__] = _moved
