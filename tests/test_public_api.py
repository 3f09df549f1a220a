"""The public API is small and pinned; layers import one way (in the order of pyproject.toml's
layers contract, which docs/concepts.md's module map follows); light modules never import torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import shardkeep as sk

PACKAGE = Path(sk.__file__).parent

EXPECTED_ALL = [
    "CheckpointDataError",
    "CheckpointEntry",
    "CheckpointExistsError",
    "CheckpointFieldError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitRefusedError",
    "ConfigError",
    "CoordinationError",
    "DependencyError",
    "DrainError",
    "FingerprintMismatchError",
    "Incremental",
    "IntegrityError",
    "LOCAL",
    "LazyTensor",
    "LedgerCorruptedError",
    "LedgerError",
    "LedgerMismatchError",
    "LedgerStateError",
    "Level",
    "LevelConfigError",
    "LevelUnreachableError",
    "LevelWarning",
    "LevelsRestored",
    "LevelsSaveResult",
    "ManagerError",
    "LoadSelection",
    "Manifest",
    "ManifestCorruptedError",
    "ManifestError",
    "ManifestFields",
    "ManifestVersionError",
    "MultiLevelManager",
    "NoCompleteStepError",
    "PendingSave",
    "PlacementError",
    "PreemptionHandlerError",
    "PlacementInfo",
    "ProgressLedger",
    "Restored",
    "RetentionError",
    "RetentionPolicy",
    "RetryPolicy",
    "RunMismatchError",
    "SaveHandle",
    "SavePolicy",
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
    "UsageError",
    "ValidationResult",
    "VerifyReport",
    "WriteOptions",
    "__version__",
    "async_save",
    "iter_batches",
    "load",
    "load_batch",
    "load_slice",
    "read_manifest",
    "save",
    "save_batch",
    "validate_manifest",
    "verify",
]

REPOSITORY = Path(__file__).resolve().parents[1]
MODULE_MAP = REPOSITORY / "docs" / "concepts.md"


def _layers_contract() -> dict[str, Any]:
    """The layers contract in pyproject.toml (``[tool.importlinter]``), the source of the order."""
    config = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    assert contract["containers"] == ["shardkeep"], contract["containers"]
    return dict(contract)


def _layer_order() -> list[str]:
    """Lower layers first: a module may import the ones listed before it. The contract lists the
    top-level modules highest first; the package's own ``__init__`` (the lazy public namespace,
    which import-linter treats as the container) sits under ``__main__``."""
    order = list(reversed(_layers_contract()["layers"]))
    assert order[-1] == "__main__", order
    return [*order[:-1], "__init__", "__main__"]


def _module_map() -> tuple[list[str], dict[str, list[str]]]:
    """The modules docs/concepts.md's module map lists, in its order, and the subpackages'
    modules: the second column of each row lists modules bottom-up; a subpackage (``name/``)
    lists its modules in parentheses, and a subpackage inside it (``name/inner/``) its own, in
    parentheses after it."""
    text = MODULE_MAP.read_text()
    section = text[text.index("## The module map") :]
    order: list[str] = []
    subpackages: dict[str, list[str]] = {}
    package = r"`(\w+)(/?)`(?:\s*\(((?:[^()]|\([^()]*\))*)\))?"
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].startswith("`"):
            continue
        for match in re.finditer(package, cells[1]):
            name, is_package, members = match.groups()
            order.append(name)
            if is_package:
                subpackages[name] = []
                for member in re.finditer(package, members or ""):
                    inner, inner_is_package, inner_members = member.groups()
                    subpackages[name].append(inner)
                    if inner_is_package:
                        subpackages[f"{name}/{inner}"] = re.findall(r"`(\w+)`", inner_members or "")
    return order, subpackages


LAYER_ORDER = _layer_order()
#: Imports the contract allows against the order (old import paths of moved modules).
IGNORED_IMPORTS = {tuple(rule.split(" -> ")) for rule in _layers_contract().get("ignore_imports", [])}

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
    "shardkeep.writes",
    "shardkeep.distributed.commit",
    "shardkeep.verification",
    "shardkeep.retention",
    "shardkeep.ledger",
    "shardkeep.catalog",
    "shardkeep.report",
    "shardkeep.testing",
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


def test_the_layer_contract_places_every_module() -> None:
    assert len(LAYER_ORDER) > 20 and LAYER_ORDER[0] == "errors", LAYER_ORDER
    assert len(set(LAYER_ORDER)) == len(LAYER_ORDER), "a module is listed twice"
    on_disk = {_top(path) for path in PACKAGE.rglob("*.py")}
    assert on_disk == set(LAYER_ORDER), "pyproject.toml's layers contract and the package differ"


def test_the_module_map_lists_the_contracts_modules_in_its_order() -> None:
    documented, subpackages = _module_map()
    assert documented == LAYER_ORDER, "docs/concepts.md's module map and pyproject.toml's layers differ"
    for package, members in subpackages.items():
        files = {path.stem for path in (PACKAGE / package).glob("*.py")} - {"__init__"}
        files |= {path.parent.name for path in (PACKAGE / package).glob("*/__init__.py")}
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
        importer = ".".join(["shardkeep", *path.relative_to(PACKAGE).with_suffix("").parts]).removesuffix(".__init__")
        for module in _shardkeep_imports(path):
            if (importer, module) in IGNORED_IMPORTS:
                continue
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


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` (``shardkeep.x.y``) names a module or package of this package."""
    relative = PACKAGE.joinpath(*dotted.split(".")[1:])
    return relative.with_suffix(".py").is_file() or (relative / "__init__.py").is_file()


def _private_imports(path: Path, source: str | None = None) -> list[str]:
    """Where the module at ``path`` (its text, or ``source``) takes another module's
    ``_private`` name: ``from shardkeep.x import _y`` (or a relative ``from .x import _y``), or
    ``m._y`` where ``m`` is a shardkeep module it imported."""
    tree = ast.parse(path.read_text() if source is None else source)
    found: list[str] = []
    modules: dict[str, str] = {}  # local name -> the shardkeep module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[: -node.level])
                source = f"{package}.{node.module}" if node.module else package
            else:
                source = node.module or ""
            if not source.startswith("shardkeep"):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"line {node.lineno}: from {source} import {alias.name}")
                elif _is_module(f"{source}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shardkeep"):
                    local = alias.asname or alias.name.split(".")[0]
                    modules[local] = alias.name if alias.asname else alias.name.split(".")[0]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"line {node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_takes_another_modules_private_names() -> None:
    """A ``_name`` is private to its module: another module (in ``src/``) that needs it needs
    a public name instead."""
    violations = [
        f"{path.relative_to(PACKAGE)} {where}" for path in PACKAGE.rglob("*.py") for where in _private_imports(path)
    ]
    assert violations == []


def test_the_private_import_check_finds_every_spelling() -> None:
    """The check above sees each spelling of taking another module's private name."""
    source = (
        "from shardkeep.catalog import _Found\n"
        "import shardkeep.saving as saving\n"
        "from shardkeep import api\n"
        "from .storage import _local\n"
        "saving._hidden, api._run, api.__name__, saving.SaveJob\n"
    )
    assert _private_imports(PACKAGE / "probe.py", source) == [
        "line 1: from shardkeep.catalog import _Found",
        "line 4: from shardkeep.storage import _local",
        "line 5: shardkeep.saving._hidden",
        "line 5: shardkeep.api._run",
    ]
