"""Moved to :mod:`shardkeep.testing.faults`; this import path is the same module object."""

import sys

import shardkeep.testing.faults as _moved

sys.modules[__name__] = _moved
