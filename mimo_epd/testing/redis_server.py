"""A throwaway redis-server on a free loopback port (the Debian package's binary): no persistence, its files in
a given directory, so a restart comes back empty. Used by the tests (the shared-state and KV-store fixtures)
and by the chaos campaign's fleet."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports_from(n: int) -> int:
    """A port P with P .. P+n-1 all free now (`serve --metrics-port P` puts its encoders' metrics on P+1, P+2, ...)."""
    while True:
        p = free_port()
        if p + n > 65535:
            continue
        socks = []
        try:
            for q in range(p, p + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


class RedisServer:
    def __init__(self, workdir, port: int = 0):
        self.dir, self.port, self.proc = workdir, port or free_port(), None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Starts it (again, on the same port) and waits until it answers PING."""
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
            + ["--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.answers():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} (port {self.port} taken?)")
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on 127.0.0.1:{self.port} within {timeout:.0f} s")

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
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
