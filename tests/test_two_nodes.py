"""Two real nodes on one host: ``torchrun --nnodes 2 --nproc-per-node 2`` across two network
namespaces (tests/support/netns.py), each node with its own private local disk, the persistent
level on SeaweedFS listening on the bridge's host address.

One module-scoped harness and S3 server; tests/support/two_node_train.py saves every 2 steps on
the local level and drains every 4 to S3. Without replicas (``replicas=0``):

1. 2 nodes x 2 ranks train steps 1-11 from nothing: local holds 8 and 10 on each node's disk,
   persistent 4 and 8 on S3;
2. 2 nodes x 2 ranks resume at the newest local step (10) from their own disks, with the same
   state digest and the same losses as run 1, and train to 14 (local 12, 14; persistent 12);
3. 1 node x 2 ranks (node 1 gone, its disk unreachable) resumes at 12: node 0's part from its
   disk, node 1's from the persistent copy of the same step, resharded from 4 ranks to 2;
   its states are the same bytes as run 2's.

Node loss mid-run, without replicas: every process of node 1 gets ``kill -9`` while the job
trains and its disk is wiped; node 0's workers fail; relaunched with a fresh node 1, the local
steps newer than the newest persisted one are refused (node 1's files named) and the job resumes
at the newest persisted step with the state the killed job had there.

With ``replicas=1`` (skipped where this shardkeep has no peer replicas):

4. 2 nodes train to 15 (local 12, 14, each protected: its part on both nodes); node 1 is
   killed and its disk wiped; a fresh node 1 joins and the job resumes at 14, node 1's files
   sent by node 0 over the bridge, nothing read from S3;
5. 1 node x 2 ranks resumes at 14 from node 0's disk alone (its part and node 1's replica).

And the harness: each node sees only its own disk and the addresses the harness made; it
removes everything it made after a failing run, KeyboardInterrupt, SIGTERM, or a torchrun job
cut off at its deadline.

Needs root and network namespaces (CI runs as root): skipped with the reason where
``ip netns add`` fails; any failure after that probe fails the test.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import netns, s3server
from tests.support.two_node_train import supports_replicas

pytestmark = pytest.mark.slow  # three torchrun jobs on two namespaces, a SeaweedFS server

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "support" / "two_node_train.py"


needs_replicas = pytest.mark.skipif(
    not supports_replicas(), reason="peer replicas of node-local parts (Level(replicas=)) are not in this shardkeep"
)


def _require_namespaces() -> None:
    reason = netns.probe()
    if reason is not None:
        pytest.skip(f"two real nodes need network namespaces: {reason}")


class Cluster:
    """The harness, its S3 server, and each torchrun job's outcome per rank. A ``variant`` is
    one scenario: its own directory on every node's disk and its own bucket."""

    def __init__(self, nodes: netns.TwoNodes, server: s3server.S3Server, work: Path) -> None:
        self.nodes, self.server, self.work = nodes, server, work
        self.buckets: dict[str, str] = {}
        self.out = work / "out"
        self.out.mkdir()
        self.timings: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self.results: dict[str, list[dict[str, Any]]] = {}

    def start(
        self,
        tag: str,
        variant: str,
        *,
        last_step: int,
        nodes: tuple[int, ...],
        replicas: int,
        step_seconds: float = 0,
        timeout: float = 120,
    ) -> list[netns.NodeRun]:
        """Start the training script on ``nodes`` (2 ranks each), the local level on each node's
        disk under ``variant``, the persistent level in the variant's bucket."""
        if variant not in self.buckets:
            self.buckets[variant] = self.server.new_bucket(variant)
        bucket = self.buckets[variant]
        env = dict(os.environ)
        env.update(self.server.environment)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
        script = [
            str(SCRIPT),
            f"--disk-root={self.nodes.local}/{variant}",
            f"--s3-url=s3://{bucket}/run",
            f"--last-step={last_step}",
            f"--results={self.out}",
            f"--tag={tag}",
            f"--replicas={replicas}",
            f"--step-seconds={step_seconds}",
            f"--timeout={timeout}",
        ]
        self.started[tag] = time.monotonic()
        return self.nodes.start_torchrun(script, nodes=nodes, env=env)

    def finish(self, tag: str, runs: list[netns.NodeRun]) -> list[dict[str, Any]]:
        """Wait for the job; every launcher must succeed; each rank's outcome, in rank order."""
        self.nodes.wait(runs)
        self.timings[tag] = time.monotonic() - self.started[tag]
        assert all(run.process.returncode == 0 for run in runs), logs_of(runs)
        outcomes = [json.loads(path.read_text()) for path in sorted(self.out.glob(f"{tag}-rank*.json"))]
        assert [o["rank"] for o in outcomes] == list(range(2 * len(runs))), logs_of(runs)
        self.results[tag] = outcomes
        return outcomes

    def train(
        self, tag: str, variant: str, *, last_step: int, nodes: tuple[int, ...], replicas: int
    ) -> list[dict[str, Any]]:
        runs = self.start(tag, variant, last_step=last_step, nodes=nodes, replicas=replicas)
        return self.finish(tag, runs)

    def trace(self, tag: str) -> dict[int, dict[str, Any]]:
        """What rank 0 of job ``tag`` trained, step by step (written as it went)."""
        lines = (self.out / f"{tag}-trace.jsonl").read_text().splitlines()
        return {record["step"]: record for record in map(json.loads, lines)}

    def committed(self, node: int, variant: str) -> list[str]:
        """The committed local steps on ``node``'s disk."""
        root = self.nodes.disks[node] / variant
        if not root.is_dir():
            return []
        names = [p.name for p in root.iterdir() if re.fullmatch(r"step_\d+", p.name)]
        return sorted(name for name in names if (root / name / "manifest.json").is_file())

    def data_files(self, node: int, variant: str, step: int) -> set[str]:
        return {p.name for p in (self.nodes.disks[node] / variant / f"step_{step:08d}").rglob("*.safetensors")}

    def persistent_steps(self, variant: str) -> list[str]:
        """The committed steps of the persistent level (a manifest; not a drain cut off)."""
        filesystem = self.server.filesystem()
        listed = filesystem.ls(f"{self.buckets[variant]}/run", detail=False)
        return sorted(
            Path(p).name for p in listed if Path(p).name.startswith("step_") and filesystem.exists(f"{p}/manifest.json")
        )


def logs_of(runs: list[netns.NodeRun]) -> str:
    return "\n".join(f"--- node {run.node} ---\n{run.output()[-4000:]}" for run in runs)


def _step(name: str) -> int:
    return int(name.split("_")[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    _require_namespaces()
    work = tmp_path_factory.mktemp("two-nodes")
    with (
        netns.two_nodes(work / "nodes") as nodes,
        s3server.running(work / "s3", ip=nodes.host_address) as server,
    ):
        cluster = Cluster(nodes, server, work)
        yield cluster
        timings = {tag: round(seconds, 1) for tag, seconds in cluster.timings.items()}
        sys.stderr.write(f"two-node torchrun jobs, wall seconds: {json.dumps(timings)}\n")


def test_two_nodes_train_save_and_resume_at_the_newest_local_step(cluster: Cluster) -> None:
    first = cluster.train("run1", "plain", last_step=11, nodes=(0, 1), replicas=0)
    assert all(o["restored"] is None and o["world"] == 4 for o in first)
    assert sorted({o["node"] for o in first}) == [0, 1]
    for node in (0, 1):
        assert cluster.committed(node, "plain") == ["step_00000008", "step_00000010"]
    # each disk holds only its own node's data files
    data = [cluster.data_files(node, "plain", 10) for node in (0, 1)]
    assert data[0] and data[1] and not data[0] & data[1]
    assert cluster.persistent_steps("plain") == ["step_00000004", "step_00000008"]

    second = cluster.train("run2", "plain", last_step=14, nodes=(0, 1), replicas=0)
    for outcome in second:
        restored = outcome["restored"]
        assert restored["step"] == 10 and restored["state_step"] == 10, restored
        assert set(restored["source"].values()) == {"local"}, restored
        # from the nodes' own disks; a file one node's ranks need and only the other node holds
        # (rank 0's optimizer file, with the replicated step counters) crosses the bridge
        assert restored["levels_read"] == ["local"], restored
        assert all(source.startswith("local@node") for _, _, source in restored["healed"]), restored
        assert restored["digest"] == first[0]["digests"]["10"]
    # the resumed run's step 11 is the first run's, bit for bit
    assert second[0]["losses"]["11"] == first[0]["losses"]["11"]
    assert second[0]["digests"]["11"] == first[0]["digests"]["11"]
    for node in (0, 1):
        assert cluster.committed(node, "plain") == ["step_00000012", "step_00000014"]
    assert cluster.persistent_steps("plain") == ["step_00000004", "step_00000008", "step_00000012"]


def test_one_node_resumes_from_its_disk_and_the_persistent_level(cluster: Cluster) -> None:
    second = cluster.results.get("run2")
    if second is None:
        pytest.fail("the two-node run did not complete (see the test before)")
    cluster.nodes.kill_node(1)
    third = cluster.train("run3", "plain", last_step=13, nodes=(0,), replicas=0)
    for outcome in third:
        assert outcome["world"] == 2
        restored = outcome["restored"]
        # step 14 has no copy of node 1's part: refused, named
        assert any(r[0] == "14" for r in restored["refused"]), restored
        assert restored["step"] == 12, restored
        assert restored["digest"] == second[0]["digests"]["12"], "resharded 4 -> 2 ranks, same state"
        assert "persistent" in restored["levels_read"], restored
    assert third[0]["digests"]["13"] == second[0]["digests"]["13"]
    assert math.isclose(third[0]["losses"]["13"], second[0]["losses"]["13"], rel_tol=1e-6)


def test_a_node_killed_mid_run_and_replaced_falls_back_to_the_newest_persisted_step(cluster: Cluster) -> None:
    """``kill -9`` of every process of node 1 while the job trains, and its disk wiped: node 0's
    workers fail (their peer is gone) and the job ends. Relaunched with a fresh node 1 and no
    replicas, the newer local steps lack node 1's part: each is refused, naming the file and the
    node, and the job resumes at the newest persisted step with the state it had there."""
    # a short collective deadline: a survivor blocked in a collective with a dead peer fails then
    runs = cluster.start("kill1", "killed", last_step=400, nodes=(0, 1), replicas=0, step_seconds=0.05, timeout=20)
    deadline = time.monotonic() + 180
    while not any(_step(name) >= 12 for name in cluster.committed(0, "killed")):
        assert time.monotonic() < deadline and all(run.process.poll() is None for run in runs), logs_of(runs)
        time.sleep(0.1)
    killed = time.monotonic()
    cluster.nodes.kill_node(1)
    shutil.rmtree(cluster.nodes.disks[1] / "killed")
    cluster.nodes.wait(runs, timeout=150)
    cluster.timings["kill1: node 0 ended after the kill"] = time.monotonic() - killed
    assert runs[0].process.returncode != 0, "node 0's workers fail when node 1 dies"
    assert not list(cluster.out.glob("kill1-rank*.json")), "the killed job never finished"
    trained = cluster.trace("kill1")
    local = [_step(name) for name in cluster.committed(0, "killed")]
    persisted = max(_step(name) for name in cluster.persistent_steps("killed"))
    lost = [step for step in local if step > persisted]

    resumed = cluster.train("kill2", "killed", last_step=max(local) + 1, nodes=(0, 1), replicas=0)
    for outcome in resumed:
        restored = outcome["restored"]
        assert restored["step"] == persisted, (restored, local, persisted)
        assert restored["digest"] == trained[persisted]["digest"], "the state the killed job had at that step"
        for step in lost:
            reasons = [reason for s, _, level, reason in restored["refused"] if s == str(step) and level == "local"]
            assert any("missing on node 1" in reason for reason in reasons), (step, restored["refused"])
    assert resumed[0]["digests"][str(persisted + 1)] == trained[persisted + 1]["digest"]
    assert resumed[0]["losses"][str(persisted + 1)] == trained[persisted + 1]["loss"]


def _replicas_of(cluster: Cluster, node: int, step: int) -> dict[str, list[str]]:
    part = cluster.nodes.disks[node] / "replicated" / f"step_{step:08d}" / "node-part.json"
    return dict(json.loads(part.read_text()).get("replicas") or {})


@needs_replicas
def test_a_replaced_node_resumes_from_the_replica_on_its_peer(cluster: Cluster) -> None:
    """With replicas=1 each node's part of each local step is also on the other node. Node 1 is
    lost with its disk and replaced by a fresh node: the job resumes at the newest local step,
    node 1's files coming from node 0 over the bridge; nothing is read from S3."""
    first = cluster.train("rep1", "replicated", last_step=15, nodes=(0, 1), replicas=1)
    for node in (0, 1):
        assert cluster.committed(node, "replicated") == ["step_00000012", "step_00000014"]
        # step 14 is protected: each node's part lists its replica of the other node's files
        assert sorted(_replicas_of(cluster, node, 14)) == [str(1 - node)], node
    both = [cluster.data_files(node, "replicated", 14) for node in (0, 1)]
    assert both[0] == both[1], "each node holds its own part and the other's replica"
    cluster.nodes.kill_node(1)
    shutil.rmtree(cluster.nodes.disks[1] / "replicated")  # the node is gone with its disk

    second = cluster.train("rep2", "replicated", last_step=15, nodes=(0, 1), replicas=1)
    for outcome in second:
        restored = outcome["restored"]
        assert restored["step"] == 14, restored
        assert restored["levels_read"] == ["local"], "nothing read from the persistent level"
        assert {source for _, _, source in restored["healed"]} == {"local@node0"}, restored
        assert restored["digest"] == first[0]["digests"]["14"]
    assert second[0]["losses"]["15"] == first[0]["losses"]["15"]
    assert second[0]["digests"]["15"] == first[0]["digests"]["15"]


@needs_replicas
def test_one_node_resumes_at_the_newest_local_step_from_its_replicas(cluster: Cluster) -> None:
    """Node 1 gone for good: 2 ranks on node 0 resume at step 14 from node 0's disk alone (its
    own part and node 1's replica), resharded from 4 ranks to 2, with nothing read from S3."""
    first = cluster.results.get("rep1")
    if first is None:
        pytest.fail("the replicated two-node run did not complete (see the test before)")
    cluster.nodes.kill_node(1)
    third = cluster.train("rep3", "replicated", last_step=15, nodes=(0,), replicas=0)
    for outcome in third:
        restored = outcome["restored"]
        assert restored["step"] == 14 and restored["levels_read"] == ["local"], restored
        assert restored["healed"] == [] and restored["refused"] == [], restored
        assert restored["digest"] == first[0]["digests"]["14"]
    assert third[0]["digests"]["15"] == first[0]["digests"]["15"]
    assert math.isclose(third[0]["losses"]["15"], first[0]["losses"]["15"], rel_tol=1e-6)


def test_each_node_sees_its_own_disk_and_only_the_harness_addresses(tmp_path: Path) -> None:
    _require_namespaces()
    with netns.two_nodes(tmp_path / "nodes") as nodes:
        for node, disk in enumerate(nodes.disks):
            (disk / f"only-on-node{node}").write_text("x")
        script = f"ls {nodes.local}; echo --; ls -A {nodes.work / 'disks'}; echo --; ip -4 -o addr show"
        runs = [nodes.start(node, ["sh", "-c", script]) for node in (0, 1)]
        for node, run in enumerate(runs):
            assert run.process.wait(30) == 0, run.output()
            local, hidden, addresses = run.output().split("--\n")
            assert local.split() == [f"only-on-node{node}"]
            assert hidden.split() == [], "the other node's disk is hidden"
            interfaces = sorted((line.split()[1], line.split()[3]) for line in addresses.splitlines())
            assert interfaces == [(netns.NODE_IFNAME, f"{nodes.addresses[node]}/24"), ("lo", "127.0.0.1/8")]
        assert sorted(p.name for p in nodes.local.iterdir()) == [], "mounts do not leak to the host"


_TERMINATED = """import os, sys, time
from pathlib import Path
from tests.support import netns
with netns.two_nodes(Path(sys.argv[1])) as nodes:
    nodes.start(1, ["sleep", "300"])
    print(nodes.tag, flush=True)
    time.sleep(300)
"""


def test_sigterm_to_the_test_process_removes_the_nodes(tmp_path: Path) -> None:
    _require_namespaces()
    work = tmp_path / "nodes"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    process = subprocess.Popen(
        [sys.executable, "-c", _TERMINATED, str(work)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        tag = process.stdout.readline().strip()
        assert tag.startswith("skn"), process.stderr.read() if process.stderr else ""
        process.send_signal(signal.SIGTERM)
        _, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0 and "SIGTERM while two nodes were up" in errors, errors
    _assert_nothing_left(tag, work)


_STUCK = """import os, sys, time
import torch.distributed as dist
if os.environ["GROUP_RANK"] == "1":
    sys.exit("node 1 fails at once")
dist.init_process_group("gloo")  # node 0's ranks wait for node 1's, which never come
time.sleep(300)
"""


def _assert_nothing_left(tag: str, work: Path) -> None:
    assert netns.leftovers_of(tag, work) == {"namespaces": [], "links": [], "mounts": [], "processes": []}
    alive = subprocess.run(["pgrep", "-f", f"{tag}-n"], capture_output=True, text=True)
    assert alive.stdout.strip() == "", alive.stdout


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_the_harness_leaves_nothing_after_a_failing_run(tmp_path: Path, failure: type[BaseException]) -> None:
    """Processes in both namespaces and an exception (or Ctrl-C) in the test: no namespace, link,
    mount or process of the run is left."""
    _require_namespaces()
    with pytest.raises(failure), netns.two_nodes(tmp_path / "nodes") as nodes:
        tag, work = nodes.tag, nodes.work
        sleepers = [nodes.start(node, ["sleep", "300"]) for node in (0, 1)]
        assert nodes.start(0, ["sh", "-c", "exit 3"]).process.wait(30) == 3
        deadline = time.monotonic() + 10
        while len(netns.leftovers_of(tag, work)["processes"]) < 2:
            assert time.monotonic() < deadline, "the sleepers never started"
            time.sleep(0.1)
        assert len(netns.leftovers_of(tag, work)["namespaces"]) == 2
        raise failure("an injected failure")
    assert all(sleeper.process.poll() is not None for sleeper in sleepers)
    _assert_nothing_left(tag, work)


def test_a_torchrun_job_cut_off_at_its_deadline_leaves_nothing(tmp_path: Path) -> None:
    """Node 1 fails at once, node 0's workers wait for it: the harness kills the job at its
    deadline, says so with both logs, and removes everything. (The deadline is set once node
    1's launcher has ended: the job is stuck from then on, and waiting longer only waits.)"""
    _require_namespaces()
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK)
    with (
        pytest.raises(netns.NetnsError, match="did not finish within 2 s") as raised,
        netns.two_nodes(tmp_path / "nodes") as nodes,
    ):
        tag, work = nodes.tag, nodes.work
        runs = nodes.start_torchrun([str(script)])
        deadline = time.monotonic() + 120
        while runs[1].process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runs[1].process.returncode not in (None, 0), logs_of(runs)
        assert runs[0].process.poll() is None, logs_of(runs)
        nodes.wait(runs, timeout=2)
    assert "node 1 fails at once" in str(raised.value)
    _assert_nothing_left(tag, work)
