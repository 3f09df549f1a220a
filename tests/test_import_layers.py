"""The layers contract in pyproject.toml (``[tool.importlinter]``) holds: ``lint-imports`` finds
no import of a higher layer, and it does find one when a low module imports a high one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import shardkeep as sk

REPOSITORY = Path(__file__).resolve().parents[1]
SOURCE = Path(sk.__file__).resolve().parents[1]  # the src/ directory of the shardkeep under test
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint_imports(source: Path) -> subprocess.CompletedProcess[str]:
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} is missing: install the dev extra (pip install -e '.[dev]')"
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(REPOSITORY / "pyproject.toml"), "--no-cache"],
        cwd=source,
        env={**os.environ, "PYTHONPATH": str(source)},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_package_keeps_the_layers_contract() -> None:
    done = _lint_imports(SOURCE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout, done.stdout


def test_an_import_of_a_higher_layer_breaks_the_contract(tmp_path: Path) -> None:
    copy = tmp_path / "src"
    shutil.copytree(SOURCE / "shardkeep", copy / "shardkeep", ignore=shutil.ignore_patterns("__pycache__"))
    errors = copy / "shardkeep" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _upward() -> None:\n    import shardkeep.cli  # noqa: F401\n")
    done = _lint_imports(copy)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "BROKEN" in done.stdout and "shardkeep.errors -> shardkeep.cli" in done.stdout, done.stdout
