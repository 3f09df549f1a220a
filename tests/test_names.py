"""``shardkeep.names`` is the one home of every name shardkeep gives something on disk: the
other modules import the markers and reserved names from it and never spell them again, and the
old import paths of those names are the same objects."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardkeep
import shardkeep.catalog as catalog
import shardkeep.distributed.commit as commit
import shardkeep.manifest as manifest
import shardkeep.storage as storage
from shardkeep import names
from shardkeep.errors import ConfigError

PACKAGE = Path(shardkeep.__file__).parent

#: Every marker and reserved name: a string constant equal to one of these, anywhere but in
#: names.py, is a second definition.
SPELLED_ONCE = {
    names.MANIFEST_FILENAME,
    names.SIGNATURE_FILENAME,
    names.STAGING_MARKER,
    names.DELETING_MARKER,
    names.CORRUPT_MARKER,
    names.RETAINED_MARKER,
    names.ATTEMPT_PREFIX,
    names.HF_OLD_MARKER,
    names.LIGHTNING_TAG,
    names.LIGHTNING_NEW_ROLE,
    names.LIGHTNING_OLD_ROLE,
    names.LIGHTNING_RETIRED_ROLE,
}


def _string_constants(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of ``tree``, f-string pieces included."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_markers_and_reserved_names_are_spelled_only_in_names() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "names.py"
        for node in _string_constants(ast.parse(path.read_text()))
        if node.value in SPELLED_ONCE
    ]
    assert found == []


def test_old_import_paths_are_the_same_objects() -> None:
    assert catalog.CHECKPOINT_NAME is names.CHECKPOINT_NAME is names.STEP_NAME
    assert catalog.POINTERS is names.POINTERS == ("last", "best")
    assert catalog.checkpoint_name is names.checkpoint_name
    assert storage.ATTEMPT_PREFIX is commit.ATTEMPT_PREFIX is names.ATTEMPT_PREFIX == "attempt-"
    assert manifest.MANIFEST_FILENAME is names.MANIFEST_FILENAME == "manifest.json"
    assert manifest.SIGNATURE_FILENAME is names.SIGNATURE_FILENAME == "manifest.sig"
    assert (manifest.STAGING_MARKER, manifest.DELETING_MARKER) == (".tmp-", ".deleting-")
    assert manifest.is_staging_name is names.is_staging_name
    assert manifest.unsafe_path_reason is names.unsafe_path_reason
    assert manifest.index_path is names.index_path
    assert names.index_path(3) == "index/rank_00003.json"


@pytest.mark.parametrize("step", [0, 7, 12_345_678, 10**9, names.MAX_STEP])
def test_a_checkpoint_name_gives_back_its_step(step: int) -> None:
    name = names.checkpoint_name(step)
    assert names.CHECKPOINT_NAME.fullmatch(name)
    assert names.step_of_checkpoint(name) == names.step_of_name(name) == step


@pytest.mark.parametrize("name", ["step_", "step_x", "last", "step_1.tmp-" + "0" * 32, f"step_{names.MAX_STEP + 1}"])
def test_a_name_that_is_no_checkpoint_name_has_no_step(name: str) -> None:
    assert names.step_of_name(name) is None
    with pytest.raises(ConfigError, match="not a checkpoint name"):
        names.step_of_checkpoint(name)


@pytest.mark.parametrize("step", [-1, True, 1.0, names.MAX_STEP + 1])
def test_checkpoint_name_refuses_what_no_manifest_records(step: object) -> None:
    with pytest.raises(ConfigError, match="must be an integer"):
        names.checkpoint_name(step)  # type: ignore[arg-type]
