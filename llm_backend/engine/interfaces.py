"""The engine's seams: what a feature implements to plug into the scheduler and the runner.

The engine (scheduler, runner, `LLM`) calls features through these declared interfaces only; it never imports a
feature's module, and a feature never sets attributes on the engine's objects. Each is passed to a constructor:

- `Constraint` (grammar-constrained output, `agentic/grammar.py`): one per request, made by the request's
  `OutputGrammar.matcher()`; the runner masks logits rows through it, the scheduler advances it with every token it
  appends, the speculative verifier accepts drafts tentatively and rolls them back.
- `Drafter` (speculative decoding, `engine/speculative.py`): the scheduler asks it how many draft positions a
  decoding request verifies, tells it before a request's KV enters the prefix cache, and releases its per-request
  state when the request ends. The drafter keeps that state itself, keyed by request id.
- `KVLoader` (the KV tiers, `kv/tiers/`): the runner starts the forward's queued host / store copies through it,
  layer by layer.
- `SchedulerRole`, `Ticket` and `TransferPort` (prefill / decode disaggregation, `pd/`): the worker hands the
  engine its role, which builds the role's scheduler on the engine's parts; that scheduler receives a request's
  ticket with the request (`Scheduler.add`) and keeps it keyed by request id; a decode scheduler opens and closes
  its KV transfers through its port.

`RequestStats` is what the engine fills in for the server about one request (transfers and speculation), so the
server never reads a feature's own objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:  # pragma: no cover - types only
    from ..kv import SlotPool, SWARadixCache
    from .request import Request
    from .scheduler import Scheduler


class ConstraintMasker(Protocol):
    """Masks a batch of logits rows, row i by constraints[i]'s current state, in one pass (one bitmask)."""

    def apply(self, constraints: list[Constraint], rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Returns new float32 rows; forbidden tokens are -inf. Called on the engine thread only."""
        ...


class Constraint(Protocol):
    """One request's output constraint. Contract: the scheduler calls `accept` with every token it appends to the
    request (in order); a verifier may accept tokens tentatively and then `rollback(n)` exactly those n; once
    `terminated` is True only the model's stop tokens are allowed. `masker` batches the masks of every constraint
    that shares it."""

    masker: ConstraintMasker

    def accept(self, token: int) -> bool: ...

    def rollback(self, n: int) -> None: ...

    @property
    def terminated(self) -> bool: ...


class OutputGrammar(Protocol):
    """A compiled output constraint (`SamplingParams.grammar`): each request gets its own matcher."""

    def matcher(self) -> Constraint: ...


def mask_rows(constraints: list[Constraint], rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Masks rows[i] by constraints[i], one batched call per masker (requests of one step may use several)."""
    out = list(rows)
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(constraints):
        groups.setdefault(id(c.masker), []).append(i)
    for idx in groups.values():
        masked = constraints[idx[0]].masker.apply([constraints[i] for i in idx], [rows[i] for i in idx])
        for i, row in zip(idx, masked):
            out[i] = row
    return out


class Drafter(Protocol):
    """Speculative decoding as the scheduler sees it. Contract: `draft_tokens` is asked for a decoding request
    (one token left to compute) and may answer 0; the scheduler reserves that many slots after the request's last
    token and the runner fills them. `before_cache` is called before requests' KV enters the prefix cache (a False
    keeps that request's KV out of the cache). `release` is called once when a request ends (its KV is gone): the
    drafter drops what it kept for it."""

    def draft_tokens(self, r: Request) -> int: ...

    def before_cache(self, requests: list[Request]) -> list[bool]: ...

    def release(self, r: Request) -> None: ...


class NoDrafter:
    """Plain decoding: no drafts, nothing deferred, nothing kept."""

    def draft_tokens(self, r: Request) -> int:
        return 0

    def before_cache(self, requests: list[Request]) -> list[bool]:
        return [True] * len(requests)

    def release(self, r: Request) -> None:
        return None


class LayerLoad(Protocol):
    """The copies of one forward, running layer by layer: `wait(layer)` before a layer reads its KV."""

    def wait(self, layer: int) -> None: ...

    def finish(self) -> None: ...


class KVLoader(Protocol):
    """Queued copies into the device pools (the host and shared KV tiers). Contract: the runner calls
    `start_load()` once per forward, before attention reads the pools, and `finish()` on what it returned after."""

    def start_load(self) -> LayerLoad | None: ...


class Ticket:
    """What a role's scheduler needs of a request besides its prompt (pd/: the decode worker's choice of prefill
    worker, the prefill worker's room). The plain scheduler takes none."""


class TransferPort(Protocol):
    """A decode scheduler's KV transfers. Contract: `start(request, room, news)` opens the transfer of the room
    (called on the engine thread, returns at once); the port reports `news(kind, payload)` from any thread, kinds
    "alive", "done" (payload: the first token's message) and "failed" (payload: why), at most one of the last two.
    `release(room, released)` gives a room up: `released(why)` is called once the peer writes no more into its
    slots (or is gone)."""

    def start(self, r: Request, room: object, news: Callable[[str, object], None]) -> None: ...

    def release(self, room: object, released: Callable[[str], None]) -> None: ...


class SchedulerRole(Protocol):
    """A worker role's scheduler (pd/: prefill, decode), built by the engine on its parts. `wake()` wakes the
    engine loop from any thread (news for the scheduler, such as a finished transfer); `parts` are the plain
    scheduler's keyword arguments. The role keeps its own settings and ports from its own constructor."""

    def scheduler(
        self, cache: SWARadixCache, full_pool: SlotPool, swa_pool: SlotPool, wake: Callable[[], None], **parts
    ) -> Scheduler: ...


@dataclass
class RequestStats:
    """Engine-filled facts about one request for the server: where its prompt was prefilled and what its KV
    transfer cost (prefill / decode disaggregation), and its speculative decoding counts."""

    prefill_used: str = ""  # the prefill worker that computed the prompt ("" = this worker)
    prefill_failed: str = ""  # the prefill worker whose transfer failed before this one computed it
    kv_bytes: int = 0
    transfer_s: float = 0.0
    drafted_tokens: int = 0  # draft positions verified
    accepted_tokens: int = 0  # of those, the ones the target accepted
