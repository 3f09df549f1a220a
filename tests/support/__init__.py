"""What the tests share, imported as ``from tests.support import ...``.

- :mod:`~tests.support.states`: a small deterministic training state and a tree comparison;
- :mod:`~tests.support.disk`: listing a checkpoint's files and damaging them on disk;
- :mod:`~tests.support.distributed_harness`: forked ranks in a real gloo process group;
- :mod:`~tests.support.s3server`: a local S3 server (SeaweedFS);
- :mod:`~tests.support.ledger_workers`: spawned ledger writers, readers and the lock deleter;
- :mod:`~tests.support.figures`: the reliability figures that tests record;
- :mod:`~tests.support.observe`: the messages the library logs and the all-gathers it makes.

A test function asks for the functions of the first two as fixtures of the same names
(``make_state``, ``assert_same_tree``, ``flip_bit``, ``reseal``, ``tree_listing``,
``checkpoint_files``, in ``tests/conftest.py``); module-level helpers and worker processes import
them from here.
"""
