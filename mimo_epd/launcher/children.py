"""The node's child processes: one `mimo-epd encoder` or `mimo-epd llm` server each (`ChildProcess`), started
with the environment a node's processes share (`worker_env`), and the one `Supervisor` that restarts a child
that exits unexpectedly on the same port.

A child is started with `--port 0` the first time and keeps the port its ready line names on every restart, so
the routers' addresses stay valid; meanwhile the encoder router's health checks (or the LLM router's retries)
send its work elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Callable

from mimo_epd.common.auth import INTERNAL_KEY_ENV, internal_key
from mimo_epd.common.parent import child_env

log = logging.getLogger("mimo_epd.launcher")

# glibc gives every thread that allocates its own malloc arena (up to 8 per core) and keeps what each frees:
# an encoder's fetch / decode / forward threads then hold ever more freed heap. Two arenas keep it flat: a
# 600 s chaos soak measured the encoders' anonymous memory at +0.2-0.3 MB/min (3.7-4.5 MB/min without), and
# `bench encoder` measured the same QPS within noise (tiny 33.2 vs 34.6, large 3.69 vs 3.41). A value the user
# set wins.
MALLOC_ARENAS = "2"


def worker_env() -> dict:
    """The environment of a process `serve` starts: exits with it, and at most MALLOC_ARENAS malloc arenas."""
    env = child_env()
    env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENAS)
    key = internal_key()
    if key:  # the node's internal key: its workers accept it (and send it back with media), never in argv
        env[INTERNAL_KEY_ENV] = key
    return env


class ChildProcess:
    """A `mimo-epd <subcommand>` server process on `host` (an encoder, or an LLM worker)."""

    def __init__(
        self, index: int, args: list[str], timeout_s: float, subcommand: str = "encoder", host: str = "127.0.0.1"
    ):
        self.index, self.args, self.timeout_s, self.subcommand = index, args, timeout_s, subcommand
        self.host = host
        self.port = 0
        self.http_port: int | None = None  # set: pass --http-port (0 first, then the same port on restarts)
        self.metrics_port = 0  # an encoder's /metrics port (in the node's merged metrics)
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def name(self) -> str:
        return f"{'LLM worker' if self.subcommand == 'llm' else self.subcommand} {self.index}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_endpoint(self) -> str:
        return f"{self.host}:{self.http_port}" if self.http_port else ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        cmd = [sys.executable, "-m", "mimo_epd", self.subcommand, "--host", self.host, "--port", str(self.port)]
        cmd += self.args
        if self.http_port is not None:
            cmd += ["--http-port", str(self.http_port)]
        # worker_env: the child exits (SIGTERM, its drain) when this launcher dies, even by SIGKILL; two arenas.
        # Its own session: a Ctrl-C in the terminal reaches the launcher only, which drains the node in order.
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, env=worker_env(), start_new_session=True
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._read_ready_line()
        except TimeoutError:
            self.proc.kill()
            raise RuntimeError(f"{self.name} was not ready within {self.timeout_s:g}s") from None
        asyncio.get_running_loop().create_task(self._drain())
        log.info("%s %d (pid %d) serving on %s", self.subcommand, self.index, self.proc.pid, self.endpoint)

    async def _read_ready_line(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited with {await self.proc.wait()} before it was ready")
            text = line.decode().strip()
            if text.startswith("http ") and self.http_port is not None:
                self.http_port = int(text.rsplit(":", 1)[1])
            if text.startswith("ready "):
                self.port = int(text.rsplit(":", 1)[1])
                return

    async def _drain(self) -> None:
        proc = self.proc
        while proc and proc.stdout and await proc.stdout.readline():
            pass

    async def stop(self, grace_s: float) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s + 5)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


class Supervisor:
    """Restarts a child that exits while the node runs, after `delay_s`, when `restart(child)` allows it; gives up
    on a child whose restart fails (its work keeps going to the others)."""

    def __init__(self, restart: Callable[[ChildProcess], bool], delay_s: float = 1.0):
        self.restart, self.delay_s = restart, delay_s
        self.stopping = False
        self._tasks: list[asyncio.Task] = []

    def watch(self, children: list[ChildProcess]) -> None:
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._watch(c)) for c in children]

    async def _watch(self, child: ChildProcess) -> None:
        while not self.stopping and child.proc is not None:
            rc = await child.proc.wait()
            if self.stopping or not self.restart(child):
                return
            log.warning("%s (%s) exited with %s; restarting it", child.name, child.endpoint, rc)
            await asyncio.sleep(self.delay_s)
            try:
                await child.start()
            except (RuntimeError, OSError) as err:
                log.error("restarting %s failed: %s", child.name, err)
                return

    def stop(self) -> None:
        """The node stops its children on purpose from here on."""
        self.stopping = True
        for t in self._tasks:
            t.cancel()
