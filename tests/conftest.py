"""Shared fixtures: generated test images and real encoder servers started as subprocesses."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

# Triton kernels run on the CPU through Triton's interpreter when there is no GPU. It must be set
# before any kernel module is imported (Triton decides at decoration time).
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def textured(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Photo-like content (smooth gradients + texture + edges), HxWx3 uint8."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([
        128 + 90 * np.sin(x / (7 + seed % 5) + y / 13),
        128 + 90 * np.cos(y / (5 + seed % 3) - x / 17),
        (x * 255 / max(w - 1, 1) + y * 97 / max(h - 1, 1)) % 256,
    ], -1)
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode_image(arr: np.ndarray, fmt: str = "JPEG", mode: str | None = None, **save_kw) -> bytes:
    from PIL import Image

    img = Image.fromarray(arr)
    if mode:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save_kw)
    return buf.getvalue()


@dataclass
class ServerProc:
    address: str
    proc: subprocess.Popen
    stderr_lines: list[str] = field(default_factory=list)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_server(args: list[str], subcommand: str = "encoder", timeout: float = 120) -> ServerProc:
    """Starts `mimo-epd <subcommand> --port 0 ARGS` and waits for its `ready host:port` line."""
    cmd = [sys.executable, "-m", "mimo_epd", subcommand, "--port", "0", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr_lines: list[str] = []
    threading.Thread(target=lambda: [stderr_lines.append(line) for line in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + timeout
    address = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        if line.startswith("ready "):
            address = line.split()[1]
            break
    if address is None:
        proc.kill()
        raise RuntimeError(f"server did not become ready: {''.join(stderr_lines)[-3000:]}")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return ServerProc(address, proc, stderr_lines)


@pytest.fixture(scope="session")
def tiny_tower():
    from encoder_server.models import load_vision_model

    return load_vision_model("tiny")
