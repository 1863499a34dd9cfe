"""What a router accepts from the shared state: every record read from Redis is checked here before it is used.

Anyone who can write to the Redis can put anything there (a wrong version of this program, a test, a typo in
redis-cli). A router that trusts it fails: a KV value that is not an integer made every routed request a 500,
an unparsable worker address made requests routed to it a 500, and a non-integer `block_size` ended the
discovery task for good. So:

- `member(mid, fields)`: a member record, checked: `kind` llm | encoder | router (a router sharing its encoder
  loads: `encoder_load` a JSON object of at most 4096 `host:port` -> integer >= 0, and no address), `address` (and an llm worker's
  optional `http_address`) a `host:port` with a port in 1..65535 and a host without spaces, `%` or `/`;
  `block_size` an integer in 1..65536; the load fields and `kv_seq` integers >= 0. A record that breaks a rule is `None`
  (the reason in `BadRecord`), skipped by the caller and counted.
- `kv_state(value)`: a KV-index value (a block's state, small non-negative integer); anything else is
  treated as absent and counted.
- `BadRecords`: the counts by kind of record (`router_bad_records{what}` on /metrics), and one warning per
  offending key, not one per read.

Invariant: nothing in this module raises on any bytes or strings; it returns a clean value or None.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

log = logging.getLogger(__name__)

LOAD_FIELDS = ("queued_tokens", "running_tokens", "waiting", "running")
MAX_BLOCK_SIZE = 1 << 16
MAX_STATE = 255


class BadRecord(ValueError):
    pass


def check_address(value, field: str) -> str:
    """`host:port` (IPv6 in brackets), as a worker registers itself; raises BadRecord."""
    if not isinstance(value, str) or not value or len(value) > 300:
        raise BadRecord(f"{field}: not an address")
    host, sep, port = value.rpartition(":")
    if not sep or not host or any(c in host for c in " %/\\@?#\t\r\n"):
        raise BadRecord(f"{field}: {value[:64]!r} is not HOST:PORT")
    if host.startswith("[") != host.endswith("]"):
        raise BadRecord(f"{field}: {value[:64]!r} has an unbalanced IPv6 bracket")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise BadRecord(f"{field}: port {port[:16]!r} is not in 1..65535")
    return value


def _int(value, field: str, lo: int, hi: int) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise BadRecord(f"{field}: {str(value)[:32]!r} is not an integer") from None
    if not lo <= n <= hi:
        raise BadRecord(f"{field}: {n} is not in {lo}..{hi}")
    return n


def encoder_load(value) -> dict[str, int]:
    """A router's `encoder_load` field: {encoder address: items in flight}; raises BadRecord."""
    try:
        loads = json.loads(value)
    except (TypeError, ValueError):
        raise BadRecord("encoder_load: not JSON") from None
    if not isinstance(loads, dict) or len(loads) > 4096:
        raise BadRecord("encoder_load: not an object of at most 4096 encoders")
    return {check_address(k, "encoder_load"): _int(v, "encoder_load", 0, 1 << 31) for k, v in loads.items()}


def member(mid: str, fields: dict) -> dict:
    """The member record, checked (returned as it was: strings, as the state stores them); raises BadRecord."""
    kind = fields.get("kind")
    if kind == "router":
        encoder_load(fields.get("encoder_load", "{}"))
        return fields
    if kind not in ("llm", "encoder"):
        raise BadRecord(f"kind: {str(kind)[:32]!r} is not llm, encoder or router")
    check_address(fields.get("address", mid.split("/", 1)[-1]), "address")
    if kind == "llm":
        if fields.get("http_address"):
            check_address(fields["http_address"], "http_address")
        if fields.get("block_size") not in (None, ""):
            _int(fields["block_size"], "block_size", 1, MAX_BLOCK_SIZE)
        for k in (*LOAD_FIELDS, "kv_seq"):
            _int(fields.get(k) or 0, k, 0, 1 << 62)
    return fields


def kv_state(value) -> int | None:
    """A KV-index value as an int, or None when it is not one (then the block counts as absent)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if 0 <= n <= MAX_STATE else None


class BadRecords:
    """Counts of records skipped, by what they were; warns once per key."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._warned: set[str] = set()

    def add(self, what: str, key: str, why: str) -> None:
        self.counts[what] += 1
        if key not in self._warned and len(self._warned) < 10_000:
            self._warned.add(key)
            log.warning("router state: skipping a bad %s record %s (%s)", what, key[:128], why)
