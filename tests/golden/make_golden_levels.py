"""How the golden node-local level in ``levels-v1/`` was made (run once; never regenerated).

Four gloo ranks on two simulated nodes (ranks 0-1 on node 0, 2-3 on node 1) save step 8 of
:func:`tests.support.states.row_sharded` to a node-local level with one peer replica, and wait
until the step is protected: each node's directory holds its own part, the replicas of the
other node's files, and a ``node-part.json`` (version 1 of that file) recording both.

    PYTHONPATH=src .venv/bin/python tests/golden/make_golden_levels.py
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent))


def _save(rank: int, world_size: int, root: str) -> int | None:
    from tests.support.states import row_sharded

    import shardkeep as sk

    level = sk.Level(
        "local",
        root + "/node{node}",
        node_local=True,
        replicas=1,
        retention=sk.RetentionPolicy(keep_last=1, keep_best=0),
    )
    manager = sk.MultiLevelManager([level], node_of=lambda r: r // 2, timeout=60)
    manager.save(row_sharded(8), step=8)
    protected = manager.wait_for_replicas()
    manager.close()
    return protected


def main() -> None:
    from tests.support.distributed_harness import results_or_raise, run_ranks

    target = HERE / "levels-v1"
    with tempfile.TemporaryDirectory() as scratch:
        protected: list[Any] = results_or_raise(run_ranks(4, _save, scratch, outbox=Path(scratch) / "out"))
        assert protected == [8, 8, 8, 8], protected
        if target.exists():
            shutil.rmtree(target)
        for node in (0, 1):
            shutil.copytree(Path(scratch) / f"node{node}", target / f"node{node}")


if __name__ == "__main__":
    main()
