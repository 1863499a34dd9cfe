"""A throwaway `mooncake_master` on free loopback ports (the binary the `mooncake-transfer-engine` wheel ships):
its RPC port, its in-process HTTP metadata server (the transfer engine's metadata service) and its metrics port,
no HA, no snapshots, so a restart on the same ports comes back empty. Used by the tests and benchmarks of the
Mooncake KV store (`mooncake://` URLs)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from .redis_server import free_port


def master_binary() -> str | None:
    """The wheel's `mooncake_master` executable, or None when the wheel is not installed."""
    try:
        import mooncake
    except ImportError:
        return None
    exe = Path(mooncake.__file__).parent / "mooncake_master"
    return str(exe) if exe.is_file() else None


class MooncakeMaster:
    def __init__(self, workdir, port: int = 0, metadata_port: int = 0, metrics_port: int = 0):
        self.dir = Path(workdir)
        self.port, self.metadata_port = port or free_port(), metadata_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}?metadata=http://127.0.0.1:{self.metadata_port}/metadata"

    def start(self, timeout: float = 20.0) -> None:
        """Starts it (again, on the same ports) and waits until the RPC port and the metadata server answer."""
        exe = master_binary()
        if exe is None:
            raise RuntimeError("mooncake_master not found: install mooncake-transfer-engine-non-cuda")
        log = open(self.dir / f"mooncake_master.{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [exe, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true"]
            + [f"--http_metadata_server_port={self.metadata_port}", "--http_metadata_server_host=127.0.0.1"]
            + [f"--metrics_port={self.metrics_port}", "--metrics_host=127.0.0.1", "--logtostderr"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.answers():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} (see {self.dir})")
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not answer on 127.0.0.1:{self.port} within {timeout:.0f} s")

    def answers(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), 0.2).close()
            url = f"http://127.0.0.1:{self.metadata_port}/metadata?key=probe"
            try:
                urllib.request.urlopen(url, timeout=0.5).close()
            except urllib.error.HTTPError:
                pass  # 404 for an absent key: the server answers
            return True
        except OSError:
            return False

    def stop(self, graceful: bool = False) -> None:
        """SIGKILL (a crash: what the tests simulate), or SIGTERM and a wait (`graceful`)."""
        if not self.proc or self.proc.poll() is not None:
            return
        if graceful:
            self.proc.terminate()
            try:
                self.proc.wait(10)
                return
            except subprocess.TimeoutExpired:
                pass
        self.proc.kill()
        self.proc.wait()
