"""A real redis-server for the router tests: started on a free loopback port with a temp dir and no
persistence (scripts/setup_env.sh installs the Debian package when it is missing)."""

from __future__ import annotations

import shutil

import pytest

from mimo_epd.testing.redis_server import RedisServer, free_port  # noqa: F401 - free_port: used by the tests


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip(
            "redis-server is not installed (scripts/setup_env.sh installs the Debian package redis-server "
            "when run as root; install it to run the shared-state tests)"
        )
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
