"""Levels and their checks (shardkeep.levels.config) and the node map (shardkeep.levels.nodes):
each misconfiguration is refused with a typed error naming the level or the rank."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from shardkeep.cadence import SavePolicy
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import LevelConfigError, LevelUnreachableError, LevelWarning
from shardkeep.levels.config import Level, check_levels, normalized_root, probe_level, warn_if_network_filesystem
from shardkeep.levels.nodes import NODE_ENVIRONMENT, NodeMap, node_map, resolve
from shardkeep.retention import RetentionPolicy
from tests.support.distributed_harness import results_or_raise, run_ranks


def _local(root: str, every: int | None = 10, **kw: Any) -> Level:
    policy = SavePolicy(every_steps=every) if every else None
    return Level("local", root, node_local=True, save_policy=policy, retention=RetentionPolicy(keep_last=2), **kw)


def _persistent(root: str, every: int | None = 100, source: str = "drain", name: str = "persistent") -> Level:
    policy = SavePolicy(every_steps=every) if every else None
    return Level(name, root, save_policy=policy, source=source)  # type: ignore[arg-type]  # tables pass strings


# (levels as a function of tmp_path, the message's part that names the level(s) and the reason)
REFUSED = {
    "empty": (lambda t: [], "no levels"),
    "not a list": (lambda t: "local", "list of shardkeep.Level"),
    "duplicate name": (
        lambda t: [_local(f"{t}/l"), _persistent(f"{t}/p", name="local")],
        "'local'] are used twice",
    ),
    "same root": (
        lambda t: [_persistent(f"{t}/p", source="save", name="a"), _persistent(f"{t}/p/", source="save", name="b")],
        "levels 'a' and 'b' are on the same root",
    ),
    "same root through a symlink": (
        lambda t: [_persistent(f"{t}/p", source="save", name="a"), _persistent(f"{t}/link", source="save", name="b")],
        "levels 'a' and 'b' are on the same root",
    ),
    "nested roots": (
        lambda t: [_local(f"{t}/p/local"), _persistent(f"{t}/p")],
        "levels 'local' and 'persistent' are on nested roots",
    ),
    "a node's root inside the persistent root": (
        lambda t: [_local(f"{t}/n{{node}}"), _persistent(f"{t}/n1")],
        "levels 'local' and 'persistent' are on the same root",
    ),
    "same bucket and prefix": (
        lambda t: [
            _persistent("s3://b/run", source="save", name="a"),
            _persistent("s3://b/run/", source="save", name="b"),
        ],
        "levels 'a' and 'b' are on the same root",
    ),
    "nested prefixes": (
        lambda t: [
            _persistent("s3://b/run", source="save", name="a"),
            _persistent("s3://b/run/x", source="save", name="b"),
        ],
        "nested roots",
    ),
    "two node-local levels": (
        lambda t: [_local(f"{t}/a"), Level("ram", f"{t}/b", node_local=True)],
        "['local', 'ram'] are all node-local",
    ),
    "drain without a local level": (
        lambda t: [_persistent(f"{t}/p")],
        "level 'persistent': source='drain' copies the steps of a node-local level, and none is configured",
    ),
    "drain cadence not a multiple": (
        lambda t: [_local(f"{t}/l", every=10), _persistent(f"{t}/p", every=25)],
        "level 'persistent': every_steps=25 cannot be met by draining level 'local' (every_steps=10)",
    ),
    "node-local on a URL": (
        lambda t: [Level("local", "s3://b/x", node_local=True)],
        "level 'local': a node-local level needs a local path",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_misconfigured_list_of_levels_is_refused_naming_the_level(tmp_path: Path, case: str) -> None:
    (tmp_path / "p").mkdir()
    os.symlink(tmp_path / "p", tmp_path / "link")
    make, message = REFUSED[case]
    with pytest.raises(LevelConfigError, match=_literal(message)):
        check_levels(make(str(tmp_path)), node_count=2)
    assert sorted(os.listdir(tmp_path)) == ["link", "p"]  # nothing written


def _literal(text: str) -> str:
    import re

    return re.escape(text)


# (keyword arguments of Level, the message)
BAD_LEVELS = {
    "bad name": ({"name": "a/b", "root": "/x"}, "level name 'a/b'"),
    "empty name": ({"name": "", "root": "/x"}, "level name ''"),
    "bad source": ({"name": "p", "root": "/x", "source": "copy"}, "level 'p': source='copy'"),
    "bad policy": ({"name": "p", "root": "/x", "save_policy": 10}, "level 'p': save_policy="),
    "bad retention": ({"name": "p", "root": "/x", "retention": 3}, "level 'p': retention="),
    "bad root": ({"name": "p", "root": 3}, "level 'p': root=3"),
    "positional flag": ({"name": "p", "root": "/x", "node_local": "yes"}, "level 'p': node_local='yes'"),
    "per-node persistent": ({"name": "p", "root": "/x/{node}"}, "level 'p': a root given per node"),
    "callable persistent": ({"name": "p", "root": lambda n: "/x"}, "level 'p': a root given per node"),
    "drain into a local level": (
        {"name": "l", "root": "/x", "node_local": True, "source": "drain"},
        "level 'l': a node-local level is saved, never drained into",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LEVELS))
def test_a_bad_level_is_refused_naming_it(case: str) -> None:
    kwargs, message = BAD_LEVELS[case]
    with pytest.raises(LevelConfigError, match=_literal(message)):
        Level(**kwargs)


ACCEPTED = {
    "drain every multiple": lambda t: [_local(f"{t}/l", every=10), _persistent(f"{t}/p", every=100)],
    "drain by time": lambda t: [
        _local(f"{t}/l"),
        Level("p", f"{t}/p", save_policy=SavePolicy(every_seconds=600), source="drain"),
    ],
    "drain every local step": lambda t: [_local(f"{t}/l", every=None), _persistent(f"{t}/p", every=None)],
    "local by time, drain by steps": lambda t: [
        Level("local", f"{t}/l", node_local=True, save_policy=SavePolicy(every_seconds=60)),
        _persistent(f"{t}/p", every=7),
    ],
    "one persistent level": lambda t: [_persistent(f"{t}/p", source="save")],
    "sibling roots": lambda t: [_local(f"{t}/ckpt-local"), _persistent(f"{t}/ckpt")],
    "per-node roots": lambda t: [_local(f"{t}/l/node{{node}}"), _persistent(f"{t}/p")],
    "different buckets": lambda t: [
        _persistent("s3://a/run", source="save", name="a"),
        _persistent("s3://b/run", source="save", name="b"),
    ],
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_levels_that_can_work_pass_the_checks(tmp_path: Path, case: str) -> None:
    check_levels(ACCEPTED[case](str(tmp_path)), node_count=2)


def test_a_node_local_root_resolves_per_node(tmp_path: Path) -> None:
    assert _local(f"{tmp_path}/n{{node}}").root_of(3) == f"{tmp_path}/n3"
    assert Level("l", lambda n: tmp_path / f"x{n}", node_local=True).root_of(1) == f"{tmp_path}/x1"
    assert _local("relative").root_of(0) == os.path.abspath("relative")
    with pytest.raises(LevelConfigError, match="level 'l': root\\(node=2\\) failed"):
        Level("l", lambda n: 1 / 0, node_local=True).root_of(2)
    assert normalized_root("s3://b/run/") == ("s3", "b/run")


def test_probe_creates_a_missing_local_root_and_refuses_a_file(tmp_path: Path) -> None:
    probe_level(_persistent(str(tmp_path / "new" / "root"), source="save"))
    assert (tmp_path / "new" / "root").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(LevelUnreachableError, match=r"level 'persistent' at .*file.* is unreachable"):
        probe_level(_persistent(str(tmp_path / "file"), source="save"))
    with pytest.raises(LevelUnreachableError, match="level 'persistent'"):
        probe_level(_persistent(str(tmp_path / "file" / "below"), source="save"))


@pytest.mark.slow
def test_probe_refuses_a_missing_bucket(s3_root: tuple[str, dict[str, Any]]) -> None:
    root, options = s3_root
    reachable = Level("persistent", root, storage_options=options)
    probe_level(reachable)
    missing = Level("persistent", "s3://no-such-bucket-29/run", storage_options=options)
    with pytest.raises(
        LevelUnreachableError, match="level 'persistent' at 's3://no-such-bucket-29/run' is unreachable"
    ):
        probe_level(missing)


def test_a_node_local_level_on_a_network_filesystem_warns(tmp_path: Path) -> None:
    mountinfo = f"22 1 0:21 / / rw - ext4 /dev/sda1 rw\n40 22 0:35 / {tmp_path} rw,relatime - nfs4 server:/export rw\n"
    level = _local(f"{tmp_path}/local/node{{node}}")
    with pytest.warns(LevelWarning, match="level 'local' is node-local but its root .* is on a nfs4 filesystem"):
        assert warn_if_network_filesystem(level, 1, mountinfo=mountinfo)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_network_filesystem(level, 1, mountinfo="22 1 0:21 / / rw - ext4 /dev/sda1 rw\n")
        assert not warn_if_network_filesystem(_persistent(str(tmp_path)), 0, mountinfo=mountinfo)


# -- the node map ---------------------------------------------------------------------------------
NODE_TABLE = {
    "hostnames in order of first rank": ([("hostname", "b"), ("hostname", "a"), ("hostname", "b")], (0, 1, 0)),
    "explicit": ([("explicit", 0), ("explicit", 0), ("explicit", 1), ("explicit", 1)], (0, 0, 1, 1)),
    "environment text": ([("SHARDKEEP_NODE", "1"), ("SHARDKEEP_NODE", "0")], (1, 0)),
    "torchrun group rank": ([("GROUP_RANK", "0"), ("GROUP_RANK", "1")], (0, 1)),
}


@pytest.mark.parametrize("case", sorted(NODE_TABLE))
def test_the_node_map_from_every_source(case: str) -> None:
    gathered, expected = NODE_TABLE[case]
    assert resolve(list(gathered)).node_of == expected


NODE_ERRORS = {
    "negative": ([("explicit", 0), ("explicit", -1)], "rank 1: node id -1"),
    "not an integer": ([("SHARDKEEP_NODE", "0"), ("SHARDKEEP_NODE", "gpu7")], "rank 1: node id 'gpu7'"),
    "a bool": ([("explicit", True)], "rank 0: node id True"),
    "a node without ranks": ([("explicit", 0), ("explicit", 2)], "node(s) [1] have no rank"),
    "mixed sources": ([("explicit", 0), ("hostname", "a")], "different sources"),
    "node_of failed": ([("explicit", "<node_of failed for rank 0: KeyError: 0>")], "rank 0: node id"),
}


@pytest.mark.parametrize("case", sorted(NODE_ERRORS))
def test_a_bad_node_id_is_refused_naming_the_rank(case: str) -> None:
    gathered, message = NODE_ERRORS[case]
    with pytest.raises(LevelConfigError, match=_literal(message)):
        resolve(list(gathered))


def test_one_process_takes_its_node_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_ENVIRONMENT, "0")
    nodes = node_map(Coordinator())
    assert nodes.node_of == (0,) and nodes.source == NODE_ENVIRONMENT
    monkeypatch.delenv(NODE_ENVIRONMENT)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    assert node_map(Coordinator()).source == "hostname"
    assert node_map(Coordinator(), [0]).source == "explicit"
    with pytest.raises(LevelConfigError, match="rank 0"):
        node_map(Coordinator(), {})  # type: ignore[arg-type]  # a mapping without rank 0


def test_node_map_answers_ranks_and_leaders() -> None:
    nodes = NodeMap((1, 0, 1, 0))
    assert nodes.node_count == 2 and nodes.nodes == (0, 1) and nodes.world_size == 4
    assert nodes.ranks_of(1) == (0, 2) and nodes.leader(0) == 1 and nodes.is_leader(0) and not nodes.is_leader(2)
    with pytest.raises(LevelConfigError, match="node 5"):
        nodes.leader(5)


def _gather_nodes(rank: int, world_size: int, bad_rank: int | None) -> Any:
    os.environ[NODE_ENVIRONMENT] = "x" if rank == bad_rank else str(rank % 2)
    try:
        return node_map(Coordinator()).node_of
    except LevelConfigError as exc:
        return str(exc)


def test_every_rank_gets_the_same_node_map_or_the_same_error(tmp_path: Path) -> None:
    good = results_or_raise(run_ranks(4, _gather_nodes, None, outbox=tmp_path / "good"))
    assert good == [(0, 1, 0, 1)] * 4
    bad = results_or_raise(run_ranks(4, _gather_nodes, 3, outbox=tmp_path / "bad"))
    assert len(set(bad)) == 1 and "rank 3: node id 'x'" in bad[0]
