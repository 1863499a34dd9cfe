"""Shared fixtures: generated test images and real encoder servers started as subprocesses."""

from __future__ import annotations

import io
import os

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
    img = np.stack(
        [
            128 + 90 * np.sin(x / (7 + seed % 5) + y / 13),
            128 + 90 * np.cos(y / (5 + seed % 3) - x / 17),
            (x * 255 / max(w - 1, 1) + y * 97 / max(h - 1, 1)) % 256,
        ],
        -1,
    )
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


def start_server(args: list[str], subcommand: str = "encoder", timeout: float = 120):
    """The product's own launcher helper, run from the project root."""
    from mimo_epd.testing.servers import start_server as _start

    return _start(args, subcommand, timeout, cwd=ROOT)


@pytest.fixture(scope="session")
def tiny_tower():
    from encoder_server.models import load_vision_model

    return load_vision_model("tiny")


# The suite runs in two processes, one test file at a time each (`make test`: `--dist loadfile
# --no-loadscope-reorder`), in collection order. Files that take half a minute or more go first, longest first, so the
# short ones fill in around them at the end instead of one long file starting last and running alone. The times
# are from `--junitxml` on the two-core development machine (a file's tests summed); a file not listed keeps its
# place after them.
RUN_FIRST = (  # seconds on 2026-12-03, quiet: 819 s of wall time for 1577 s of tests
    "tests/cli/test_docs_commands.py",  # 199
    "tests/cli/test_bench_quick.py",  # 187
    "tests/cli/test_readme_commands.py",  # 68
    "tests/router/test_http_routing.py",  # 67
    "tests/llm/test_engine.py",  # 53
    "tests/parallel/test_data_parallel.py",  # 50 (2026-12-07)
    "tests/integration/test_encoder_server.py",  # 52
    "tests/chaos/test_chaos_smoke.py",  # 42
    "tests/cli/test_node_metrics.py",  # 41
    "tests/encoder/test_pipeline_switches.py",  # 37
    "tests/llm/test_speculative.py",  # 36
    "tests/cli/test_serve_checkpoint.py",  # 36
    "tests/router/test_llm_router.py",  # 36
    "tests/encoder/test_admission.py",  # 35
    "tests/llm/test_kv_store_mooncake.py",  # 34
    "tests/pd/test_pd_faults.py",  # 33
    "tests/cli/test_quickstart.py",  # 33
    "tests/integration/test_node.py",  # 32
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order
