"""Two "nodes" on one Linux host: two network namespaces joined by a bridge, each with its own
private "local disk", for running ``torchrun --nnodes 2`` for real (docs/levels.md, "Two real
nodes").

:func:`two_nodes` builds, per run:

- a bridge ``<tag>br`` on the host with ``10.213.<x>.254/24`` (``<x>`` chosen per run among
  the /24s no interface or route on the host uses), where the host-side servers (SeaweedFS)
  listen;
- per node ``i``: a network namespace ``<tag>-n<i>`` whose only interfaces are ``lo`` and
  ``lan0`` (``10.213.<x>.<i+1>``, the same NIC name on every node, a veth into the bridge);
- per node a directory ``<work>/disks/node<i>``. Every command of node ``i`` runs through
  ``ip netns exec`` (which gives it its own mount namespace) after bind-mounting that directory
  on ``<work>/local`` (the same path on every node: the node's "local disk") and covering
  ``<work>/disks`` with an empty tmpfs (the other node's disk cannot be seen).

Once built, each node must reach the host address and the other node over TCP
(:meth:`TwoNodes.check_reachable`; a firewall dropping bridged traffic fails here, named).
:meth:`TwoNodes.torchrun` runs one launcher per node: the c10d rendezvous on node 0's address
(its launcher hosts the store), ``--local-addr`` the node's address (the namespaces share the
host name, which resolves to 127.0.0.1), ``GLOO_SOCKET_IFNAME=lan0`` and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a replaced node would deadlock on the next
rendezvous otherwise).

Nothing binds outside these addresses or 127.0.0.1: inside a namespace the only interfaces are
``lo`` and ``lan0``. Cleanup (on success, on failure, on ``KeyboardInterrupt``, on SIGTERM,
which raises :class:`Terminated` on the main thread while the nodes are up) kills every
process of each namespace (``kill -9`` of ``ip netns pids``, then waits until they are gone),
deletes the namespaces, the veths and the bridge, with SIGINT and SIGTERM held until it ends;
the mounts die with their mount namespaces.
A run cut off before its cleanup (the pytest process killed) is swept by the next run: names
carry the creating process's id, and objects of a dead process are removed.

:func:`probe` tries once whether namespaces can be made here (root, ``ip``, ``mount``,
``ip netns add``, a bridge); a test skips with its reason. Any later failure is an error.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NODE_IFNAME", "NetnsError", "NodeRun", "Terminated", "TwoNodes", "leftovers_of", "probe", "two_nodes"]

#: The interface name of every node's link to the bridge.
NODE_IFNAME = "lan0"
#: The rendezvous port on node 0's address (free: the namespace is new).
RDZV_PORT = 29400
_CHECK_PORT = 29399  # check_reachable's listeners, away from the rendezvous port
_PREFIX = "skn"  # names: skn<pid><letter>; interface names stay <= 15 characters
_NAME = re.compile(rf"^{_PREFIX}(\d+)([a-z])(?:br|h\d|c\d|-n\d)$")
_counter = itertools.count()

# Run in each node's own mount namespace (given by `ip netns exec`) before the node's command.
_NODE_SHELL = """set -e
mount --bind "$1" "$2"
mount -t tmpfs -o size=1m,mode=0755 hidden "$3"
shift 3
exec "$@"
"""


# A listener a node runs for check_reachable, and the dialer that connects to the others.
_LISTEN = """import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
server.settimeout(60)
while True:
    server.accept()[0].close()
"""
_DIAL = """import socket, sys, time
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                sys.exit(f"{target}: {exc}")
            time.sleep(0.05)
"""


class NetnsError(RuntimeError):
    """A step of building, running or removing the two nodes failed (with the command's output)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


@functools.cache
def probe() -> str | None:
    """``None`` when two namespaces can be made on this host; otherwise why not (tried once per
    process: root, ``ip`` and ``mount`` present, ``ip netns add`` and a bridge work)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN); CI runs as root"
    for tool in ("ip", "mount"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is missing (iproute2 / util-linux)"
    tag = f"{_PREFIX}{os.getpid()}z"
    try:
        made = _run("ip", "netns", "add", f"{tag}-n0", check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        bridge = _run("ip", "link", "add", f"{tag}br", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"`ip link add type bridge` failed: {bridge.stderr.strip()}"
        return None
    finally:
        _run("ip", "netns", "del", f"{tag}-n0", check=False)
        _run("ip", "link", "del", f"{tag}br", check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    names = []
    for line in _run("ip", "-o", "link", "show").stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def _kill_namespace(namespace: str, *, timeout: float = 20.0) -> list[int]:
    """``kill -9`` every process in ``namespace`` and wait until none is left; returns the pids
    still alive at the deadline (none, normally)."""
    deadline = time.monotonic() + timeout
    while True:
        listed = _run("ip", "netns", "pids", namespace, check=False)
        pids = [int(pid) for pid in listed.stdout.split()] if listed.returncode == 0 else []
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _remove(tag: str, node_count: int) -> list[str]:
    """Remove every object of the run ``tag``; returns what could not be removed."""
    problems = []
    for index in range(node_count):
        namespace = f"{tag}-n{index}"
        if namespace in _namespaces():
            left = _kill_namespace(namespace)
            if left:
                problems.append(f"processes {left} of {namespace} survived kill -9")
            done = _run("ip", "netns", "del", namespace, check=False)
            if done.returncode != 0:
                problems.append(f"ip netns del {namespace}: {done.stderr.strip()}")
    for name in [*(f"{tag}h{index}" for index in range(node_count)), f"{tag}br"]:
        # a veth goes with its peer's namespace, asynchronously: gone before or during the del
        if name in _links():
            done = _run("ip", "link", "del", name, check=False)
            if done.returncode != 0 and name in _links():
                problems.append(f"ip link del {name}: {done.stderr.strip()}")
    deadline = time.monotonic() + 10
    while any(name.startswith(tag) for name in _links()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return problems


def sweep_stale() -> list[str]:
    """Remove the namespaces and links of earlier runs whose process is gone (a run killed
    before its cleanup); returns their names."""
    stale = set()
    for name in [*_namespaces(), *_links()]:
        found = _NAME.match(name)
        if found and not _pid_alive(int(found.group(1))):
            stale.add(f"{_PREFIX}{found.group(1)}{found.group(2)}")
    removed = []
    for tag in sorted(stale):
        _remove(tag, 2)
        removed.append(tag)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.213.<x>.0/24 that overlaps no address or route on the host, picked from the pid."""
    used = []
    for line in (
        _run("ip", "-4", "-o", "addr", "show").stdout.splitlines()
        + _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines()
    ):
        for word in line.split():
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(word, strict=False))
    start = (os.getpid() + next(_counter)) % 250
    for offset in range(250):
        subnet = ipaddress.IPv4Network(f"10.213.{(start + offset) % 250}.0/24")
        if not any(subnet.overlaps(other) for other in used if other.prefixlen > 0):
            return subnet
    raise NetnsError("no free 10.213.x.0/24 on this host")


@dataclass
class NodeRun:
    """One node's command: its process (the launcher) and its log file."""

    node: int
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class TwoNodes:
    """The running harness: ``node_count`` namespaces on ``subnet``; ``host_address`` is the
    bridge's (host side); ``addresses[i]`` node ``i``'s; ``disks[i]`` node ``i``'s local disk as
    the host sees it; ``local`` the path where each node sees its own disk."""

    work: Path
    tag: str
    subnet: ipaddress.IPv4Network
    node_count: int
    runs: list[NodeRun] = field(default_factory=list)
    _launches: Iterator[int] = field(default_factory=itertools.count)

    @property
    def host_address(self) -> str:
        return str(self.subnet[254])

    @property
    def addresses(self) -> list[str]:
        return [str(self.subnet[index + 1]) for index in range(self.node_count)]

    @property
    def disks(self) -> list[Path]:
        return [self.work / "disks" / f"node{index}" for index in range(self.node_count)]

    @property
    def local(self) -> Path:
        return self.work / "local"

    def namespace(self, node: int) -> str:
        return f"{self.tag}-n{node}"

    def build(self) -> None:
        bridge = f"{self.tag}br"
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.host_address}/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        for index, address in enumerate(self.addresses):
            namespace, host_end, node_end = self.namespace(index), f"{self.tag}h{index}", f"{self.tag}c{index}"
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            _run("ip", "link", "set", node_end, "netns", namespace)
            _run("ip", "-n", namespace, "link", "set", node_end, "name", NODE_IFNAME)
            _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", NODE_IFNAME)
            _run("ip", "-n", namespace, "link", "set", NODE_IFNAME, "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            _run("ip", "link", "set", host_end, "master", bridge)
            _run("ip", "link", "set", host_end, "up")
            self.disks[index].mkdir(parents=True, exist_ok=True)
        self.local.mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)

    def check_reachable(self, timeout: float = 20.0) -> None:
        """Each node reaches the host address and every other node over the bridge (a TCP
        connection to a listener there); a :class:`NetnsError` says which pair failed. Bridged
        traffic is dropped on hosts with ``bridge-nf-call-iptables=1`` and a FORWARD DROP
        policy (Docker hosts): allow the bridge there."""
        with socket.socket() as host:
            host.bind((self.host_address, 0))
            host.listen(8)
            port = host.getsockname()[1]
            listeners = [
                self.start(node, [sys.executable, "-c", _LISTEN, self.addresses[node], str(_CHECK_PORT)])
                for node in range(self.node_count)
            ]
            targets = [(self.host_address, port)] + [(address, _CHECK_PORT) for address in self.addresses]
            dialers = []
            for node in range(self.node_count):
                wanted = [f"{a}:{p}" for a, p in targets if a != self.addresses[node]]
                dialers.append((node, wanted, self.start(node, [sys.executable, "-c", _DIAL, *wanted])))
            for node, wanted, run in dialers:
                try:
                    code = run.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    code = None
                if code != 0:
                    raise NetnsError(
                        f"node {node} cannot reach {wanted} over the bridge {self.tag}br (bridged traffic "
                        f"dropped? with bridge-nf-call-iptables=1 and a FORWARD DROP policy, allow the bridge):\n"
                        f"{run.output()[-2000:]}"
                    )
            for listener in listeners:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(listener.process.pid, signal.SIGKILL)
                listener.process.wait(10)
            self.runs.clear()

    def start(self, node: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> NodeRun:
        """Start ``argv`` on ``node`` (in its namespaces, its disk on :attr:`local`), output to a
        log under ``<work>/logs``."""
        log = self.work / "logs" / f"{next(self._launches):02d}-node{node}.log"
        command = [
            "ip",
            "netns",
            "exec",
            self.namespace(node),
            "bash",
            "-c",
            _NODE_SHELL,
            "node-shell",
            str(self.disks[node]),
            str(self.local),
            str(self.work / "disks"),
            *argv,
        ]
        with open(log, "wb") as out:
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=dict(env or os.environ), start_new_session=True
            )
        run = NodeRun(node, process, log)
        self.runs.append(run)
        return run

    def torchrun(
        self,
        script: Sequence[str],
        *,
        nodes: Sequence[int] = (0, 1),
        nproc_per_node: int = 2,
        env: Mapping[str, str] | None = None,
        timeout: float = 240.0,
    ) -> list[NodeRun]:
        """Run ``torchrun --nnodes len(nodes) --nproc-per-node ...`` on each of ``nodes`` (see
        :meth:`start_torchrun`) and wait for every launcher (:meth:`wait`)."""
        runs = self.start_torchrun(script, nodes=nodes, nproc_per_node=nproc_per_node, env=env)
        return self.wait(runs, timeout=timeout)

    def start_torchrun(
        self,
        script: Sequence[str],
        *,
        nodes: Sequence[int] = (0, 1),
        nproc_per_node: int = 2,
        env: Mapping[str, str] | None = None,
    ) -> list[NodeRun]:
        """Start one ``torchrun`` launcher on each of ``nodes``: the c10d rendezvous on the
        first node's address (its launcher hosts the store), ``--local-addr`` the node's address,
        gloo on ``lan0``, no restarts."""
        environment = dict(env or os.environ)
        environment.update(
            {"GLOO_SOCKET_IFNAME": NODE_IFNAME, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
        )
        host = self.addresses[nodes[0]]
        rdzv_id = f"{self.tag}-{next(self._launches)}"
        runs = []
        for order, node in enumerate(nodes):
            launcher = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={len(nodes)}",
                f"--nproc-per-node={nproc_per_node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={host}:{RDZV_PORT}",
                f"--rdzv-id={rdzv_id}",
                f"--rdzv-conf=is_host={1 if order == 0 else 0},join_timeout=120",
                f"--local-addr={self.addresses[node]}",
                "--max-restarts=0",
                *script,
            ]
            runs.append(self.start(node, launcher, env=environment))
        return runs

    def wait(self, runs: Sequence[NodeRun], *, timeout: float = 240.0) -> list[NodeRun]:
        """Wait for every run; at ``timeout`` kill every process of their nodes and raise a
        :class:`NetnsError` with every node's log tail."""
        deadline = time.monotonic() + timeout
        for run in runs:
            try:
                run.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for node in sorted({r.node for r in runs}):
                    _kill_namespace(self.namespace(node))
                tails = "\n".join(f"--- node {r.node} ---\n{r.output()[-3000:]}" for r in runs)
                raise NetnsError(f"torchrun did not finish within {timeout:.0f} s:\n{tails}") from None
        return list(runs)

    def kill_node(self, node: int) -> None:
        """``kill -9`` every process of ``node`` (its disk stays as it is)."""
        _kill_namespace(self.namespace(node))

    def leftovers(self) -> dict[str, list[str]]:
        return leftovers_of(self.tag, self.work)

    def close(self) -> list[str]:
        for run in self.runs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.process.pid, signal.SIGKILL)
        problems = _remove(self.tag, self.node_count)
        for run in self.runs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.process.wait(10)
        return problems


def leftovers_of(tag: str, work: Path) -> dict[str, list[str]]:
    """What of the run ``tag`` is still on the host: its namespaces, links, mounts under
    ``work`` (in the host's mount table) and processes in its namespaces (found through
    ``/proc/*/ns/net``, so a process whose namespace lost its name is found too)."""
    namespaces = [name for name in _namespaces() if name.startswith(f"{tag}-")]
    links = [name for name in _links() if name.startswith(tag)]
    mounts = []
    with open("/proc/self/mountinfo") as table:
        for line in table:
            point = line.split()[4]
            if point == str(work) or point.startswith(f"{work}/"):
                mounts.append(point)
    return {"namespaces": namespaces, "links": links, "mounts": mounts, "processes": _processes_of(tag)}


def _processes_of(tag: str) -> list[str]:
    """Processes whose network namespace is one the run ``tag`` made (its inodes are recorded
    in ``<tag>.inodes`` next to the namespaces at creation)."""
    inodes = _INODES.get(tag, set())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(entry / "ns" / "net").st_ino in inodes:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{entry.name} {command[:120]}")
    return found


_INODES: dict[str, set[int]] = {}


@contextlib.contextmanager
def two_nodes(work: Path, *, node_count: int = 2) -> Iterator[TwoNodes]:
    """Build the nodes under ``work`` (see the module docstring), yield them, and remove
    everything on the way out, whatever the way out (an exception, ``KeyboardInterrupt``)."""
    reason = probe()
    if reason is not None:
        raise NetnsError(f"network namespaces are not available here: {reason}")
    sweep_stale()
    tag = f"{_PREFIX}{os.getpid()}{'abcdefghijklmnopqrstuvwxy'[next(_counter) % 25]}"
    harness = TwoNodes(work=work, tag=tag, subnet=_free_subnet(), node_count=node_count)
    work.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with _terminate_raises():
        try:
            harness.build()
            _INODES[tag] = {os.stat(f"/run/netns/{harness.namespace(node)}").st_ino for node in range(node_count)}
            harness.check_reachable()
            yield harness
        finally:
            with _uninterruptible():
                problems = harness.close()
            if problems:
                sys.stderr.write(f"cleanup of {tag} left: {problems}\n")
    if problems:
        raise NetnsError(f"cleanup of {tag} left: {problems}")


class Terminated(NetnsError):
    """SIGTERM arrived while the nodes were up (raised on the main thread, so cleanup runs)."""


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    """While the nodes are up, SIGTERM (a CI job cancelled) raises :class:`Terminated` on the
    main thread instead of ending the process without cleanup; an existing handler is kept."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise Terminated("SIGTERM while two nodes were up: removing them")

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _uninterruptible() -> Iterator[None]:
    """Hold SIGINT and SIGTERM during cleanup (a second Ctrl-C would leave namespaces behind);
    they are delivered when cleanup ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
