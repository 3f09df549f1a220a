"""The torch-free readers (``verification``, ``catalog``, the CLI) never import the distributed
package, nor torch: not when imported, and not while they read, verify and list checkpoints.
The names they need from below it (the coverage check, the attempt prefix) stay importable from
their old modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import shardkeep as sk

READERS = ("shardkeep.verification", "shardkeep.catalog", "shardkeep.cli")


def _run_isolated(program: str) -> dict[str, list[str]]:
    """Run ``program`` in a fresh interpreter; it prints a JSON object last."""
    done = subprocess.run([sys.executable, "-c", program], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]  # a JSON object


_REPORT = (
    "import json, sys\n"
    "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
    "distributed = sorted(m for m in sys.modules if m == 'shardkeep.distributed' or m.startswith('shardkeep.distributed.'))\n"
    "print(json.dumps({'torch': heavy, 'distributed': distributed}))\n"
)


def test_importing_the_readers_imports_neither_the_distributed_package_nor_torch() -> None:
    program = (
        "import contextlib, importlib, io\n"
        f"for name in {READERS!r}:\n"
        "    importlib.import_module(name)\n"
        "import shardkeep.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    shardkeep.cli.main(['--help'])\n"
    ) + _REPORT
    found = _run_isolated(program)
    assert found == {"torch": [], "distributed": []}


def test_reading_verifying_and_listing_import_neither(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sk.save({"w": torch.arange(6.0).reshape(2, 3), "step": 3}, root / "step_00000003", step=3)
    checkpoint = str(root / "step_00000003")
    program = (
        "import io\n"
        "import shardkeep as sk\n"
        "from shardkeep.catalog import CheckpointRoot\n"
        "from shardkeep.cli import main\n"
        f"assert sk.verify({checkpoint!r}).ok\n"
        f"assert sk.read_manifest({checkpoint!r}).step == 3\n"
        f"assert [entry.name for entry in CheckpointRoot.at({str(root)!r}).scan()] == ['step_00000003']\n"
        "for argv in (['verify', "
        f"{checkpoint!r}], ['inspect', {checkpoint!r}], ['ls', {str(root)!r}]):\n"
        "    assert main(argv, out=io.StringIO(), err=io.StringIO()) == 0, argv\n"
    ) + _REPORT
    found = _run_isolated(program)
    assert found == {"torch": [], "distributed": []}


def test_the_moved_names_are_still_importable_from_their_old_modules() -> None:
    from shardkeep.distributed.commit import ATTEMPT_PREFIX as commit_prefix
    from shardkeep.distributed.plan import coverage_problems as plan_coverage
    from shardkeep.storage import ATTEMPT_PREFIX
    from shardkeep.tensors.coverage import coverage_problems

    assert commit_prefix == ATTEMPT_PREFIX == "attempt-"
    assert plan_coverage is coverage_problems


def test_a_save_and_load_without_dtensors_never_imports_torch_distributed_tensor(tmp_path: Path) -> None:
    """torch.distributed.tensor costs about a second to import (it pulls in sympy): a fresh
    process that saves, loads (into= too), verifies and async-saves a state without DTensors
    never imports it. No DTensor can exist before it is imported, so nothing is missed."""
    program = (
        "import json, sys, torch\n"
        "import shardkeep as sk\n"
        "state = {'model': torch.nn.Linear(4, 2), 'w': torch.zeros(8), 'step': 3}\n"
        f"sk.save(state, {str(tmp_path / 'a')!r})\n"
        f"sk.load({str(tmp_path / 'a')!r})\n"
        f"sk.load({str(tmp_path / 'a')!r}, into=state)\n"
        f"assert sk.verify({str(tmp_path / 'a')!r}).ok\n"
        f"sk.async_save(state, {str(tmp_path / 'b')!r}).result(60)\n"
        "print(json.dumps({'dtensor': 'torch.distributed.tensor' in sys.modules, 'sympy': 'sympy' in sys.modules}))\n"
    )
    assert _run_isolated(program) == {"dtensor": False, "sympy": False}
