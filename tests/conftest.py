"""Shared fixtures: small deterministic states, helpers that damage checkpoints on disk, a local
S3 server. The helpers themselves live in :mod:`tests.support`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

# The helpers and the storage conformance checks assert too: rewrite their asserts as pytest does
# the tests' (before they are imported).
pytest.register_assert_rewrite("tests.support", "shardkeep.testing")

from tests.support import disk, states  # noqa: E402  (after the torch check: states imports torch)


@pytest.fixture(autouse=True)
def _process_wide_torch_flags() -> Any:
    """Put back the torch flags a test's framework may set for the whole process (Lightning's
    ``Trainer(deterministic=True)`` turns on deterministic algorithms and leaves them on)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic)


@pytest.fixture
def state() -> dict[str, Any]:
    return states.make_state()


# --------------------------------------------------------------------------------------------
# The helpers of tests/support as fixtures: a test asks for one by name and calls it


@pytest.fixture
def make_state() -> Callable[..., dict[str, Any]]:
    """``make_state(seed=0)``: a small deterministic training state (:func:`tests.support.states.make_state`)."""
    return states.make_state


@pytest.fixture
def assert_same_tree() -> Callable[..., None]:
    """``assert_same_tree(found, expected)``: the two state trees hold the same values."""
    return states.assert_same_tree


@pytest.fixture
def flip_bit() -> Callable[[Path, int, int], None]:
    """``flip_bit(path, byte_index, bit)``: flip one bit of a file in place."""
    return disk.flip_bit


@pytest.fixture
def reseal() -> Callable[..., None]:
    """``reseal(checkpoint, mutate)``: change a checkpoint's manifest and re-seal it."""
    return disk.reseal


@pytest.fixture
def tree_listing() -> Callable[[Path], list[str]]:
    """``tree_listing(root)``: every path under ``root``, relative and sorted."""
    return disk.tree_listing


@pytest.fixture
def checkpoint_files() -> Callable[[Path], list[Path]]:
    """``checkpoint_files(directory)``: every regular file under ``directory``, sorted."""
    return disk.checkpoint_files


# --------------------------------------------------------------------------------------------
# A real S3 server (SeaweedFS) for the whole session


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.support.s3server import running

    with running(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def s3_root(s3_server: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh bucket on the session's S3 server: (``s3://bucket/root``, storage options).
    The bucket is removed after the test."""
    with s3_server.bucket() as bucket:
        yield f"s3://{bucket}/root", s3_server.storage_options
