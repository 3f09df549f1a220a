"""The public API is small and pinned; layers import one way; light modules never import torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import shardkeep as sk

PACKAGE = Path(sk.__file__).parent

EXPECTED_ALL = [
    "CheckpointEntry",
    "CheckpointExistsError",
    "CheckpointFieldError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ConfigError",
    "CoordinationError",
    "DependencyError",
    "FingerprintMismatchError",
    "Incremental",
    "IntegrityError",
    "LOCAL",
    "LazyTensor",
    "LedgerError",
    "LedgerMismatchError",
    "LedgerStateError",
    "LoadSelection",
    "Manifest",
    "ManifestCorruptedError",
    "ManifestError",
    "ManifestFields",
    "ManifestVersionError",
    "PendingSave",
    "PlacementInfo",
    "ProgressLedger",
    "Restored",
    "RetentionError",
    "RetentionPolicy",
    "RunMismatchError",
    "SaveHandle",
    "SaveInProgressError",
    "ShardkeepError",
    "SignatureError",
    "StateMismatchError",
    "StorageError",
    "Tier",
    "TierBudgetError",
    "TierPlan",
    "TrainingCheckpoint",
    "UnknownOptionError",
    "UnsafePathError",
    "UnsupportedValueError",
    "ValidationResult",
    "VerifyReport",
    "WriteOptions",
    "__version__",
    "async_save",
    "iter_batches",
    "load",
    "load_batch",
    "read_manifest",
    "save",
    "save_batch",
    "validate_manifest",
    "verify",
]

DESIGN_TABLE = Path(__file__).resolve().parents[1] / "docs" / "concepts.md"


def _layer_table() -> tuple[list[str], dict[str, list[str]]]:
    """The layer order and the subpackages' modules, read from the module map in
    docs/concepts.md: the second column of each row lists modules bottom-up, in order; a
    subpackage (``name/``) lists its modules in parentheses."""
    text = DESIGN_TABLE.read_text()
    section = text[text.index("## The module map") :]
    order: list[str] = []
    subpackages: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].startswith("`"):
            continue
        for match in re.finditer(r"`([\w]+)(/?)`(?:\s*\(([^)]*)\))?", cells[1]):
            name, is_package, members = match.groups()
            order.append(name)
            if is_package:
                subpackages[name] = re.findall(r"`(\w+)`", members or "")
    return order, subpackages


# Lower layers first: a module may import the ones listed before it. Read from the doc.
LAYER_ORDER, SUBPACKAGES = _layer_table()

TORCH_FREE = [
    "shardkeep",
    "shardkeep.errors",
    "shardkeep.config",
    "shardkeep.names",
    "shardkeep.manifest",
    "shardkeep.storage",
    "shardkeep.storage.remote",
    "shardkeep.tiers",
    "shardkeep.integrity",
    "shardkeep.tensors.shardfile",
    "shardkeep.tensors.keys",
    "shardkeep.tensors.coverage",
    "shardkeep.io",
    "shardkeep.distributed.commit",
    "shardkeep.verification",
    "shardkeep.retention",
    "shardkeep.ledger",
    "shardkeep.catalog",
    "shardkeep.report",
    "shardkeep.cli",
]


def test_public_names_are_exactly_the_pinned_list() -> None:
    assert sorted(sk.__all__) == sorted(EXPECTED_ALL)
    for name in sk.__all__:
        assert getattr(sk, name) is not None, name


def test_every_error_derives_from_the_root() -> None:
    errors = [getattr(sk, name) for name in sk.__all__ if name.endswith("Error")]
    assert len(errors) >= 10
    for error in errors:
        assert issubclass(error, sk.ShardkeepError), error


def _top(module_path: Path) -> str:
    relative = module_path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def _shardkeep_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardkeep"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names if alias.name.startswith("shardkeep"))
    return found


def test_the_layer_table_lists_every_module() -> None:
    assert len(LAYER_ORDER) > 20 and LAYER_ORDER[0] == "errors", LAYER_ORDER
    assert len(set(LAYER_ORDER)) == len(LAYER_ORDER), "a module is listed twice"
    on_disk = {_top(path) for path in PACKAGE.rglob("*.py")}
    assert on_disk == set(LAYER_ORDER), "docs/concepts.md's module map and the package differ"
    for package, members in SUBPACKAGES.items():
        files = {path.stem for path in (PACKAGE / package).glob("*.py")} - {"__init__"}
        assert set(members) == files, f"docs/concepts.md lists {package}/ as {members}, on disk {sorted(files)}"


def test_every_module_states_its_responsibility() -> None:
    for path in PACKAGE.rglob("*.py"):
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring and len(docstring.split(".")[0]) >= 20, f"{path} has no docstring saying what it owns"


def test_layers_import_only_downwards() -> None:
    violations: list[str] = []
    for path in PACKAGE.rglob("*.py"):
        mine = _top(path)
        assert mine in LAYER_ORDER, f"{path} is not placed in a layer"
        for module in _shardkeep_imports(path):
            parts = module.split(".")
            theirs = parts[1] if len(parts) > 1 else "__init__"
            if theirs == mine and path.parent != PACKAGE:
                continue  # inside one subpackage
            if LAYER_ORDER.index(theirs) >= LAYER_ORDER.index(mine):
                violations.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert violations == []


def test_light_modules_import_without_torch_or_threads() -> None:
    program = (
        "import sys, threading, importlib\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = [m for m in ('torch', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True)


def test_no_grab_bag_modules() -> None:
    names = {path.stem for path in PACKAGE.rglob("*.py")}
    assert not names & {"utils", "helpers", "misc", "common"}
    assert not [n for n in names if n.endswith("_ops")]
