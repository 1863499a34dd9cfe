"""Every command of docs/routing.md and docs/api.md, read from the docs themselves and run as written (as
tests/cli/test_readme_commands.py runs the README's). The only substitutions: each fixed port becomes a free one (the
same one throughout its block) and a `serve` without `--port` gets free ports; the two-machine example's
placeholders (R, <this machine's address>, <router>) are 127.0.0.1, with a Redis started for R; the image URL on
example.com is a local media server's (the node is started allowing it); `photo.jpg` is a generated photo; load tests
run 5 s. Server commands (`serve`, `router`, `llm`, `encoder`, `redis-server`) are started and stopped at the block's
end (each must exit 0): consecutive ones together (a Redis first), as a shell's `&` would; the rest must succeed
and answer without an error.
"""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mimo_epd.testing.media_server import MediaServer, jpeg_bytes, photo_like
from mimo_epd.testing.redis_server import RedisServer
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
SERVERS = ("serve", "router", "llm", "encoder")
PORT = re.compile(r"(?<![\w.])\d{4,5}(?![\w.])")


def blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", Path(ROOT, "docs", doc).read_text(), re.S)


def commands(block: str) -> list[str]:
    """One command per entry: continuations joined, comments dropped, `a & b &` split."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("  #", 1)[0].strip()
        if line and not line.startswith("#"):
            out += [c.strip() for c in line.split(" & ") if c.strip()]
    return [c.removesuffix("&").strip() for c in out]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localise(command: str, ports: dict[str, str]) -> str:
    command = PORT.sub(lambda m: ports.setdefault(m.group(0), str(free_port())), command)
    for placeholder in ("redis://R:", "<this machine's address>", "<router>"):
        command = command.replace(placeholder, "redis://127.0.0.1:" if placeholder.startswith("redis") else "127.0.0.1")
    return command.replace(".venv/bin/", f"{BIN}/").replace("--run-time 30s", "--run-time 5s")


class Server:
    """A server command of a block, started and waited for (its ready line, or Redis answering)."""

    def __init__(self, command: str, cwd: Path):
        self.command = command
        env, args = split_env(command)
        self.proc = subprocess.Popen(
            args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
        )
        self.log: list[str] = []
        self.http = self.grpc = ""
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stderr], daemon=True).start()
        if args[0] == "redis-server":
            port = int(args[args.index("--port") + 1])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and subprocess.run(["redis-cli", "-p", str(port), "ping"]).returncode:
                time.sleep(0.1)
            return
        for line in self.proc.stdout:
            if line.startswith("http "):
                self.http = line.split()[1]
            if line.startswith("ready "):
                self.grpc = line.split()[1]
                threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
                return
        raise AssertionError(f"{command} did not start: {''.join(self.log)[-3000:]}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:  # what it waits for, in its log (the asserting message shows it)
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            self.proc.kill()
            return self.proc.wait()


def split_env(command: str) -> tuple[dict[str, str], list[str]]:
    """`VAR=value ... cmd args` -> ({VAR: value}, [cmd, args])."""
    args = shlex.split(command)
    env = {}
    while args and re.match(r"^[A-Z_][A-Z0-9_]*=", args[0]):
        key, _, value = args.pop(0).partition("=")
        env[key] = value
    return env, args


def is_server(command: str) -> bool:
    args = split_env(command)[1]
    return args[0] == "redis-server" or (len(args) > 1 and args[0].endswith("mimo-epd") and args[1] in SERVERS)


def run_block(block: str, cwd: Path, ports: dict[str, str] | None = None) -> None:
    """Runs a block's commands in order (servers started, then stopped at the end); `ports`: fixed ports that
    already stand for a running server's."""
    ports = dict(ports or {})
    if not re.search(r"mimo-epd (serve|router|llm|encoder)\b|redis-server", block):  # clients only: one script
        r = subprocess.run(
            ["bash", "-ec", localise(block, ports)], cwd=cwd, capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, f"{block}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
        assert '"error"' not in r.stdout, r.stdout[-3000:]
        return
    redis = None
    if "redis://R:" in block and "redis-server" not in block:  # machine R's Redis
        ports["6379"] = str(free_port())
        redis = RedisServer(cwd, int(ports["6379"]))
        redis.start()
    servers: list[Server] = []
    starting: list[str] = []  # consecutive server commands, started together (each waits for its own ready line)

    def start_all() -> None:
        if starting:
            with ThreadPoolExecutor(len(starting)) as ex:
                futures = [ex.submit(Server, c, cwd) for c in starting]
                for f in futures:  # every one is waited for (and kept for stopping) before a failure is raised
                    if f.exception() is None:
                        servers.append(f.result())
                for f in futures:
                    f.result()
            starting.clear()

    try:
        for command in commands(block):
            command = localise(command, ports)
            if is_server(command):
                if " serve" in command:  # as the README test: free ports for what the command leaves default
                    command += "" if "--port" in command else " --port 0"
                    command += "" if "--http-port" in command else " --http-port 0"
                if split_env(command)[1][0] == "redis-server":  # what the others connect to: up first
                    start_all()
                    servers.append(Server(command, cwd))
                else:
                    starting.append(command)
                continue
            start_all()
            for attempt in range(5):  # a router finds the workers of a node that joined within a second or so
                r = subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=300)
                if r.returncode == 0 or attempt == 4:
                    break
                time.sleep(1)
            assert r.returncode == 0, f"{command}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
            assert '"error"' not in r.stdout, f"{command}\n{r.stdout[-2000:]}"
        start_all()  # a block of servers only: they must start (and stop cleanly)
    finally:
        codes = [(s.command, s.stop(), "".join(s.log)[-6000:]) for s in reversed(servers)]
        if redis is not None:
            redis.stop()
    for command, rc, log in codes:
        assert rc == 0, f"{command} exited with {rc}: {log}"


def test_the_docs_have_commands():
    assert len(blocks("routing.md", "bash")) >= 4 and len(blocks("api.md", "bash")) >= 2
    assert all(
        "mimo-epd " not in c or ".venv/bin/mimo-epd" in c for b in blocks("routing.md", "bash") for c in commands(b)
    )


@pytest.mark.parametrize("index", range(len(blocks("routing.md", "bash"))))
def test_each_routing_md_block_as_written(tmp_path, index):
    run_block(blocks("routing.md", "bash")[index], tmp_path)


@pytest.fixture(scope="module")
def api_node(tmp_path_factory):
    work = tmp_path_factory.mktemp("api")
    photo = jpeg_bytes(photo_like(240, 320, seed=3))
    (work / "photo.jpg").write_bytes(photo)
    with MediaServer({"cat.jpg": photo}) as media:
        node = Server(f"{BIN}/mimo-epd serve --port 0 --http-port 0 --url-allowlist 127.0.0.1/32", work)
        yield work, media.url("cat.jpg"), node
        assert node.stop() == 0


def test_each_api_md_command_as_written(api_node):
    """Against a node as `make serve` starts it: its ports stand for 8000 and 50051."""
    work, cat, node = api_node
    media_port = cat.split("/")[2].rsplit(":", 1)[1]
    ports = {"8000": node.http.rsplit(":", 1)[1], "50051": node.grpc.rsplit(":", 1)[1], media_port: media_port}
    for block in blocks("api.md", "bash"):  # a block that starts its own server gets its own ports
        own = re.search(r"mimo-epd (serve|router|llm|encoder)\b", block)
        run_block(block.replace("https://example.com/cat.jpg", cat), work, None if own else ports)
    for snippet in blocks("api.md", "python"):
        code = snippet.replace("127.0.0.1:8000", node.http)
        r = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
