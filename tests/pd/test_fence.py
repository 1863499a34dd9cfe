"""Fencing a room (llm_backend/pd/prefill.py, decode.py): once the prefill side's `Room.close()` returns, no write
of the room is in flight and none can start, so the decode worker may free the room's slots. Unit level, with a
transfer engine whose write blocks until the test lets it go."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from llm_backend.kv.transfer import TransferError
from llm_backend.pd.prefill import Room
from llm_backend.pd.rule import TransferRule


class BlockingEngine:
    """A transfer engine whose write waits for `go`, so a write can be caught in flight."""

    def __init__(self):
        self.started, self.go, self.writes = threading.Event(), threading.Event(), 0

    ranks = (("me:1", None),)

    def write_ranks(self, targets, full, swa) -> int:
        assert targets == (("peer:1", None),)
        self.started.set()
        assert self.go.wait(10)
        self.writes += 1
        return 100 * len(full[0]) + 10 * len(swa[0])


def _room(engine) -> tuple[Room, SimpleNamespace]:
    rule = TransferRule(8, 0, 4, 1)
    a, b = rule.swa_range
    room = Room("r1", (("peer:1", None),), rule, list(range(100, 108)), list(range(200, 200 + b - a)), engine)  # type: ignore[arg-type]
    kv = SimpleNamespace(full=list(range(8)), swa=list(range(8)))
    return room, kv


def test_close_waits_for_the_write_in_flight_and_refuses_later_writes():
    engine = BlockingEngine()
    room, kv = _room(engine)
    writer = threading.Thread(target=room.write, args=(kv, 4))
    writer.start()
    assert engine.started.wait(5)
    closed_at: list[float] = []
    closer = threading.Thread(target=lambda: (room.close(), closed_at.append(time.monotonic())))
    closer.start()
    time.sleep(0.3)
    assert not closed_at, "close() returned while a write of the room was in flight"
    released_at = time.monotonic()
    engine.go.set()
    writer.join(5)
    closer.join(5)
    assert closed_at and closed_at[0] >= released_at and room.closed
    assert engine.writes == 1 and room.sent == 4
    with pytest.raises(TransferError, match="closed"):
        room.write(kv, 8)
    assert engine.writes == 1 and room.sent == 4  # nothing written after the close


def test_an_open_room_writes_everything_it_is_given():
    engine = BlockingEngine()
    engine.go.set()
    room, kv = _room(engine)
    room.write(kv, 5)
    room.write(kv, 8)
    assert room.sent == 8 and engine.writes == 2 and room.bytes == 100 * 8 + 10 * room.rule.swa_tokens
