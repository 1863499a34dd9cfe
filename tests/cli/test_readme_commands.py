"""Every command of the README's quick start, read from the README itself and run as written against `serve`
started as `make serve` starts it. The only substitutions: the node listens on free ports instead of
50051 / 8000 (so tests never collide), `photo.jpg` is a generated photo, and the load tests run 10 s instead of 30 s.
"""

import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mimo_epd.testing.media_server import jpeg_bytes, photo_like
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

README = Path(ROOT, "README.md").read_text()
BIN = Path(sys.executable).parent


def quick_start() -> tuple[list[str], list[str]]:
    """(shell commands, python snippets) of the README's `## Quick start` section."""
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    shell, python = [], []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
        if lang == "python":
            python.append(body)
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line:
                shell.append(line)
    return shell, python


class Node:
    """`mimo-epd serve` as `make serve` runs it, on free ports."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [str(BIN / "mimo-epd"), "serve", "--port", "0", "--http-port", "0"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.grpc = self.http = None
        for line in self.proc.stdout:
            if line.startswith("http "):
                self.http = line.split()[1]
            if line.startswith("ready "):
                self.grpc = line.split()[1]
                break
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        if self.grpc is None or self.http is None:
            self.proc.kill()
            raise RuntimeError("serve did not print its http and ready lines")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module")
def node():
    n = Node()
    yield n
    assert n.stop() == 0


def _localise(text: str, node: Node) -> str:
    text = text.replace("127.0.0.1:50051", node.grpc).replace("127.0.0.1:8000", node.http)
    return text.replace(".venv/bin/", f"{BIN}/").replace("--run-time 30s", "--run-time 10s")


def test_the_readme_has_a_quick_start_of_real_commands():
    shell, python = quick_start()
    assert len(shell) >= 6 and python, (shell, python)
    assert any(c.startswith("curl ") for c in shell) and any("loadtest generate" in c for c in shell)


@pytest.mark.parametrize("index", range(len(quick_start()[0])))
def test_each_quick_start_command_as_written(node, tmp_path_factory, index):
    work = tmp_path_factory.getbasetemp() / "readme"
    work.mkdir(exist_ok=True)
    if not (work / "photo.jpg").exists():
        (work / "photo.jpg").write_bytes(jpeg_bytes(photo_like(480, 640, seed=3)))
    command = quick_start()[0][index]
    r = subprocess.run(_localise(command, node), shell=True, cwd=work, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{command}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
    if command.startswith("curl"):
        assert '"choices"' in r.stdout, r.stdout
    if "loadtest" in command:
        assert re.search(r'"failures": ?0[,}]', r.stdout), r.stdout[-2000:]


def test_the_python_snippet_as_written(node):
    for snippet in quick_start()[1]:
        r = subprocess.run(
            [sys.executable, "-c", _localise(snippet, node)], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert "CompletionUsage" in r.stdout or "prompt_tokens" in r.stdout, r.stdout
