"""The simulated runner: stands in for `ModelRunner` behind the scheduler's `execute(segments)`.

It computes no logits: sampled tokens come from the trace (`SimRequest.output_unit`), and each step's duration
comes from the cost model (cost.py) over the step's segments in real tokens.

Units. With `unit` U > 1 every prompt token id stands for U real tokens (so a 1M-token prompt is 8K ids at
U = 128, and the real radix cache, pools and scheduler work on 8K-long lists); the window, page, chunk and
length buckets are divided by U (engine.py). Decode stays per real token: a request emits one output *unit* id
per U real tokens, and in the steps between it gets an empty segment (the scheduler gives a request whose
tokens are all computed an n = 0 segment), which this runner counts as one real decode token and answers with
no sample. So every step is one real iteration, TTFT and decode timing are per real token, and with U = 1 the
runner emits a token every step, exactly like the live engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.sampler import Sampled
from ..engine.scheduler import Segment, SegmentResult
from .cost import CostModel
from .trace import SimRequest


@dataclass
class _State:
    spec: SimRequest
    kv: object = None  # the RequestKV of the admission this state follows
    decoding: bool = False
    generated: int = 0  # real output tokens so far


def output_units(output_len: int, unit: int) -> int:
    """Output ids a request of `output_len` real tokens emits: the first token, then one per U tokens."""
    return 1 + -(-(max(1, output_len) - 1) // unit)


class SimRunner:
    def __init__(self, cost: CostModel, unit: int = 1):
        self.cost, self.unit = cost, unit
        self.states: dict[int, _State] = {}
        self.last_seconds = 0.0
        self.steps = 0
        self.busy_s = 0.0

    # The engine's `Drafter` (engine/interfaces.py): plain decoding here, speculation in sim/speculation.py.
    def draft_tokens(self, r) -> int:
        """Draft positions a decoding request verifies this step (speculation: sim/speculation.py)."""
        return 0

    def before_cache(self, requests: list) -> list[bool]:
        return [True] * len(requests)

    def release(self, r) -> None:
        """Nothing to drop: the worker forgets a request's state when it records it (SimWorker._on_finish)."""
        return None

    def register(self, request_id: int, spec: SimRequest) -> None:
        self.states[request_id] = _State(spec)

    def forget(self, request_id: int) -> None:
        self.states.pop(request_id, None)

    def _real_pos(self, st: _State, r, u: int) -> int:
        """Real tokens before unit id position u of r's sequence (prompt units, then output units)."""
        U, P = self.unit, len(r.prompt)
        if u <= P:
            return min(u * U, st.spec.prompt_len)
        k = u - P  # output units before u: the first is one real token, the others U each
        return st.spec.prompt_len + min(st.generated, 1 + (k - 1) * U)

    def execute(self, segments: list[Segment]) -> list[SegmentResult]:
        real = []
        results = []
        for seg in segments:
            r = seg.request
            st = self.states[r.id]
            if st.kv is not r.kv:  # a new admission (first, or after a preemption): prefill from the match
                st.kv, st.decoding = r.kv, False
            if st.decoding:
                start = st.spec.prompt_len + st.generated - 1  # the last sampled token's position
                real.append((start, 1, True))
                results.append(self._decode(st, r))
                continue
            a, b = self._real_pos(st, r, seg.start), self._real_pos(st, r, seg.start + seg.n)
            if not seg.samples:
                real.append((a, b - a, False))
                results.append(SegmentResult(None, []))
                continue
            st.decoding = True
            if not r.output:  # the prompt's last chunk: the first token
                real.append((a, b - a, True))
                st.generated = 1
                results.append(SegmentResult(Sampled(st.spec.output_unit(0), 0.0, []), []))
            else:  # recomputed after a preemption: the chunk ends where decoding stopped, then one more token
                real.append((a, max(1, b - a), True))
                results.append(self._decode(st, r))
        self.last_seconds = self.cost.step_seconds(real)
        self.steps += 1
        self.busy_s += self.last_seconds
        return results

    def _decode(self, st: _State, r) -> SegmentResult:
        """One real decode token; emits output unit j once its last real token is generated."""
        st.generated += 1
        g, U = st.generated, self.unit
        total = output_units(st.spec.output_len, U)
        j = len(r.output)  # the next output unit to emit
        if j >= total:
            return SegmentResult(None, [])
        boundary = 1 + j * U  # unit j ends at this real token
        if g >= min(boundary, st.spec.output_len):
            return SegmentResult(Sampled(st.spec.output_unit(j), 0.0, []), [])
        return SegmentResult(None, [])
